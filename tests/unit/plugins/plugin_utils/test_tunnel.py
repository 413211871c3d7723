"""The port-forward tunnel: URL mapping, error wording, and bytes through a real WebSocket server."""
import asyncio
import logging
import os
import socket
import stat
import threading
import time

import pytest
from websockets.asyncio.server import serve
from websockets.datastructures import Headers
from websockets.http11 import Response

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import tunnel as tn
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors


@pytest.mark.parametrize("api_url, expected", [
    ("http://127.0.0.1:8080", "ws://127.0.0.1:8080/v2/agents/sessions/s%2F1/port-forward/8443"),
    ("https://api.example.com/base/", "wss://api.example.com/base/v2/agents/sessions/s%2F1/port-forward/8443"),
])
def test_ws_url(api_url, expected):
    assert tn.ws_url(api_url, "/v2/agents", "s/1", 8443) == expected


def test_ws_url_refuses_other_schemes():
    with pytest.raises(errors.SandboxError, match="http:// or https://"):
        tn.ws_url("ftp://x", "/v2/agents", "s", 8443)


@pytest.mark.parametrize("status, words, fatal", [
    (404, "No session", True), (403, "not allowed", True), (401, "refused the API token", True),
    (502, "could not reach guest port 8443", False), (500, "HTTP 500", False), (409, "HTTP 409", True)])
def test_status_errors_name_the_session(status, words, fatal):
    e = tn.status_error(status, "my-box (id-1)", 8443)
    assert words in str(e) and "my-box (id-1)" in str(e)
    assert e.fatal is fatal and e.status == status


@pytest.mark.parametrize("status", [401, 403, 404, 429, 503])
def test_a_status_reads_the_same_in_the_tunnel_and_the_modules(status):
    """One table (module_utils/advice.py): the advice of a dial error is the modules' advice, word for word."""
    from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import describe_error
    from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
    todo = describe_error(ApiError("GET", "/sessions/s", status, "no", what="session", ident="s"))[0].rsplit(". ", 1)
    tunnel_text = str(tn.status_error(status, "s", 8443))
    assert todo[-1].rstrip(".") in tunnel_text


@pytest.mark.parametrize("code, words", [(4001, "became unavailable"), (4002, "could not dial guest port 8443"),
                                         (4011, "failed upstream"), (1011, "closed with code 1011")])
def test_close_codes_name_the_session(code, words):
    e = tn.close_error(code, "why", "my-box", 8443)
    assert words in str(e) and "my-box" in str(e) and e.close_code == code


def test_normal_close_is_no_error():
    assert tn.close_error(1000, "", "s", 8443) is None


class Server:
    """A port-forward endpoint: checks the bearer header, echoes binary frames, ignores text frames."""

    def __init__(self, token="s3cr3t"):
        self.token = token
        self.headers = []
        self.subprotocols = []
        self.reject = None
        self.close_with = None
        self.loop = asyncio.new_event_loop()
        self.port = None
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)

        async def main():
            async with serve(self.handler, "127.0.0.1", 0, process_request=self.process_request, max_size=None) as s:
                self.port = s.sockets[0].getsockname()[1]
                ready.set()
                await asyncio.Future()

        self.loop.run_until_complete(main())

    def process_request(self, connection, request):
        self.headers.append(request.headers)
        if request.headers.get("Authorization") != "Bearer " + self.token:
            return Response(401, "Unauthorized", Headers(), b"")
        if self.reject:
            return Response(self.reject, "Rejected", Headers(), b"")
        return None

    async def handler(self, ws):
        self.subprotocols.append(ws.subprotocol)
        if self.close_with:
            await ws.close(self.close_with, "closing")
            return
        async for message in ws:
            if isinstance(message, bytes):
                await ws.send(message[::-1])
                if message == b"big":  # a hostile or broken endpoint: one message past the tunnel's limit
                    await ws.send(bytes(tn.WS_MESSAGE_MAX + 1))
                if message == b"bye":
                    await ws.close(4001, "session paused")
                    return


@pytest.fixture(scope="module")
def server():
    return Server()


@pytest.fixture
def tunnel(server):
    server.reject = None
    server.close_with = None
    t = tn.Tunnel("http://127.0.0.1:%d" % server.port, "/v2/agents", "sess-1", "s3cr3t", label="box (sess-1)",
                  connect_timeout=5)
    t.start()
    yield t
    t.stop()


def dial(t):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(t.socket_path)
    return s


def read_all(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def wait_for(cond, timeout=5):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    return cond()


def test_bytes_flow_both_ways_with_bearer_and_no_subprotocol(server, tunnel):
    assert stat.S_IMODE(os.stat(tunnel.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(tunnel.socket_path)).st_mode) == 0o700
    s = dial(tunnel)
    s.sendall(b"hello")
    assert read_all(s, 5) == b"olleh"
    s.close()
    assert server.headers[-1].get("Authorization") == "Bearer s3cr3t"
    assert server.headers[-1].get("Sec-WebSocket-Protocol") is None
    assert server.subprotocols[-1] is None
    assert "s3cr3t" not in repr(tunnel)


def test_one_websocket_per_local_connection(server, tunnel):
    before = len(server.headers)
    socks = [dial(tunnel) for _dummy in range(3)]
    for i, s in enumerate(socks):
        s.sendall(b"x%d" % i)
        assert read_all(s, 2) == (b"x%d" % i)[::-1]
    assert len(server.headers) - before == 3
    for s in socks:
        s.close()


@pytest.mark.parametrize("status, words", [(404, "No session"), (403, "not allowed"), (502, "could not reach guest port")])
def test_pre_upgrade_status_becomes_a_clear_error(server, tunnel, status, words):
    server.reject = status
    since = time.monotonic()
    s = dial(tunnel)
    assert read_all(s, 1) == b""  # the local peer just sees a closed connection
    s.close()
    assert wait_for(lambda: tunnel.errors_since(since))
    e = tunnel.errors_since(since)[-1]
    assert e.status == status and words in str(e) and "box (sess-1)" in str(e)


def test_close_code_4001_is_recorded(server, tunnel):
    since = time.monotonic()
    s = dial(tunnel)
    s.sendall(b"bye")
    assert read_all(s, 10) == b"eyb"
    s.close()
    assert wait_for(lambda: tunnel.errors_since(since))
    e = tunnel.errors_since(since)[-1]
    assert e.close_code == 4001 and "box (sess-1) became unavailable" in str(e)


def test_a_message_over_the_limit_closes_only_its_connection_naming_the_limit(server, tunnel):
    since = time.monotonic()
    s = dial(tunnel)
    s.sendall(b"big")
    got = read_all(s, tn.WS_MESSAGE_MAX + 16)
    s.close()
    assert got == b"gib"  # the echo before it came through; the oversized message never reached the local side
    assert wait_for(lambda: tunnel.errors_since(since))
    e = tunnel.errors_since(since)[-1]
    assert e.close_code == 1009 and "over %d MiB" % (tn.WS_MESSAGE_MAX >> 20) in str(e) and "box (sess-1)" in str(e)
    other = dial(tunnel)  # the tunnel itself goes on serving
    other.sendall(b"ok")
    assert read_all(other, 2) == b"ko"
    other.close()


def test_wrong_token_is_fatal(server):
    t = tn.Tunnel("http://127.0.0.1:%d" % server.port, "/v2/agents", "sess-1", "not-the-t0ken", connect_timeout=5)
    t.start()
    try:
        since = time.monotonic()
        s = dial(t)
        read_all(s, 1)
        s.close()
        assert wait_for(lambda: t.errors_since(since))
        e = t.errors_since(since)[-1]
        assert e.fatal and e.status == 401 and "not-the-t0ken" not in str(e)
    finally:
        t.stop()
    assert not os.path.exists(t.socket_path)


def test_stop_with_open_connections_logs_no_traceback(server, caplog):
    t = tn.Tunnel("http://127.0.0.1:%d" % server.port, "/v2/agents", "sess-1", "s3cr3t", connect_timeout=5)
    t.start()
    socks = [dial(t), dial(t)]
    for s in socks:
        s.sendall(b"hello")
        assert read_all(s, 5) == b"olleh"
    with caplog.at_level(logging.DEBUG):
        t.stop()
    noisy = [r for r in caplog.records if r.levelno >= logging.ERROR or "CancelledError" in r.getMessage()
             or (r.exc_info and r.exc_info[0] is not None)]
    assert noisy == [], [r.getMessage() for r in noisy]
    for s in socks:
        assert s.recv(10) == b""  # the connections were closed
        s.close()
