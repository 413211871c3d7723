"""The api road's client (plugin_utils/_mux/api_road.py) against a stand-in HTTP server: one layer, its edge cases.

The whole road through the real stack (local plane, guest) is tests/integration/test_connection_api.py.
"""
import base64
import hashlib
import http.server
import json
import threading

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_road

SID = "a1b2c3d4-e5f6-7890-abcd-ef1234567890"


class Fake(http.server.BaseHTTPRequestHandler):
    """Answers what the test put in `server.answers[(method, path-without-query)]`: (status, headers, body)."""

    def log_message(self, *args):
        pass

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.server.seen.append((self.command, self.path, dict(self.headers), self.rfile.read(length) if length else b""))
        status, headers, body = self.server.answers[(self.command, self.path.split("?")[0])]
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


@pytest.fixture
def fake():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    server.answers, server.seen = {}, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = api_road.ApiRoadClient("http://127.0.0.1:%d" % server.server_address[1], "/v2/agents", "tok", SID, "box",
                                    connect_timeout=5)
    yield server, client
    server.shutdown()


def route(path):
    return "/v2/agents/sessions/%s%s" % (SID, path)


def events(*pairs):
    return b"".join(b"event: %s\ndata: %s\n\n" % (e.encode(), json.dumps(d).encode()) for e, d in pairs) + b": keepalive\n\n"


def b64(data):
    return base64.b64encode(data).decode()


def test_exec_collects_events_and_carries_env_through_env1(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = (200, {"Content-Type": "text/event-stream"}, events(
        ("started", {"exec_id": "e1"}), ("stdout", {"data": b64(b"out")}), ("stderr", {"data": b64(b"err")}),
        ("exit", {"exit_code": 3, "timed_out": False, "duration_ms": 5})))
    result = client.exec(["printenv", "A"], env={"A": "1 2"}, stdin=b"in")
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out", b"err")
    method, _path, headers, body = server.seen[0]
    doc = json.loads(body)
    assert headers["Accept"] == "text/event-stream" and headers["Authorization"] == "Bearer tok"
    assert doc["argv"] == ["/usr/bin/env", "--", "A=1 2", "printenv", "A"]
    assert base64.b64decode(doc["stdin"]) == b"in" and doc["timeout_seconds"] == api_road.EXEC_MAX_TIMEOUT
    assert "keep_stdin_open" not in doc


@pytest.mark.parametrize("tail", [[], [("error", {"message": "agent went away"})]])
def test_a_stream_without_its_exit_event_is_a_lost_command(fake, tail):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = (200, {}, events(("started", {"exec_id": "e1"}),
                                                                        ("stdout", {"data": b64(b"half")}), *tail))
    with pytest.raises(ac.CommandLost, match="not re-run"):
        client.exec(["true"])


def test_held_stdin_without_the_team_setting_names_it_and_remembers(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = (403, {}, json.dumps(
        {"error": {"code": 403, "message": "interactive stdin is not enabled"}}).encode())
    call, feed = client.exec_stream(["sudo", "-S", "id"], hold_stdin=True)
    with pytest.raises(ac.AgentError, match=r"interactive stdin \(keep_stdin_open\).*Nothing was run"):
        list(client.iter_exec(call, feed))
    assert client.interactive is False
    with pytest.raises(ac.AgentError, match="not enabled for this team"):
        client.exec_stream(["sudo", "-S", "id"], hold_stdin=True)  # refused before any request now
    assert len(server.seen) == 1


def test_a_command_whose_worker_left_before_its_stdin_ended_is_never_started(fake):
    server, client = fake
    call, feed = client.exec_stream(["sh"])
    feed.put(b"half of a payload")
    call.cancel()     # the mux saw the worker hang up ...
    feed.put(None)    # ... and ended the stdin queue
    with pytest.raises(ac.CommandLost, match="before it started"):
        list(client.iter_exec(call, feed))
    assert server.seen == []


def footer(payload):
    return b"DOWSSHA1" + hashlib.sha256(payload).hexdigest().encode() + b"\n"


@pytest.mark.parametrize("body,error", [
    (b"payload" + footer(b"payload"), None),
    (b"", ac.AgentUnavailable),                                # nothing at all
    (b"payload" + footer(b"payload")[:-1], ac.AgentUnavailable),  # a truncated footer
    (b"payloaX" + footer(b"payload"), ac.ChecksumMismatch),       # a changed byte
    (b"p" * 200, ac.AgentUnavailable),                         # no footer shape at all
])
def test_download_strips_and_verifies_the_footer_and_writes_only_whole_files(fake, tmp_path, body, error):
    server, client = fake
    server.answers[("GET", route("/workspace/download"))] = (200, {}, body)
    dest = tmp_path / "out"
    if error is None:
        assert client.download("/workspace/f", str(dest)) == len(b"payload")
        assert dest.read_bytes() == b"payload"
    else:
        with pytest.raises(error):
            client.download("/workspace/f", str(dest))
        assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if error is None else [])


def test_transfer_refusals_map_to_the_agent_errors(fake, tmp_path):
    server, client = fake
    src = tmp_path / "src"
    src.write_bytes(b"abc")
    server.answers[("POST", route("/workspace/upload"))] = (403, {}, b'{"error": {"message": "path outside workspace"}}')
    with pytest.raises(ac.TransferDenied):
        client.upload(str(src), "/workspace/link/x")
    server.answers[("GET", route("/workspace/download"))] = (404, {}, b'{"error": {"message": "no such file"}}')
    with pytest.raises(ac.RemoteNotFound):
        client.download("/workspace/none", str(tmp_path / "none"))
    upload = server.seen[0]
    assert upload[2]["X-Content-Sha256"] == hashlib.sha256(b"abc").hexdigest() and upload[3] == b"abc"


def test_paths_outside_the_transfer_root_are_refused_before_any_request(fake, tmp_path):
    server, client = fake
    with pytest.raises(Exception, match="/workspace"):
        client.download("/etc/passwd", str(tmp_path / "x"))
    assert server.seen == []


def test_bad_env_names_are_refused():
    with pytest.raises(ac.AgentError):
        api_road.env_argv(["true"], {"A=B": "1"})
    assert api_road.env_argv(["true"], {}) == ["true"]


def test_the_transport_setting_on_the_wire_and_in_the_link_key():
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import SessionConfig
    agent = SessionConfig(session="box", token="t")
    api = SessionConfig(session="box", token="t", transport="API")
    assert "transport" not in agent.to_wire()  # the default stays off the wire: an older mux still takes it
    assert SessionConfig.from_wire(api.to_wire()) == api and api.transport == "api"
    assert len({agent.key, api.key, SessionConfig(session="box", token="t", transport="auto").key}) == 3
    with pytest.raises(ValueError, match="agent, api, auto"):
        SessionConfig(session="box", token="t", transport="ssh")
