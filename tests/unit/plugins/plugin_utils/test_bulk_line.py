"""The bulk line against a scripted peer: a real socket, a real WebSocket (websockets' server protocol, which refuses
unmasked client frames) and a real HTTP/2 server (h2), speaking gRPC's framing. The peer is hostile where a test
says so: every budget of the line is crossed once, and each failure names its limit."""
import hashlib
import socket
import struct
import threading
import time

import pytest

pytest.importorskip("h2.connection")
import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.events  # noqa: E402
import h2.settings  # noqa: E402
from websockets.frames import Frame, Opcode  # noqa: E402
from websockets.http11 import Request  # noqa: E402
from websockets.server import ServerProtocol  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import bulk_line  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2 as pb  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors  # noqa: E402

MIB = 1 << 20


def grpc_message(body):
    return b"\x00" + len(body).to_bytes(4, "big") + body


class Peer:
    """One accepted connection: the upgrade, then HTTP/2 frames in WebSocket messages; `script(peer, request)` answers
    each call once its request has ended (request: the request body's bytes)."""

    def __init__(self, script, upgrade_status=101, frame_max=16384, tls=None, early=False):
        self.script = script
        self.early = early  # the upgrade's answer, the SETTINGS and a cut frame in one write
        self.tls = tls  # a server SSLContext: wss://
        self.upgrade_status = upgrade_status
        self.frame_max = frame_max
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.port = self.listener.getsockname()[1]
        self.raw_in = bytearray()     # every byte the client sent after the upgrade
        self.calls = []
        self.errors = []
        self.accepted = 0
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def target(self, client_tls=None):
        scheme = "wss" if self.tls else "ws"
        return bulk_line.Target("%s://localhost:%d/v2/x/sessions/s/port-forward/8443" % (scheme, self.port), "tok",
                                client_tls, 5, "box", 8443)

    def serve(self):
        while True:
            try:
                sock, _addr = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                if self.tls is not None:
                    sock = self.tls.wrap_socket(sock, server_side=True)
                self.one(sock)
            except Exception as e:  # recorded: a test may look
                self.errors.append(e)
            finally:
                sock.close()

    def one(self, sock):
        self.sock = sock
        ws = self.ws = ServerProtocol(max_size=16 * MIB)
        while True:
            data = sock.recv(65536)
            if not data:
                return
            ws.receive_data(data)
            events = ws.events_received()
            if events and isinstance(events[0], Request):
                break
        request = events[0]
        assert request.headers["Authorization"] == "Bearer tok"
        if self.upgrade_status != 101:
            sock.sendall(b"HTTP/1.1 %d Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % self.upgrade_status)
            return
        ws.send_response(ws.accept(request))
        answer = b"".join(ws.data_to_send())
        conn = self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_FRAME_SIZE: self.frame_max})
        conn.initiate_connection()
        if self.early:
            ws.send_binary(conn.data_to_send())
            conn.ping(b"12345678")
            ws.send_binary(conn.data_to_send())
            frames = b"".join(ws.data_to_send())
            sock.sendall(answer + frames[:-20])
            time.sleep(0.05)
            sock.sendall(frames[-20:])
        else:
            sock.sendall(answer)
            self.flush()
        bodies = {}
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return
            self.raw_in += data
            ws.receive_data(data)
            for event in ws.events_received():
                if isinstance(event, Frame) and event.opcode == Opcode.BINARY:
                    for h in conn.receive_data(event.data):
                        if isinstance(h, h2.events.RequestReceived):
                            bodies[h.stream_id] = bytearray()
                            self.calls.append(dict(h.headers)[b":path"].decode())
                        elif isinstance(h, h2.events.DataReceived):
                            bodies[h.stream_id] += h.data
                            conn.acknowledge_received_data(h.flow_controlled_length, h.stream_id)
                        elif isinstance(h, h2.events.StreamEnded):
                            self.flush()
                            self.script(self, h.stream_id, bytes(bodies.pop(h.stream_id)))
            self.flush()

    # what scripts use
    def flush(self):
        out = self.h2.data_to_send()
        if out:
            self.send_binary(out)

    def send_binary(self, data):
        self.ws.send_binary(data)
        self.sock.sendall(b"".join(self.ws.data_to_send()))

    def answer(self, stream_id, messages=(), status=0, message=""):
        self.h2.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        for body in messages:
            data = grpc_message(body)
            for at in range(0, len(data), self.h2.max_outbound_frame_size):
                self.h2.send_data(stream_id, data[at:at + self.h2.max_outbound_frame_size])
            self.flush()
        trailers = [(b"grpc-status", str(status).encode())]
        if message:
            trailers.append((b"grpc-message", message.encode()))
        self.h2.send_headers(stream_id, trailers, end_stream=True)
        self.flush()

    def close(self):
        self.listener.close()


@pytest.fixture
def peer():
    made = []

    def make(script, **kw):
        p = Peer(script, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def messages_of(body):
    out, at = [], 0
    while at < len(body):
        assert body[at] == 0
        n = int.from_bytes(body[at + 1:at + 5], "big")
        out.append(body[at + 5:at + 5 + n])
        at += 5 + n
    return out


def mask_keys(raw):
    """The mask key of every client frame in raw (the line's bytes after the upgrade)."""
    keys, at = [], 0
    while at + 2 <= len(raw):
        b1 = raw[at + 1]
        assert b1 & 0x80, "a client frame without a mask"
        n, at2 = b1 & 0x7F, at + 2
        if n == 126:
            n, at2 = struct.unpack_from(">H", raw, at2)[0], at2 + 2
        elif n == 127:
            n, at2 = struct.unpack_from(">Q", raw, at2)[0], at2 + 8
        keys.append(bytes(raw[at2:at2 + 4]))
        at = at2 + 4 + n
    return keys


def upload(line, data, chunk=ac.CHUNK_SIZE):
    import io
    header = pb.UploadRequest(header=pb.UploadHeader(path="/workspace/f"))
    answer = ac._Collected()
    bulk_line.run_call(line, ac.SERVICE + "Upload", ac._upload_messages(header, io.BytesIO(data), chunk), answer)
    return pb.UploadResponse.FromString(answer.data())


def download(line):
    import io
    f = io.BytesIO()
    landing = ac._Landing(f, "/workspace/f", "box", "/local/f")
    request = pb.DownloadRequest(path="/workspace/f").SerializeToString()
    bulk_line.run_call(line, ac.SERVICE + "Download", [[request]], ac._DownloadSink(landing))
    landing.verdict()
    return f.getvalue()


def test_an_upload_arrives_whole_in_masked_frames_with_fresh_keys(peer):
    data = bytes(range(256)) * (3 * MIB // 256) + b"tail"
    got = {}

    def script(p, sid, body):
        got["messages"] = [pb.UploadRequest.FromString(m) for m in messages_of(body)]
        p.answer(sid, [pb.UploadResponse(bytes_written=len(data)).SerializeToString()])

    p = peer(script)
    line = bulk_line.Line.dial(p.target())
    assert upload(line, data).bytes_written == len(data)
    kinds = [m.WhichOneof("request") for m in got["messages"]]
    assert kinds[0] == "header" and kinds[-1] == "end" and set(kinds[1:-1]) == {"chunk"}
    assert b"".join(m.chunk for m in got["messages"][1:-1]) == data
    assert got["messages"][-1].end.sha256 == hashlib.sha256(data).hexdigest()
    keys = mask_keys(p.raw_in)
    assert len(keys) > 3 and len(set(keys)) == len(keys), "each client frame has a mask key of its own"
    assert p.calls == [ac.SERVICE + "Upload"]
    assert line.reusable  # a clean call leaves the line for the next one
    line.close()


@pytest.mark.parametrize("frame_max", [16384, MIB])
def test_a_download_lands_whole_however_the_frames_cut_it(peer, frame_max):
    data = hashlib.sha256(b"seed").digest() * (5 * MIB // 32) + b"end"

    def script(p, sid, body):
        chunks = [data[i:i + 2 * MIB] for i in range(0, len(data), 2 * MIB)]
        msgs = [pb.DownloadChunk(header=pb.DownloadHeader(size_bytes=len(data))).SerializeToString()]
        msgs += [pb.DownloadChunk(chunk=c).SerializeToString() for c in chunks]
        msgs.append(pb.DownloadChunk(end=pb.DownloadEnd(sha256=hashlib.sha256(data).hexdigest())).SerializeToString())
        p.answer(sid, msgs)

    p = peer(script, frame_max=frame_max)
    line = bulk_line.Line.dial(p.target())
    # the client allows 1 MiB frames: a peer may use them (h2 splits to its own limit)
    assert download(line) == data
    assert download(line) == data  # the same line, a second call
    line.close()


def test_a_refusal_is_the_agents_status_and_words(peer):
    p = peer(lambda p, sid, body: p.answer(sid, status=5, message="no such file: /workspace/f %E2%98%83"))
    line = bulk_line.Line.dial(p.target())
    with pytest.raises(bulk_line.CallFailed) as e:
        download(line)
    assert e.value.code == 5 and e.value.message == "no such file: /workspace/f \u2603"
    assert line.reusable


def test_an_upgrade_refused_is_the_tunnels_error(peer):
    p = peer(lambda *a: None, upgrade_status=502)
    with pytest.raises(errors.TunnelFailure) as e:
        bulk_line.Line.dial(p.target())
    assert e.value.status == 502 and "HTTP 502" in str(e.value)


def hostile(peer, send):
    """A peer that answers a call with `send(peer, stream_id)`; the call's failure."""
    p = peer(lambda p, sid, body: send(p, sid))
    line = bulk_line.Line.dial(p.target())
    with pytest.raises(bulk_line.LineBroken) as e:
        download(line)
    assert not line.reusable
    return str(e.value.error)


def test_an_http2_frame_over_the_limit_closes_the_transfer(peer):
    def send(p, sid):
        p.send_binary(struct.pack(">BHBBI", 0x20, 0, 0, 0, sid))  # a 2 MiB DATA frame's header, announced
    assert "over the 1024 KiB we allow (SETTINGS_MAX_FRAME_SIZE)" in hostile(peer, send)


def test_a_grpc_message_over_the_limit_closes_the_transfer(peer):
    def send(p, sid):
        p.h2.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        p.h2.send_data(sid, b"\x00" + (64 * MIB).to_bytes(4, "big"))
        p.flush()
    words = hostile(peer, send)
    assert "a gRPC message of 67108864 bytes, over the 4 MiB" in words


def test_a_websocket_message_over_the_limit_closes_the_transfer(peer):
    def send(p, sid):
        p.sock.sendall(struct.pack(">BBQ", 0x82, 127, 9 * MIB) + b"\x00" * 1024)
    assert "close code 1009" in hostile(peer, send)


def test_a_flood_of_control_frames_closes_the_transfer(peer):
    def send(p, sid):
        for i in range(70000):  # 17 bytes each: past 1 MiB
            p.h2.ping(i.to_bytes(8, "big"))
        p.flush()
    assert "frames other than data in one transfer" in hostile(peer, send)


def test_a_chunk_that_does_not_fill_its_message_is_refused(peer):
    def send(p, sid):
        body = bytearray(pb.DownloadChunk(chunk=b"x" * 100000).SerializeToString())
        body += b"\x00" * 10  # trailing bytes the chunk's own length does not cover
        p.answer(sid, [bytes(body)])
    assert "does not fill its message" in hostile(peer, send)


def test_a_session_that_goes_away_midway_says_so(peer):
    def send(p, sid):
        p.h2.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/grpc")])
        p.flush()
        p.ws.send_close(4001, "paused")
        p.sock.sendall(b"".join(p.ws.data_to_send()))
    p = peer(lambda p, sid, body: send(p, sid))
    line = bulk_line.Line.dial(p.target())
    with pytest.raises(bulk_line.LineBroken) as e:
        download(line)
    assert isinstance(e.value.error, errors.GuestUnavailable) and "became unavailable" in str(e.value.error)
    assert e.value.answered  # its answer had begun: the caller must not try it again


def test_silence_after_the_request_is_a_timeout_naming_it(peer, monkeypatch):
    monkeypatch.setattr(bulk_line, "VERDICT_TIMEOUT", 0.3)
    p = peer(lambda p, sid, body: None)
    line = bulk_line.Line.dial(p.target())
    with pytest.raises(bulk_line.LineBroken) as e:
        download(line)
    assert "no byte from the guest agent for 0.3 s, the read timeout" in str(e.value.error)
    assert not e.value.answered


def test_the_pool_reuses_a_line_and_replaces_one_closed_while_idle(peer):
    p = peer(lambda p, sid, body: p.answer(sid, [pb.UploadResponse(bytes_written=1).SerializeToString()]))
    pool = bulk_line.Pool(lambda: bulk_line.Line.dial(p.target()))
    line, reused = pool.take()
    assert not reused
    upload(line, b"x")
    pool.give_back(line)
    again, reused = pool.take()
    assert reused and again is line
    pool.give_back(again)
    p.ws.send_close(1001, "idle")  # the far end drops the idle line
    p.sock.sendall(b"".join(p.ws.data_to_send()))
    p.sock.shutdown(socket.SHUT_RDWR)
    fresh, reused = pool.take()
    assert not reused and fresh is not line and pool.dials == 2
    upload(fresh, b"y")
    pool.close()


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory):
    """(server context, client context trusting it) for localhost, from a throwaway self-signed certificate."""
    import shutil
    import ssl
    import subprocess
    if not shutil.which("openssl"):
        pytest.skip("openssl is needed to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(str(d / "cert.pem"), str(d / "key.pem"))
    client = ssl.create_default_context(cafile=str(d / "cert.pem"))
    return server, client


def test_both_ways_over_tls(peer, tls_pair):
    """wss:// through Python's ssl: the certificate checked against the host name, bytes both ways."""
    server, client = tls_pair
    data = b"secret bytes " * (300 * 1024)

    def script(p, sid, body):
        msgs = messages_of(body)
        if len(msgs) == 1:  # a download
            p.answer(sid, [pb.DownloadChunk(chunk=data).SerializeToString(),
                           pb.DownloadChunk(end=pb.DownloadEnd(sha256=hashlib.sha256(data).hexdigest())).SerializeToString()])
        else:
            got = b"".join(pb.UploadRequest.FromString(m).chunk for m in msgs[1:-1])
            p.answer(sid, [pb.UploadResponse(bytes_written=len(got)).SerializeToString()])

    p = peer(script, tls=server)
    line = bulk_line.Line.dial(p.target(client))
    assert upload(line, data).bytes_written == len(data)
    assert download(line) == data
    line.close()
    import ssl
    with pytest.raises(errors.TunnelFailure) as e:  # a certificate nobody vouches for is refused at the dial
        bulk_line.Line.dial(p.target(ssl.create_default_context()))
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value) or "certificate verify failed" in str(e.value)


def test_frames_in_the_same_read_as_the_upgrades_answer_are_not_lost(peer):
    """The agent's SETTINGS and part of a next frame may come with the 101: they are the line's, from their first byte."""
    data = b"early" * 1000
    p = peer(lambda p, sid, body: p.answer(sid, [pb.DownloadChunk(chunk=data).SerializeToString(), pb.DownloadChunk(
        end=pb.DownloadEnd(sha256=hashlib.sha256(data).hexdigest())).SerializeToString()]), early=True)
    line = bulk_line.Line.dial(p.target())
    assert download(line) == data
    line.close()
