"""The documented data plane: the buffered exec; for a team with it, exec as Server-Sent Events (our reading of
the stream) and interactive stdin; the team's switches.

Pages: "How to Send Interactive Stdin to a Sandbox Command" (18 Nov 2026), the DoTs page of
`.../sandbox/exec/{exec_id}/stdin` (v1.25.0), pydo `post_session_sandbox_exec`; docs/platform-contract.md,
"Data plane (exec and files)".
"""
import base64
import hashlib
import json

import pytest
from contract_support import PREFIX, Api, error_message, local_only

from microvm_localplane import dataplane

from microvm_plane_testing import team

EVENTS = {"Accept": "text/event-stream"}


def read_events(resp):
    """(event, data) pairs of an SSE response, in order; comment lines are skipped."""
    event, data = None, []
    for raw in resp.iter_lines(decode_unicode=False):
        line = raw.decode()
        if line.startswith(":"):
            continue
        if not line:
            if event is not None:
                yield event, json.loads("\n".join(data))
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def collect(events):
    out, err, rest = bytearray(), bytearray(), []
    for event, data in events:
        if event == "stdout":
            out += base64.b64decode(data["data"])
        elif event == "stderr":
            err += base64.b64decode(data["data"])
        else:
            rest.append((event, data))
    return bytes(out), bytes(err), rest


@pytest.fixture
def streaming(plane):
    """The team switch behind which the plane streams events at all (others get the documented buffered answer)."""
    with team(plane, interactive_stdin=True):
        yield


def start(api, sid, body):
    return api.call("POST", "/sessions/%s/sandbox/exec" % sid, headers=EVENTS, json=body, stream=True)


@pytest.mark.parametrize("prefix", [PREFIX, "/v2/harness-runtime"])
def test_exec_streams_started_output_and_exit_events(plane, make_session, prefix, streaming):
    sid = make_session()["session_id"]
    api = Api(plane, prefix=prefix)
    resp = start(api, sid, {"argv": ["/bin/sh", "-c", "printf out; printf err >&2; exit 3"]})
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = list(read_events(resp))
    assert events[0][0] == "started" and events[0][1]["exec_id"]
    out, err, rest = collect(events[1:])
    assert (out, err) == (b"out", b"err")
    assert rest[-1][0] == "exit" and rest[-1][1]["exit_code"] == 3 and rest[-1][1]["timed_out"] is False


def test_one_shot_stdin_is_delivered_then_closed(plane, api, make_session, streaming):
    sid = make_session()["session_id"]
    payload = bytes(range(256)) * 2048  # 512 KiB of every byte value (as base64, within a 1 MiB body)
    resp = start(api, sid, {"argv": ["sha256sum"], "stdin": base64.b64encode(payload).decode()})
    assert resp.status_code == 200, resp.text
    out, _err, rest = collect(list(read_events(resp))[1:])
    assert out.split()[0].decode() == hashlib.sha256(payload).hexdigest()
    assert rest[-1][1]["exit_code"] == 0


def test_timeout_stops_the_command_and_says_so(plane, api, make_session, streaming):
    sid = make_session()["session_id"]
    resp = start(api, sid, {"argv": ["sleep", "30"], "timeout_seconds": 1})
    _out, _err, rest = collect(list(read_events(resp))[1:])
    assert rest[-1][0] == "exit" and rest[-1][1]["timed_out"] is True


def test_a_client_that_hangs_up_on_a_quiet_command_stops_it(plane, api, make_session, streaming):
    """A command that writes nothing still stops soon after its client goes (not at the next keepalive)."""
    import time
    sid = make_session()["session_id"]
    import http.client
    import socket
    import urllib.parse
    url = urllib.parse.urlsplit(api.url("/sessions/%s/sandbox/exec" % sid))
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    body = json.dumps({"argv": ["sh", "-c", "sleep 3; touch /workspace/hung-up-marker"], "timeout_seconds": 60})
    headers = dict(EVENTS, Authorization="Bearer " + plane.token, **{"Content-Type": "application/json"})
    conn.request("POST", url.path, body=body, headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"event: started")
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away; the command has said nothing yet
    conn.close()
    time.sleep(5)
    check = api.call("POST", "/sessions/%s/sandbox/exec" % sid, json={"argv": ["test", "-e", "/workspace/hung-up-marker"]})
    assert check.json()["exit_code"] == 1, "the command ran on after its client hung up"


def test_the_buffered_answer_is_the_documented_one_even_when_events_are_asked_for(plane, api, make_session):
    """Without the team's switch the answer is {exit_code, stdout, stderr, duration_ms} (text), whatever Accept says;
    a non-zero exit is still 200, and a negative timeout_seconds is clamped, not refused."""
    sid = make_session()["session_id"]
    resp = api.call("POST", "/sessions/%s/sandbox/exec" % sid, headers=EVENTS, timeout=60,
                    json={"argv": ["/bin/sh", "-c", "printf out; printf err >&2; exit 3"], "timeout_seconds": -1})
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("application/json"), resp.text
    doc = resp.json()
    assert set(doc) == {"exit_code", "stdout", "stderr", "duration_ms"}
    assert (doc["exit_code"], doc["stdout"], doc["stderr"]) == (3, "out", "err") and isinstance(doc["duration_ms"], int)


@local_only
def test_the_buffered_answer_caps_each_stream_and_says_so_in_a_header(plane, api, make_session):
    sid = make_session()["session_id"]
    resp = api.call("POST", "/sessions/%s/sandbox/exec" % sid, timeout=60,
                    json={"argv": ["/bin/sh", "-c", "head -c 1100000 /dev/zero | tr '\\0' x; printf e >&2"]})
    doc = resp.json()
    assert len(doc["stdout"]) == 1024 * 1024 and doc["stderr"] == "e"
    assert resp.headers.get("X-Exec-Stdout-Truncated") == "true" and "X-Exec-Stderr-Truncated" not in resp.headers


@local_only
def test_the_plane_clamp_is_a_setting(plane, api, make_session):
    """exec_max_timeout (240 by default, as documented) lowered: a longer command is stopped at it."""
    sid = make_session()["session_id"]
    with team(plane, exec_max_timeout=2):
        resp = api.call("POST", "/sessions/%s/sandbox/exec" % sid, timeout=60,
                        json={"argv": ["sleep", "20"], "timeout_seconds": 30})
    assert resp.status_code == 200 and resp.json()["exit_code"] != 0 and resp.json()["duration_ms"] < 10000


@local_only
def test_keep_stdin_open_is_403_unless_the_team_has_it(plane, api, make_session):
    sid = make_session()["session_id"]
    resp = start(api, sid, {"argv": ["cat"], "keep_stdin_open": True})
    assert resp.status_code == 403, resp.text
    assert "not enabled for this team" in error_message(resp)
    # the buffered form is refused the same way: the switch is the team's, whatever the media type
    resp = api.call("POST", "/sessions/%s/sandbox/exec" % sid, json={"argv": ["cat"], "keep_stdin_open": True})
    assert resp.status_code == 403


@local_only
def test_interactive_stdin_offsets_retries_and_eof(plane, api, make_session):
    sid = make_session()["session_id"]
    with team(plane, interactive_stdin=True):
        resp = api.call("POST", "/sessions/%s/sandbox/exec" % sid, json={"argv": ["cat"], "keep_stdin_open": True})
        assert resp.status_code == 400 and "Accept: text/event-stream" in error_message(resp)
        resp = start(api, sid, {"argv": ["cat"], "keep_stdin_open": True})
        assert resp.status_code == 200, resp.text
        events = read_events(resp)
        event, data = next(events)
        assert event == "started"
        path = "/sessions/%s/sandbox/exec/%s/stdin" % (sid, data["exec_id"])

        def write(**body):
            if "data" in body:
                body["data"] = base64.b64encode(body["data"]).decode()
            return api.call("POST", path, json=body)

        assert write(offset=0, data=b"hello ").json()["offset"] == 6
        assert write(offset=3, data=b"lo world").json()["offset"] == 11  # a retry: the overlap is trimmed
        gap = write(offset=20, data=b"x")
        assert gap.status_code == 409 and "offset" in error_message(gap)
        assert write(offset=11).status_code == 400  # neither data nor eof
        assert write(offset=11, data=b"").status_code == 400  # empty data is no data
        assert write(offset=11, eof=True).json()["eof"] is True
        assert write(offset=11, data=b"late").status_code in (404, 409)  # closed (or already finished)
        out, _err, rest = collect(events)
        assert out == b"hello world"
        assert rest[-1][1]["exit_code"] == 0
        # finished: unknown from now on
        assert write(offset=11, data=b"x").status_code == 404


@local_only
def test_stdin_writes_refused_as_the_dots_page_says(plane, api, make_session):
    """STDIN-WRITE, for an exec still running: a second eof, or a write after eof, is a 409; more than 1 MiB in one
    write is a 413; once the team cannot accept interactive stdin, a write is a 409 (not a 403)."""
    sid = make_session()["session_id"]
    with team(plane, interactive_stdin=True):
        resp = start(api, sid, {"argv": ["sh", "-c", "cat >/dev/null; sleep 20"], "keep_stdin_open": True,
                                "timeout_seconds": 30})
        event, data = next(read_events(resp))
        assert event == "started"
        path = "/sessions/%s/sandbox/exec/%s/stdin" % (sid, data["exec_id"])

        def write(**body):
            if "data" in body:
                body["data"] = base64.b64encode(body["data"]).decode()
            return api.call("POST", path, json=body)

        too_big = write(offset=0, data=b"x" * (1024 * 1024 + 1))
        assert too_big.status_code == 413, too_big.text
        assert write(offset=0, data=b"x" * (1024 * 1024)).status_code == 200  # "at most 1 MiB": 1 MiB is taken
        dataplane.write_settings(plane.state_dir, interactive_stdin=False)  # the team loses it mid-exec
        off = write(offset=1024 * 1024, data=b"y")
        assert off.status_code == 409, off.text
        dataplane.write_settings(plane.state_dir, interactive_stdin=True)
        assert write(offset=1024 * 1024, eof=True).status_code == 200
        second = write(offset=1024 * 1024, eof=True)
        assert second.status_code == 409 and "closed" in error_message(second)
        late = write(offset=1024 * 1024, data=b"z")
        assert late.status_code == 409 and "closed" in error_message(late)
        resp.close()


@local_only
def test_stdin_of_a_one_shot_exec_is_closed(plane, api, make_session):
    sid = make_session()["session_id"]
    with team(plane, interactive_stdin=True):
        resp = start(api, sid, {"argv": ["sleep", "5"], "timeout_seconds": 10})
        event, data = next(read_events(resp))
        path = "/sessions/%s/sandbox/exec/%s/stdin" % (sid, data["exec_id"])
        late = api.call("POST", path, json={"offset": 0, "data": "eA=="})
        assert late.status_code == 409 and "closed" in error_message(late)
        resp.close()


def test_stdin_of_an_unknown_exec_is_404(plane, api, make_session):
    sid = make_session()["session_id"]
    resp = api.call("POST", "/sessions/%s/sandbox/exec/01932a6e-7b4c-7d2e-8f10-1a2b3c4d5e6f/stdin" % sid,
                    json={"offset": 0, "eof": True})
    assert resp.status_code == 404


@local_only
def test_a_closed_agent_port_refuses_the_port_forward_not_the_data_plane(plane, api, make_session):
    sid = make_session()["session_id"]
    with team(plane, closed_ports=[8443]):
        resp = api.call("GET", "/sessions/%s/port-forward/8443" % sid,
                        headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                 "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert resp.status_code == 502 and "8443" in error_message(resp)
        resp = api.call("POST", "/sessions/%s/sandbox/exec" % sid, json={"argv": ["echo", "still here"]})
        assert resp.status_code == 200 and resp.json()["stdout"] == "still here\n"


def test_relative_transfer_paths_resolve_under_the_workspace(plane, api, make_session):
    sid = make_session()["session_id"]
    up = api.call("POST", "/sessions/%s/workspace/upload" % sid, params={"path": "rel dir/x.txt"}, data=b"rel\n",
                  headers={"Content-Type": "application/octet-stream"})
    assert up.status_code == 200, up.text
    assert up.json()["path"] == "/workspace/rel dir/x.txt"
    down = api.call("GET", "/sessions/%s/workspace/download" % sid, params={"path": "/workspace/rel dir/x.txt"})
    assert down.content[:-73] == b"rel\n" and down.content[-73:-65] == b"DOWSSHA1"
    escape = api.call("POST", "/sessions/%s/workspace/upload" % sid, params={"path": "../etc/x"}, data=b"x",
                      headers={"Content-Type": "application/octet-stream"})
    assert escape.status_code == 403, escape.text


@local_only
def test_a_throttled_team_gets_429_with_retry_after_before_its_exec_is_taken(plane, api, make_session):
    """The plane's stand-in for a rate-limited team (the `throttle` team setting): the next `calls` execs answer
    the documented 429 with Retry-After (RETRY-AFTER) and run nothing; then execs run again."""
    import uuid
    sid = make_session()["session_id"]
    body = {"argv": ["sh", "-c", "echo ran >> /workspace/throttled-runs"]}
    with team(plane, throttle={"id": uuid.uuid4().hex, "calls": 2, "retry_after": 3}):
        for refused in (1, 2):
            resp = api.call("POST", "/sessions/%s/sandbox/exec" % sid, json=body)
            assert resp.status_code == 429 and resp.headers["Retry-After"] == "3", (refused, resp.text)
            assert resp.json()["id"] == "too_many_requests"
        assert api.call("POST", "/sessions/%s/sandbox/exec" % sid, json=body).json()["exit_code"] == 0
    runs = api.call("POST", "/sessions/%s/sandbox/exec" % sid, json={"argv": ["cat", "/workspace/throttled-runs"]})
    assert runs.json()["stdout"] == "ran\n"  # the refused calls ran nothing
    with pytest.raises(ValueError, match="throttle must be"):
        dataplane.write_settings(plane.state_dir, throttle={"calls": -1})
        dataplane.read_settings(plane.state_dir)
    dataplane.write_settings(plane.state_dir, throttle=None)
