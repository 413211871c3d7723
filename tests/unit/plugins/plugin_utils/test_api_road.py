"""The api road's client (plugin_utils/_mux/api_road.py and its api_*.py parts) against a stand-in HTTP server: one layer, its edge cases.

The whole road through the real stack (local plane, guest) is tests/integration/test_connection_api.py.
"""
import base64
import hashlib
import http.server
import json
import select
import threading

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_exec, api_road, api_transfer, run_dirs
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

SID = "a1b2c3d4-e5f6-7890-abcd-ef1234567890"


class Fake(http.server.BaseHTTPRequestHandler):
    """Answers what the test put in `server.answers[(method, path-without-query)]`: (status, headers, body)."""

    def log_message(self, *args):
        pass

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.server.seen.append((self.command, self.path, dict(self.headers), self.rfile.read(length) if length else b""))
        answer = self.server.answers[(self.command, self.path.split("?")[0])]
        answer = answer.pop(0) if isinstance(answer, list) else answer  # a list: one answer a call
        if answer is None:  # the call was read, then the connection dropped without an answer
            self.close_connection = True
            return
        status, headers, body = answer
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer


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


def answer(exit_code=0, stdout="", stderr="", duration_ms=5, headers=None):
    """A buffered exec answer, as the pages print it (stdout and stderr are text)."""
    doc = {"exit_code": exit_code, "stdout": stdout, "stderr": stderr, "duration_ms": duration_ms}
    return (200, dict({"Content-Type": "application/json"}, **(headers or {})), json.dumps(doc).encode())


def job_done(rc, out, err, kept=0, **kw):
    """What the job script answers for a job that ended (api_exec.JOB_SCRIPT): its output base64, then its word."""
    trailer = "\n%s done %d %d %d %d\n" % (api_exec.TRAILER.decode(), rc, len(out), len(err), kept)
    return answer(0, b64(out.encode()), b64(err.encode()) + trailer, **kw)


def test_the_documented_answer_parses_exactly_as_the_pages_print_it():
    """The response example of harness-post-session-sandbox-exec (DoTs v1.24.0), byte for byte."""
    example = '{\n  "exit_code": 0,\n  "stdout": "Linux",\n  "stderr": "",\n  "duration_ms": 12\n}'
    got = api_exec.parse_answer(json.loads(example), {})
    assert (got.exit_code, got.stdout, got.stderr, got.duration_ms, got.cut) == (0, b"Linux", b"", 12, ())
    assert api_exec.parse_answer({"exit_code": 1, "stdout": "x" * api_exec.STREAM_CAP, "stderr": ""}).cut == ("stdout",)
    assert api_exec.parse_answer({"exit_code": 1, "stdout": "", "stderr": "e"},
                                 {api_exec.TRUNCATED_HEADERS["stderr"]: "true"}).cut == ("stderr",)
    with pytest.raises(errors.SandboxError, match="not"):
        api_exec.parse_answer({"exit_code": "0", "stdout": "", "stderr": ""})


def test_exec_is_one_buffered_job_and_carries_env_through_env1(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = job_done(3, "out", "err")
    result = client.exec(["printenv", "A"], env={"A": "1 2"}, stdin=b"in")
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, b"out", b"err", False)
    assert len(server.seen) == 1
    method, _path, headers, body = server.seen[0]
    doc = json.loads(body)
    assert headers["Accept"] == "application/json" and headers["Authorization"] == "Bearer tok"
    assert doc["argv"][:5] == ["/bin/sh", "-c", api_exec.JOB_SCRIPT, "sh", "run"]
    assert doc["argv"][6:] == [str(api_exec.WAIT_SLICE), "0", "0", "0", "0", "/usr/bin/env", "--", "A=1 2", "printenv", "A"]
    assert doc["argv"][5].startswith("/workspace/.scratch/%s/jobs/" % run_dirs.api_dir_name(""))
    assert base64.b64decode(doc["stdin"]) == b"in" and doc["timeout_seconds"] <= api_exec.EXEC_MAX_TIMEOUT
    assert "keep_stdin_open" not in doc


def test_a_job_that_outlives_one_exec_is_polled_and_a_cut_answer_probed(fake):
    server, client = fake
    running = answer(0, "", "\n%s running 0 0\n" % api_exec.TRAILER.decode())
    early = answer(0, b64(b"early "), "\n%s running 6 0\n" % api_exec.TRAILER.decode())
    done = answer(0, b64(b"late"), "\n%s done 0 10 0 0\n" % api_exec.TRAILER.decode())
    server.answers[("POST", route("/sandbox/exec"))] = [answer(137, "", "", duration_ms=3000), running, early, done]
    result = client.exec(["sleep", "300"])
    assert (result.exit_code, result.stdout) == (0, b"early late")
    modes = [json.loads(seen[3])["argv"][4] for seen in server.seen]
    assert modes == ["run", "wait", "wait", "wait"]
    assert json.loads(server.seen[2][3])["argv"][6] == "2"  # the exec cut at 3 s taught the road to wait less
    assert json.loads(server.seen[3][3])["argv"][7:9] == ["6", "0"]  # a poll says what the road has read


def word(text):
    return "\n%s %s\n" % (api_exec.TRAILER.decode(), text)


@pytest.mark.parametrize("said", ["running 0 0 1001", "done 0 1000 1 1"])
def test_a_job_past_its_output_limit_is_stopped_before_its_output_is_moved(fake, said):
    """The worker's max_output_bytes goes to the job script; a job that reports more written (running, or done with
    its output left for download) fails naming the option and is dropped at once: nothing is polled or downloaded."""
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = [answer(0, "", word(said)), answer(0, "", word("absent"))]
    call, feed = client.exec_stream(["yes"], stdin=b"", output_limit=1000)
    with pytest.raises(errors.OutputOverLimit, match="printed more than 1000 bytes.*max_output_bytes"):
        list(client.iter_exec(call, feed))
    argvs = [json.loads(seen[3])["argv"] for seen in server.seen]
    assert [a[4] for a in argvs] == ["run", "drop"] and argvs[0][9] == "1000"
    assert all(seen[0] == "POST" for seen in server.seen)  # no download


def test_a_job_within_its_output_limit_runs_to_its_end(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = [answer(0, b64(b"ab"), word("running 2 0 1000")),
                                                        answer(0, b64(b"c"), word("done 0 3 0 0"))]
    call, feed = client.exec_stream(["yes"], stdin=b"", output_limit=1000)
    assert [k for k, _d in client.iter_exec(call, feed)] == ["stdout", "stdout", "exit"]


def test_a_job_that_never_started_says_why(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = [answer(1, "", "mkdir: Permission denied\n"),
                                                        answer(0, "", "\n%s absent\n" % api_exec.TRAILER.decode())]
    with pytest.raises(errors.SandboxError, match="could not be started.*Permission denied"):
        client.exec(["true"])


@pytest.mark.parametrize("word", ["done x 1 0 0", "done 0 1 0", "done 0 99999999999999999999 0 0", "running -1 0",
                                  "running 0 0 0 0", "finished 0 0 0 0"])
def test_a_job_word_of_no_shape_the_script_prints_is_a_lost_command(fake, word):
    """The guest is hostile: its last word is taken only in the script's own shapes, never parsed blindly."""
    server, client = fake
    hostile = answer(0, "", "\n%s %s\n" % (api_exec.TRAILER.decode(), word))
    server.answers[("POST", route("/sandbox/exec"))] = [hostile, hostile, answer(0, "", "\n%s absent\n" % api_exec.TRAILER.decode())]
    with pytest.raises(errors.CommandLost, match="does not answer"):
        client.exec(["true"])


def test_held_stdin_without_the_team_setting_names_it_and_remembers(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = (403, {}, json.dumps(
        {"error": {"code": 403, "message": "interactive stdin is not enabled"}}).encode())
    call, feed = client.exec_stream(["sudo", "-S", "id"], hold_stdin=True)
    with pytest.raises(errors.SandboxError, match=r"interactive stdin \(keep_stdin_open\).*Nothing was run"):
        list(client.iter_exec(call, feed))
    assert client.interactive is False
    with pytest.raises(errors.SandboxError, match="not enabled for this team"):
        client.exec_stream(["sudo", "-S", "id"], hold_stdin=True)  # refused before any request now
    assert len(server.seen) == 1


def test_a_command_whose_worker_left_before_its_stdin_ended_is_never_started(fake):
    server, client = fake
    call, feed = client.exec_stream(["sh"])
    feed.put(b"half of a payload")
    call.cancel()     # the mux saw the worker hang up ...
    feed.put(None)    # ... and ended the stdin queue
    with pytest.raises(errors.CommandLost, match="before it started"):
        list(client.iter_exec(call, feed))
    assert server.seen == []


def footer(payload):
    return b"DOWSSHA1" + hashlib.sha256(payload).hexdigest().encode() + b"\n"


@pytest.mark.parametrize("body,error", [
    (b"payload" + footer(b"payload"), None),
    (b"", errors.GuestUnavailable),                                # nothing at all
    (b"payload" + footer(b"payload")[:-1], errors.GuestUnavailable),  # a truncated footer
    (b"payloaX" + footer(b"payload"), errors.ChecksumMismatch),       # a changed byte
    (b"p" * 200, errors.GuestUnavailable),                         # no footer shape at all
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
    with pytest.raises(errors.Denied):
        client.upload(str(src), "/workspace/link/x")
    server.answers[("GET", route("/workspace/download"))] = (404, {}, b'{"error": {"message": "no such file"}}')
    with pytest.raises(errors.NotFound):
        client.download("/workspace/none", str(tmp_path / "none"))
    upload = server.seen[0]
    assert upload[2]["X-Content-Sha256"] == hashlib.sha256(b"abc").hexdigest() and upload[3] == b"abc"


def test_paths_outside_the_transfer_root_are_refused_before_any_request(fake, tmp_path):
    server, client = fake
    with pytest.raises(Exception, match="/workspace"):
        client.download("/etc/passwd", str(tmp_path / "x"))
    assert server.seen == []


def test_bad_env_names_are_refused():
    with pytest.raises(errors.SandboxError):
        api_road.env_argv(["true"], {"A=B": "1"})
    assert api_road.env_argv(["true"], {}) == ["true"]


def test_the_transport_setting_on_the_wire_and_in_the_link_key():
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
    default = LinkConfig(session="box", token="t")
    agent = LinkConfig(session="box", token="t", transport="agent")
    api = LinkConfig(session="box", token="t", transport="API")
    assert default.transport == "auto" and LinkConfig(session="box", token="t", transport=None).transport == "auto"
    for cfg in (default, agent, api):  # always on the wire, so a mux's own default never decides
        assert cfg.to_wire()["transport"] == cfg.transport and LinkConfig.from_wire(cfg.to_wire()) == cfg
    assert api.transport == "api"
    # an attach without it comes from a worker of before `auto` became the default, which left `agent` off the wire
    old_wire = {k: v for k, v in agent.to_wire().items() if k != "transport"}
    assert LinkConfig.from_wire(old_wire).transport == "agent"
    assert len({agent.key, api.key, default.key}) == 3
    with pytest.raises(ValueError, match="agent, api, auto"):
        LinkConfig(session="box", token="t", transport="ssh")


# -- staged transfers -------------------------------------------------------------------------
def stat_says(server, size):
    """The guest's `stat` answer, which picks the road (streaming or staged)."""
    server.answers[("POST", route("/sandbox/exec"))] = answer(0, "%d\n" % size)


def staged_download(server, payload, sha=None, size=None, status="completed"):
    base = "http://127.0.0.1:%d" % server.server_address[1]
    server.answers[("POST", route("/workspace/transfers"))] = (202, {}, b'{"transfer_id": "tr_1"}')
    server.answers[("GET", route("/workspace/transfers/tr_1"))] = (200, {}, json.dumps({
        "transfer_id": "tr_1", "direction": "download", "status": status, "error_message": "",
        "bytes_written": len(payload) if size is None else size,
        "sha256": hashlib.sha256(payload).hexdigest() if sha is None else sha,
        "download_url": base + "/_obj/tr_1?signature=s", "expires_at": "2026-12-01T00:00:00Z"}).encode())
    server.answers[("POST", route("/workspace/transfers/tr_1/cancel"))] = (200, {}, b'{"aborted": false}')


PAYLOAD = b"0123456789" * 200


@pytest.mark.parametrize("body,declared,sha,error", [
    (PAYLOAD, None, None, None),
    (PAYLOAD[:-1] + b"X", len(PAYLOAD), hashlib.sha256(PAYLOAD).hexdigest(), errors.ChecksumMismatch),  # a changed byte
    (PAYLOAD + b"more", len(PAYLOAD), hashlib.sha256(PAYLOAD).hexdigest(), errors.SandboxError),      # longer than reported
    (PAYLOAD, None, "not-a-sha", errors.ChecksumMismatch),                                             # no usable sha256
    (PAYLOAD, api_transfer.STAGED_MAX + 1, None, errors.SandboxError),                                       # past 50 GiB
])
def test_a_staged_download_is_bounded_and_verified_before_it_lands(fake, tmp_path, monkeypatch, body, declared, sha,
                                                                   error):
    server, client = fake
    monkeypatch.setattr(api_transfer, "STREAM_DOWNLOAD_MAX", 1000)
    stat_says(server, len(PAYLOAD))
    staged_download(server, PAYLOAD, sha=sha, size=declared)
    server.answers[("GET", "/_obj/tr_1")] = (200, {}, body)
    dest = tmp_path / "out"
    if error is None:
        assert client.download("/workspace/f", str(dest)) == len(PAYLOAD)
        assert dest.read_bytes() == PAYLOAD
    else:
        with pytest.raises(error):
            client.download("/workspace/f", str(dest))
        assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if error is None else [])
    create = [s for s in server.seen if s[1].split("?")[0] == route("/workspace/transfers")][0]
    assert json.loads(create[3]) == {"direction": "download", "path": "f"}  # workspace-relative
    gets = [s for s in server.seen if s[1].startswith("/_obj/")]
    assert len(gets) == (0 if declared == api_transfer.STAGED_MAX + 1 or sha == "not-a-sha" else 1)
    assert all("Authorization" not in s[2] for s in gets), "the API token never goes to object storage"


def test_a_failed_staged_download_names_the_platforms_reason(fake, tmp_path, monkeypatch):
    server, client = fake
    monkeypatch.setattr(api_transfer, "STREAM_DOWNLOAD_MAX", 1000)
    stat_says(server, 5000)
    staged_download(server, PAYLOAD, status="failed")
    server.answers[("GET", route("/workspace/transfers/tr_1"))] = (200, {}, json.dumps({
        "status": "failed", "error_message": "the export was cut"}).encode())
    with pytest.raises(errors.SandboxError, match="the export was cut"):
        client.download("/workspace/f", str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


def test_a_direct_download_past_the_streaming_bound_is_refused_before_asking(fake, tmp_path):
    server, client = fake
    with pytest.raises(errors.SandboxError, match="streaming download carries at most 52428800 bytes"):
        client.transfers._direct_download("/workspace/f", str(tmp_path / "out"), known_size=api_transfer.STREAM_DOWNLOAD_MAX + 1)
    assert server.seen == []


def test_a_direct_download_stops_at_the_streaming_bound_when_the_guest_misreports(fake, tmp_path, monkeypatch):
    server, client = fake
    monkeypatch.setattr(api_transfer, "STREAM_DOWNLOAD_MAX", 1000)
    stat_says(server, 10)  # the guest says small; it sends more
    server.answers[("GET", route("/workspace/download"))] = (200, {}, PAYLOAD + footer(PAYLOAD))
    with pytest.raises(errors.SandboxError, match="announced as 2073 bytes with its footer, past the streaming bound of 1000"):
        client.download("/workspace/f", str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("body,declared,error", [
    (b"", 0, None),                                  # an empty file
    (b"x", 1, None),                                 # one byte
    (PAYLOAD[:-10], len(PAYLOAD), errors.SandboxError),  # the object is shorter than the transfer reported
])
def test_a_staged_download_of_any_size_lands_only_whole(fake, tmp_path, monkeypatch, body, declared, error):
    server, client = fake
    monkeypatch.setattr(api_transfer, "STREAM_DOWNLOAD_MAX", 0)
    stat_says(server, declared + 1)  # past the bound of 0: staged
    staged_download(server, body if error is None else PAYLOAD, size=declared)
    server.answers[("GET", "/_obj/tr_1")] = (200, {}, body)
    dest = tmp_path / "out"
    if error is None:
        assert client.download("/workspace/f", str(dest)) == declared and dest.read_bytes() == body
    else:
        with pytest.raises(error, match="the transfer reported %d" % declared):
            client.download("/workspace/f", str(dest))
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("final,error", [("completed", None), ("failed", errors.ChecksumMismatch)])
def test_a_staged_upload_puts_its_parts_presigned_and_commits_its_sha256(fake, tmp_path, monkeypatch, final, error):
    server, client = fake
    monkeypatch.setattr(api_transfer, "MAX_UPLOAD", 10)
    monkeypatch.setattr(api_transfer, "PART_URL_BATCH", 2)
    src = tmp_path / "src"
    src.write_bytes(b"abcdefghij" * 2 + b"klmno")
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    base = "http://127.0.0.1:%d" % server.server_address[1]
    server.answers[("POST", route("/workspace/transfers"))] = (201, {}, b'{"transfer_id": "tr_2", "part_size": 10}')
    server.answers[("POST", route("/workspace/transfers/tr_2/part-upload-urls"))] = (200, {}, json.dumps({
        "transfer_id": "tr_2", "expires_at": "2026-12-01T00:00:00Z",
        "part_urls": [{"part_number": n, "upload_url": base + "/_obj/tr_2/%d?signature=s" % n} for n in (1, 2, 3)],
    }).encode())
    for n in (1, 2, 3):
        server.answers[("PUT", "/_obj/tr_2/%d" % n)] = (200, {}, b"")
    server.answers[("POST", route("/workspace/transfers/tr_2/commit"))] = (202, {}, b'{"status": "pending"}')
    server.answers[("GET", route("/workspace/transfers/tr_2"))] = (200, {}, json.dumps({
        "status": final, "bytes_written": 25 if final == "completed" else 0,
        "error_message": "" if final == "completed" else "sha256 mismatch: nothing was written"}).encode())
    server.answers[("POST", route("/workspace/transfers/tr_2/cancel"))] = (200, {}, b'{"aborted": false}')
    if error is None:
        assert client.upload(str(src), "/workspace/dir/big") == 25
    else:
        with pytest.raises(error):
            client.upload(str(src), "/workspace/dir/big")
    seen = {(m, p.split("?")[0]): (h, b) for m, p, h, b in server.seen}
    created = json.loads(seen[("POST", route("/workspace/transfers"))][1])
    assert created == {"direction": "upload", "path": "dir/big", "size_bytes": 25, "sha256": sha}
    puts = [(p, h, b) for m, p, h, b in server.seen if m == "PUT"]
    assert [b for _p, _h, b in puts] == [b"abcdefghij", b"abcdefghij", b"klmno"]
    assert all("Authorization" not in h for _p, h, _b in puts), "the API token never goes to object storage"
    assert json.loads(seen[("POST", route("/workspace/transfers/tr_2/commit"))][1]) == {"sha256": sha}
    assert (("POST", route("/workspace/transfers/tr_2/cancel")) in seen) == (error is not None)


def test_a_platform_without_staged_transfers_gets_no_direct_download_past_the_bound(fake, tmp_path, monkeypatch):
    """A big file on a platform that answers the transfers route 404: refused naming both roads, and the
    streaming download past its bound is never asked for."""
    server, client = fake
    monkeypatch.setattr(api_transfer, "STREAM_DOWNLOAD_MAX", 1000)
    stat_says(server, 5000)
    server.answers[("POST", route("/workspace/transfers"))] = (404, {}, b'{"id": "not_found", "message": "no such route"}')
    with pytest.raises(errors.SandboxError, match="no staged transfers") as err:
        client.download("/workspace/f", str(tmp_path / "out"))
    assert "5000 bytes" in str(err.value) and "transport agent" in str(err.value)
    assert not [s for s in server.seen if s[1].startswith(route("/workspace/download"))]
    assert list(tmp_path.iterdir()) == []


class KeepAlive(Fake):
    """Fake over HTTP/1.1: a connection stays open between calls; each new one is counted."""

    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.server.connections += 1

    def send_header(self, keyword, value):
        if keyword == "X-Then-Close":  # the server drops the connection after this answer, without saying so
            self.close_connection = True
            return
        super().send_header(keyword, value)


@pytest.fixture
def keepalive():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    server.answers, server.seen, server.connections = {}, [], 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = api_road.ApiRoadClient("http://127.0.0.1:%d" % server.server_address[1], "/v2/agents", "tok", SID, "box",
                                    connect_timeout=5)
    yield server, client
    client.close()
    server.shutdown()


def test_calls_share_one_kept_alive_connection(keepalive):
    server, client = keepalive
    server.answers[("POST", route("/sandbox/exec"))] = answer(0, "hi")
    for _dummy in range(3):
        assert client.jobs.raw(["echo", "hi"]).stdout == b"hi"
    assert len(server.seen) == 3 and server.connections == 1


def test_a_cancelled_call_hangs_up_its_own_connection_and_it_is_not_kept(keepalive):
    server, client = keepalive
    server.answers[("POST", route("/sandbox/exec"))] = answer(0, "hi")
    client.jobs.raw(["true"])
    call = api_road.Call(["true"], "", 0, False)
    call.cancel()
    with pytest.raises(errors.SandboxError):
        client.jobs.raw(["true"], call=call)
    assert client.http._idle is None  # the kept connection went to the cancelled call, which closed it
    client.jobs.raw(["true"])
    assert server.connections == 2 and len(server.seen) == 2  # the cancelled call sent nothing


def test_a_kept_connection_the_server_closes_is_replaced_without_losing_a_call(keepalive):
    """An answer that says `Connection: close` is not kept; one kept that the server then closed while idle is
    replaced when the next call finds it closed (before the server read that call)."""
    server, client = keepalive
    closing = (200, {"Content-Type": "application/json", "Connection": "close"},
               json.dumps({"exit_code": 0, "stdout": "two", "stderr": ""}).encode())
    quietly_closing = (200, {"Content-Type": "application/json", "X-Then-Close": "1"},
                       json.dumps({"exit_code": 0, "stdout": "three", "stderr": ""}).encode())
    server.answers[("POST", route("/sandbox/exec"))] = [answer(0, "one"), closing, quietly_closing, answer(0, "four")]
    said = [client.jobs.raw(["x"]).stdout for _dummy in range(3)]
    kept = client.http._idle
    assert kept is not None and kept.sock is not None
    select.select([kept.sock], [], [], 5)  # the server's close reaches this end (an exec is never sent to find out)
    said.append(client.jobs.raw(["x"]).stdout)
    assert said == [b"one", b"two", b"three", b"four"]
    assert server.connections == 3 and len(server.seen) == 4  # each call answered once: none sent twice


def test_an_exec_on_a_kept_connection_that_breaks_is_lost_never_sent_twice(keepalive):
    """The server may have taken an exec before its connection broke: the road reports the command lost (it may
    have run) instead of running it a second time; a call that runs nothing is sent again."""
    server, client = keepalive
    server.answers[("POST", route("/sandbox/exec"))] = [answer(0, "one"), None, answer(0, "three")]
    assert client.jobs.raw(["x"]).stdout == b"one"
    with pytest.raises(errors.CommandLost, match="not re-run"):
        client.jobs.raw(["x"])
    assert len(server.seen) == 2  # taken once, not sent again
    assert client.jobs.raw(["x"]).stdout == b"three"
    server.answers[("GET", route("/probe"))] = [(200, {}, b"{}"), None, (200, {}, b"{}")]
    assert client.http.json_call("GET", "/probe") == {}
    assert client.http.json_call("GET", "/probe") == {}  # the broken one sent again on a new connection
