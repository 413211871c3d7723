"""The api road's byte path (plugin_utils/_mux/api_transfer.py, api_http.FileBody): the footer split across reads,
bodies shorter or longer than announced, 1-byte and empty files, and the kernel (sendfile) or one reused buffer
carrying an upload's body, against stand-in HTTP servers: one layer, its edge cases.

The whole road through the real stack is tests/integration/test_connection_api.py.
"""
import datetime
import hashlib
import http.server
import io
import os
import socket
import ssl
import threading

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_http, api_road, api_transfer
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

SID = "a1b2c3d4-e5f6-7890-abcd-ef1234567890"
ROUTE = "/v2/agents/sessions/%s" % SID


def footer(payload):
    return b"DOWSSHA1" + hashlib.sha256(payload).hexdigest().encode() + b"\n"


# -- the footer's rolling tail --------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 72, 73, 74, 5000])
@pytest.mark.parametrize("read", [1, 7, 73, 74, 4096])
def test_the_footer_is_found_whatever_the_reads_cut(size, read):
    payload = os.urandom(size)
    body = payload + footer(payload)
    got = bytearray()
    split = api_transfer.FooterSplit(got.extend)
    for i in range(0, len(body), read):
        split.feed(memoryview(body[i:i + read]))
        assert len(got) == max(0, i + min(read, len(body) - i) - api_transfer.FOOTER_BYTES)  # payload goes out at once
    assert bytes(got) == payload and split.footer_sha() == hashlib.sha256(payload).hexdigest()


@pytest.mark.parametrize("tail", [b"", b"DOWSSHA1", footer(b"x")[:-1], footer(b"x")[:-1] + b"\r", b"DOWSSHA2" + footer(b"x")[8:],
                                  footer(b"x").upper()])
def test_a_tail_without_the_footers_shape_is_no_footer(tail):
    split = api_transfer.FooterSplit(lambda view: None)
    split.feed(memoryview(b"payload" + tail))
    assert split.footer_sha() is None


# -- the streaming download against a raw server ------------------------------------------------------
class Raw:
    """A server that answers each connection with the raw bytes `answer` (head and body as given), then closes."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answer = b""
        self.requests = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _addr = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        break
                    data += more
                self.requests.append(data.split(b"\r\n", 1)[0])
                if self.requests[-1].startswith(b"POST"):  # a buffered exec (stat): the guest does not know
                    conn.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                    continue
                conn.sendall(self.answer)

    def close(self):
        self.sock.close()


def chunked(body, cuts):
    """body as HTTP/1.1 chunks cut at `cuts`."""
    edges = [0] + [c for c in cuts if 0 < c < len(body)] + [len(body)]
    return b"".join(b"%x\r\n%s\r\n" % (b - a, body[a:b]) for a, b in zip(edges, edges[1:]) if b > a) + b"0\r\n\r\n"


@pytest.fixture
def raw():
    server = Raw()
    client = api_road.ApiRoadClient("http://127.0.0.1:%d" % server.port, "/v2/agents", "tok", SID, "box", connect_timeout=5)
    yield server, client
    client.close()
    server.close()


def head(**headers):
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nConnection: close\r\n" + b"".join(
        b"%s: %s\r\n" % (k.replace("_", "-").encode(), str(v).encode()) for k, v in headers.items()) + b"\r\n"


@pytest.mark.parametrize("payload", [b"", b"x", os.urandom(3 * 1024 * 1024 + 5)], ids=["empty", "one-byte", "3MiB"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_download_of_any_size_lands_whole(raw, tmp_path, payload, framing):
    server, client = raw
    body = payload + footer(payload)
    if framing == "length":
        server.answer = head(Content_Length=len(body)) + body
    else:  # chunks cut inside the footer and across the payload's end
        server.answer = head(Transfer_Encoding="chunked") + chunked(body, [1, len(payload) - 1, len(payload) + 5,
                                                                           len(body) - 1])
    dest = tmp_path / "out"
    assert client.transfers._direct_download("/workspace/f", str(dest)) == len(payload)
    assert dest.read_bytes() == payload and [p.name for p in tmp_path.iterdir()] == ["out"]


PAYLOAD = b"0123456789" * 300  # past the bound of 2000 these tests set
SMALL = PAYLOAD[:1500]          # within it


@pytest.mark.parametrize("answer,error,match", [
    # shorter than its Content-Length: the connection closes early
    (head(Content_Length=len(SMALL) + 83) + SMALL + footer(SMALL), errors.GuestUnavailable, "was cut"),
    # longer than its Content-Length: what is past it is not read, so the footer is not where the length says
    (head(Content_Length=len(SMALL) + 60) + SMALL + footer(SMALL), errors.GuestUnavailable, "integrity footer"),
    # announced past the bound: refused before a byte is read
    (head(Content_Length=2000 + 74) + PAYLOAD + footer(PAYLOAD), errors.SandboxError, "streaming bound of 2000 bytes"),
    # chunked, so unannounced, and past the bound: cut once more than the bound arrived
    (head(Transfer_Encoding="chunked") + chunked(PAYLOAD + footer(PAYLOAD), [1000, 2100]), errors.SandboxError,
     "passed the streaming bound of 2000 bytes"),
    # a chunked body torn before its last chunk
    (head(Transfer_Encoding="chunked") + chunked(PAYLOAD[:1000] + footer(PAYLOAD[:1000]), [500])[:-5],
     errors.GuestUnavailable, "was cut"),
    (head(Content_Length=len(SMALL) + 73) + SMALL[:-1] + b"X" + footer(SMALL), errors.ChecksumMismatch, "sha256"),
])
def test_a_download_that_breaks_its_bounds_or_footer_writes_nothing(raw, tmp_path, monkeypatch, answer, error, match):
    server, client = raw
    monkeypatch.setattr(api_transfer, "STREAM_DOWNLOAD_MAX", 2000)
    server.answer = answer
    dest = tmp_path / "out"
    dest.write_bytes(b"the old file")
    with pytest.raises(error, match=match):
        client.transfers._direct_download("/workspace/f", str(dest))
    assert dest.read_bytes() == b"the old file" and [p.name for p in tmp_path.iterdir()] == ["out"]


# -- uploads: the kernel or one reused buffer carries the body ---------------------------------------
class Sink(http.server.BaseHTTPRequestHandler):
    """Takes an upload (or a part PUT) whole and answers it; records method, path, headers and body."""

    def log_message(self, *args):
        pass

    def _take(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append((self.command, self.path.split("?")[0], dict(self.headers), body))
        answer = b'{"path": "/workspace/f", "bytes_written": %d}' % len(body)
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    do_POST = do_PUT = _take


def tls_context(tmp_path):
    """A server context with a fresh self-signed certificate for 127.0.0.1."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    return context


@pytest.fixture(params=["http", "https"])
def sink(request, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    server.seen = []
    if request.param == "https":
        server.socket = tls_context(tmp_path).wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = api_road.ApiRoadClient("%s://127.0.0.1:%d" % (request.param, server.server_address[1]), "/v2/agents", "tok",
                                    SID, "box", validate_certs=False, connect_timeout=5)
    yield request.param, server, client
    client.close()
    server.shutdown()


@pytest.fixture
def counted(monkeypatch):
    """Bytes the kernel sent from a file (os.sendfile), and the buffers the user-space send loop read into."""
    seen = {"sendfile": 0, "buffers": set(), "reads": 0}
    real_sendfile, real_send = os.sendfile, api_http.send_from_buffer

    def sendfile(out_fd, in_fd, offset, count):
        sent = real_sendfile(out_fd, in_fd, offset, count)
        seen["sendfile"] += sent
        return sent

    def send_from_buffer(sock, f, offset, length, buf):
        seen["buffers"].add(id(buf))
        seen["reads"] += 1
        return real_send(sock, f, offset, length, buf)

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(api_http, "send_from_buffer", send_from_buffer)
    return seen


@pytest.mark.parametrize("size", [0, 1, 3 * 1024 * 1024 + 7])
def test_an_upload_body_goes_by_sendfile_on_plain_http_and_from_one_buffer_over_tls(sink, counted, tmp_path, size):
    scheme, server, client = sink
    src = tmp_path / "src"
    data = os.urandom(size)
    src.write_bytes(data)
    assert client.upload(str(src), "/workspace/f") == size
    (method, path, headers, body), = server.seen
    assert (method, path, body) == ("POST", ROUTE + "/workspace/upload", data)
    assert headers["X-Content-Sha256"] == hashlib.sha256(data).hexdigest() and headers["Content-Length"] == str(size)
    if scheme == "http":  # every byte of the body went by the kernel, none through a buffer of ours
        assert (counted["sendfile"], counted["reads"]) == (size, 0)
    else:  # TLS: no sendfile; the body went from one buffer (the hash pass's), whatever its size
        assert counted["sendfile"] == 0 and counted["reads"] == (1 if size else 0)


def test_staged_parts_go_by_sendfile_from_their_offsets(sink, counted, tmp_path, monkeypatch):
    scheme, server, client = sink
    if scheme == "https":
        pytest.skip("the parts' presigned URLs in this stand-in are plain http")
    monkeypatch.setattr(api_transfer, "MAX_UPLOAD", 10)
    data = os.urandom(25)
    src = tmp_path / "src"
    src.write_bytes(data)
    base = "http://127.0.0.1:%d" % server.server_address[1]
    answers = iter([{"transfer_id": "tr_1", "part_size": 10},
                    {"part_urls": [{"part_number": n, "upload_url": base + "/_obj/%d?signature=s" % n} for n in (1, 2, 3)]},
                    {"status": "pending"}, {"status": "completed", "bytes_written": 25}])
    monkeypatch.setattr(client.http, "json_call", lambda method, path, doc=None, limit=0: next(answers))
    assert client.upload(str(src), "/workspace/f") == 25
    assert [(m, p, b) for m, p, _h, b in server.seen] == [("PUT", "/_obj/%d" % n, data[(n - 1) * 10:n * 10]) for n in (1, 2, 3)]
    assert all("Authorization" not in h for _m, _p, h, _b in server.seen)
    assert counted["sendfile"] == 25


def test_a_file_that_shrinks_while_it_is_sent_is_an_error_not_a_short_body(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"0123456789")
    a, b = socket.socketpair()
    with a, b, open(src, "rb", buffering=0) as f:
        a.settimeout(5)
        with pytest.raises(OSError, match="ended after 10 of its 20 bytes"):
            api_http.FileBody(f, 0, 20).send(a)
        with pytest.raises(OSError, match="ended after 4 of its 5 bytes"):
            api_http.FileBody(f, 6, 5).send(a)


def test_the_tls_send_loop_reads_into_one_buffer_and_sends_views_of_it(tmp_path):
    data = os.urandom(300_000)
    calls = []

    class Counted(io.FileIO):
        def readinto(self, b):
            calls.append(b.obj if isinstance(b, memoryview) else b)
            return super().readinto(b)

        def read(self, *args):
            raise AssertionError("read() makes a new bytes object a block: readinto is the way")

    src = tmp_path / "src"
    src.write_bytes(data)
    buf = bytearray(64 * 1024)
    a, b = socket.socketpair()
    got = bytearray()

    def read_all():
        for chunk in iter(lambda: b.recv(1 << 16), b""):
            got.extend(chunk)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    with Counted(str(src), "rb") as f:
        assert api_http.send_from_buffer(a, f, 1000, len(data) - 1000, buf) == len(data) - 1000
    a.close()
    reader.join(10)
    b.close()
    assert bytes(got) == data[1000:] and calls and all(c is buf for c in calls)


def test_the_hash_pass_reads_through_one_buffer_and_notices_a_changed_file(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"abc" * 1000)
    with open(src, "rb", buffering=0) as f:
        assert api_transfer.file_sha256(f, 3000, bytearray(7), "src") == hashlib.sha256(b"abc" * 1000).hexdigest()
        with pytest.raises(errors.SandboxError, match="changed while it was read"):
            api_transfer.file_sha256(f, 2999, bytearray(7), "src")
