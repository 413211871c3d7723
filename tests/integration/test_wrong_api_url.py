"""A DO_AGENTS_API_URL that points at some other web server: a clear error, and never "already gone".

Real ansible-playbook runs of the modules against a real HTTP server on loopback that answers every
request with an HTML 404 page, as a web server that is not the API would.
"""
import http.server
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import run_playbook  # noqa: E402

PAGE = b"<!DOCTYPE HTML><html><head><title>404 Not Found</title></head><body>" + b"x" * 4000 + b"</body></html>"


class NotTheApi(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    seen: list = []

    def _answer(self):
        self.seen.append(self.path)
        self.send_response(404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _answer


@pytest.fixture
def web_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotTheApi)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield "http://127.0.0.1:%d" % httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_a_url_that_is_not_the_api_is_named_and_not_taken_for_gone(web_server, tmp_path):
    env = {"DO_AGENTS_API_URL": web_server, "DO_AGENTS_API_TOKEN": "tok-not-the-api-123"}
    run = run_playbook(None, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: Look the sessions up
              microvm.sandbox.session_info:
              ignore_errors: true
            - name: Delete a session
              microvm.sandbox.session:
                name: some-session
                state: absent
              ignore_errors: true
        """, env=env, with_plane_env=False)
    for task in ("Look the sessions up", "Delete a session"):
        result = run.result(task)
        # a 404 from a server that is not the API says nothing of the session: never "ok, already gone"
        assert result["failed"], (task, result)
        msg = result["msg"]
        assert "does not answer like the platform's API" in msg and web_server in msg, msg
        assert "an HTML page" in msg and "DO_AGENTS_API_URL" in msg, msg
        assert "<!DOCTYPE" not in msg and "xxxx" not in msg, msg   # the page is not dumped in
    assert "tok-not-the-api-123" not in run.stdout + run.stderr


@pytest.mark.parametrize("path", ["/v2", "/v2/harness-runtime"])
def test_a_url_with_the_apis_path_says_to_give_the_bare_origin(web_server, tmp_path, path):
    seen = []
    NotTheApi.seen = seen
    env = {"DO_AGENTS_API_URL": web_server + path, "DO_AGENTS_API_TOKEN": "tok-path-456"}
    run = run_playbook(None, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: Delete a session
              microvm.sandbox.session:
                name: some-session
                state: absent
              ignore_errors: true
        """, env=env, with_plane_env=False)
    result = run.result("Delete a session")
    assert result["failed"], result     # never "ok, already gone"
    msg = result["msg"]
    assert "carries the path %s" % path in msg and "DO_AGENTS_API_URL to %s (the bare origin)" % web_server in msg, msg
    assert "route_prefix" in msg and "No session" not in msg, msg
    assert seen == []                   # refused before any request
    assert "tok-path-456" not in run.stdout + run.stderr
