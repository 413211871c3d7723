"""The mux's stdlib opener for the REST client, against a real HTTP server on loopback."""

from __future__ import annotations

import http.server
import json
import socket
import threading

import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils import rest
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.http_stdlib import stdlib_open


class Handler(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *args):
        pass

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        Handler.seen.append((self.command, self.path, dict(self.headers), body))
        if self.path.endswith("/moved"):
            self.send_response(302)
            self.send_header("Location", "http://other.invalid/steal")
            self.end_headers()
            return
        if "/missing" in self.path:
            data = json.dumps({"id": "not_found", "message": "no such session"}).encode()
            self.send_response(404)
        else:
            data = json.dumps({"session": {"session_id": "s1", "status": "SESSION_STATUS_READY"}}).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_DELETE = _answer


@pytest.fixture
def server():
    Handler.seen = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield "http://127.0.0.1:%d" % httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_the_client_reads_a_session_through_it(server):
    client = rest.ApiClient(server, "tok-123", opener=stdlib_open)
    assert client.get_session("s1")["session_id"] == "s1"
    method, path, headers, _body = Handler.seen[0]
    assert (method, path) == ("GET", "/v2/harness-runtime/sessions/s1")
    assert headers["Authorization"] == "Bearer tok-123"
    assert headers["User-Agent"] == rest.USER_AGENT


def test_an_error_status_reads_as_with_open_url(server):
    client = rest.ApiClient(server, "tok-123", opener=stdlib_open, retries=0)
    with pytest.raises(rest.ApiError) as e:
        client.get_session("missing")
    assert e.value.status == 404 and e.value.gone
    assert "no such session" in str(e.value)


def test_a_redirect_is_not_followed_so_the_token_stays_home(server):
    client = rest.ApiClient(server, "tok-123", opener=stdlib_open, retries=0)
    with pytest.raises(rest.ApiError) as e:
        client.request("GET", "/moved")
    assert e.value.status == 302
    assert len(Handler.seen) == 1  # nothing went to the Location


def test_an_unreachable_api_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    client = rest.ApiClient("http://127.0.0.1:%d" % port, "tok-123", opener=stdlib_open, retries=0)
    with pytest.raises(rest.ApiError) as e:
        client.get_session("s1")
    assert e.value.status == 0 and "cannot reach" in str(e.value)
    assert "tok-123" not in str(e.value)
