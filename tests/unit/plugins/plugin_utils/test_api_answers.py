"""The api road's answers to a platform that says no: interactive stdin writes refused or cut (api_events.StdinWriter),
429 (waited out and sent again, in Http.send alone), 413, an exec answer without exit_code, a download whose footer
does not match. One layer against a real HTTP server on 127.0.0.1 (test_api_road's `fake`); the plane's side of the
same codes is localplane/tests/contract/test_contract_dataplane.py.
"""
import base64
import email.utils
import json
import queue
import time

import pytest
import test_api_road
from test_api_road import SID, events, footer, job_done, route

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_events, api_exec, api_http
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

EXEC_ID = "01932a6e-7b4c-7d2e-8f10-1a2b3c4d5e6f"
STDIN = ("POST", route("/sandbox/exec/%s/stdin" % EXEC_ID))
fake = test_api_road.fake  # the stand-in server and a client of it (a fixture)


def ok(**doc):
    return (200, {"Content-Type": "application/json"}, json.dumps(doc).encode())


def refused(status, message, headers=None):
    return (status, dict({"Content-Type": "application/json"}, **(headers or {})),
            json.dumps({"id": "x", "message": message, "request_id": "r"}).encode())


def write_all(client, *chunks):
    """Run the stdin writer over `chunks` then eof, as the road does; (the writes it sent, its call)."""
    call = api_http.Call(["cat"], "", 0, True)
    call.exec_id = EXEC_ID
    feed = queue.Queue()
    for chunk in chunks:
        feed.put(chunk)
    feed.put(None)
    api_events.write_stdin(client.http, call, feed, "box")
    return call


def writes(server):
    """(offset, data, eof) of every stdin write the server saw, in order."""
    out = []
    for _method, path, _headers, body in server.seen:
        if path.endswith("/stdin"):
            doc = json.loads(body)
            out.append((doc["offset"], base64.b64decode(doc.get("data", "")), doc.get("eof", False)))
    return out


# -- interactive stdin writes ----------------------------------------------------------------
def test_writes_carry_the_accepted_offset_and_close_stdin_last(fake):
    server, client = fake
    server.answers[STDIN] = [ok(exec_id=EXEC_ID, offset=3, eof=False), ok(exec_id=EXEC_ID, offset=6, eof=False),
                             ok(exec_id=EXEC_ID, offset=6, eof=True)]
    call = write_all(client, b"pw\n", b"abc")
    assert writes(server) == [(0, b"pw\n", False), (3, b"abc", False), (6, b"", True)]
    assert not call.cancelled.is_set()


def test_a_write_taken_in_part_is_continued_from_the_offset_the_platform_accepted(fake):
    server, client = fake
    server.answers[STDIN] = [ok(offset=2), ok(offset=6), ok(offset=6, eof=True)]
    write_all(client, b"abcdef")
    assert writes(server) == [(0, b"abcdef", False), (2, b"cdef", False), (6, b"", True)]


def test_an_offset_gap_is_recovered_by_sending_again_from_the_last_acknowledged_offset(fake):
    """Writes answered without an offset count as taken, their bytes kept: a 409 (gap) then sends everything from
    the last acknowledged offset, which the platform trims to what it lacks."""
    server, client = fake
    server.answers[STDIN] = [ok(), refused(409, "offset 3 is past the 1 stdin bytes accepted so far"),
                             ok(offset=6), ok(offset=6, eof=True)]
    call = write_all(client, b"abc", b"def")
    assert writes(server) == [(0, b"abc", False), (3, b"def", False), (0, b"abcdef", False), (6, b"", True)]
    assert not call.cancelled.is_set()


@pytest.mark.parametrize("status,message", [(404, "exec is unknown or finished"), (409, "stdin of exec is closed")])
def test_a_finished_exec_or_a_closed_stdin_stops_the_writes_quietly(fake, status, message):
    """404 (the command ended) and 409 with nothing unacknowledged (stdin closed): nothing more is written, and the
    command, which needs no more, is not stopped."""
    server, client = fake
    server.answers[STDIN] = [ok(offset=3), refused(status, message)]
    call = write_all(client, b"abc", b"def", b"ghi")
    assert writes(server) == [(0, b"abc", False), (3, b"def", False)]
    assert not call.cancelled.is_set()


def test_a_second_409_after_the_resend_is_a_closed_stdin(fake):
    server, client = fake
    server.answers[STDIN] = [ok(), refused(409, "gap"), refused(409, "closed")]
    call = write_all(client, b"abc", b"def")
    assert writes(server) == [(0, b"abc", False), (3, b"def", False), (0, b"abcdef", False)]
    assert not call.cancelled.is_set()


def test_a_write_answered_with_a_body_that_is_no_json_object_counts_as_taken(fake):
    server, client = fake
    server.answers[STDIN] = [(200, {}, b"ok"), (200, {}, b"[1]"), ok(offset=6, eof=True)]
    call = write_all(client, b"abc", b"def")
    assert writes(server) == [(0, b"abc", False), (3, b"def", False), (6, b"", True)]
    assert not call.cancelled.is_set()


def test_a_write_without_an_answer_is_sent_again_from_the_acknowledged_offset(fake):
    server, client = fake
    server.answers[STDIN] = [ok(offset=3), refused(503, "busy"), ok(offset=6), ok(offset=6, eof=True)]
    write_all(client, b"abc", b"def")
    assert writes(server) == [(0, b"abc", False), (3, b"def", False), (3, b"def", False), (6, b"", True)]


def test_writes_that_keep_failing_or_a_refusal_stop_the_command(fake):
    """A command waiting for stdin that cannot come would wait forever: it is stopped."""
    server, client = fake
    server.answers[STDIN] = [refused(503, "busy")] * (api_events.STDIN_RETRIES + 1)
    assert write_all(client, b"abc").cancelled.is_set()
    assert len(writes(server)) == api_events.STDIN_RETRIES + 1
    server.seen.clear()
    server.answers[STDIN] = [refused(400, "offset is required")]
    assert write_all(client, b"abc").cancelled.is_set()
    assert len(writes(server)) == 1


def test_a_started_event_without_an_exec_id_or_an_exit_without_a_code_is_a_lost_command(fake):
    server, client = fake
    for stream, said in [(events(("started", {}), ("exit", {"exit_code": 0})), "no exec id"),
                         (events(("started", {"exec_id": EXEC_ID}), ("exit", {"status": "ok"})), "no exit_code")]:
        server.answers[("POST", route("/sandbox/exec"))] = (200, {"Content-Type": "text/event-stream"}, stream)
        call, feed = client.exec_stream(["su", "-c", "id"], hold_stdin=True)
        with pytest.raises(errors.CommandLost, match=said):
            list(client.iter_exec(call, feed))


# -- 429 and 413 ----------------------------------------------------------------------------
@pytest.fixture
def waits(fake):
    _server, client = fake
    seen = []
    client.http.sleep = seen.append
    return seen


def test_a_429_is_waited_out_as_retry_after_asks_then_sent_again(fake, waits):
    server, client = fake
    later = email.utils.formatdate(time.time() + 20, usegmt=True)
    server.answers[STDIN] = [refused(429, "slow down", {"Retry-After": "7"}),
                             refused(429, "slow down", {"Retry-After": later}), ok(offset=1)]
    assert client.http.json_call("POST", "/sandbox/exec/%s/stdin" % EXEC_ID, {"offset": 0, "data": "eA=="}) == {"offset": 1}
    assert waits[0] == 7.0 and 17 <= waits[1] <= 20
    assert len(server.seen) == 3 and server.seen[0][3] == server.seen[2][3]


def test_a_429_without_retry_after_backs_off_briefly_and_gives_up_within_its_budget(fake, waits):
    server, client = fake
    server.answers[STDIN] = [refused(429, "slow down")] * 50
    with pytest.raises(errors.HttpRefused, match="rate limiting.*not taken.*later") as e:
        client.http.json_call("POST", "/sandbox/exec/%s/stdin" % EXEC_ID, {"offset": 0, "eof": True})
    assert e.value.status == 429
    assert 0 < waits[0] <= api_http.RATE_LIMIT_BACKOFF and all(w <= api_http.RATE_LIMIT_WAIT_MAX for w in waits)
    assert sum(waits) <= api_http.RATE_LIMIT_BUDGET and len(server.seen) == len(waits) + 1


def test_a_429_that_asks_for_no_wait_is_still_sent_again_a_bounded_number_of_times(fake, waits):
    server, client = fake
    server.answers[STDIN] = [refused(429, "slow down", {"Retry-After": "0"})] * 50
    with pytest.raises(errors.HttpRefused, match="429"):
        client.http.json_call("POST", "/sandbox/exec/%s/stdin" % EXEC_ID, {"offset": 0, "eof": True})
    assert len(server.seen) == api_http.RATE_LIMIT_RETRIES + 1 and set(waits) == {0.0}


def test_an_upload_answered_429_is_sent_again_whole(fake, waits, tmp_path):
    server, client = fake
    src = tmp_path / "src"
    src.write_bytes(b"0123456789" * 1000)
    server.answers[("POST", route("/workspace/upload"))] = [refused(429, "slow down", {"Retry-After": "1"}),
                                                            ok(path="/workspace/f", bytes_written=10000)]
    assert client.upload(str(src), "/workspace/f") == 10000
    assert waits == [1.0] and [seen[3] for seen in server.seen] == [src.read_bytes()] * 2


def test_an_exec_answered_429_runs_once_it_is_taken(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = [refused(429, "slow down", {"Retry-After": "0"}),
                                                        job_done(0, "out", "")]
    assert client.exec(["true"]).stdout == b"out"
    assert len(server.seen) == 2


def test_a_413_names_the_bounds_and_what_to_do(fake):
    server, client = fake
    server.answers[("POST", route("/sandbox/exec"))] = refused(413, "request body too large")
    with pytest.raises(errors.SandboxError) as e:
        client.exec(["cat"], stdin=b"x" * 1000)
    text = str(e.value)
    assert "413" in text and "request body too large" in text and "nothing was taken" in text
    assert "1 MiB" in text and "smaller stdin or file" in text and "transport agent" in text
    modes = [json.loads(seen[3])["argv"][4] for seen in server.seen]
    assert modes.count("run") == 1  # never sent again (then the road drops the job it named)


# -- answers the road cannot use -------------------------------------------------------------
def test_an_exec_answer_without_exit_code_says_what_to_check():
    with pytest.raises(errors.SandboxError) as e:
        api_exec.parse_answer({"stdout": "x", "stderr": ""})
    text = str(e.value)
    assert "without an exit_code" in text and "not re-run" in text and "api_url" in text and "transport agent" in text


@pytest.mark.parametrize("body,error", [
    (b"new payload" + footer(b"other payload"), errors.ChecksumMismatch),
    (b"new payload" + footer(b"new payload")[:-5], errors.GuestUnavailable),
])
def test_a_download_whose_footer_does_not_match_leaves_the_destination_untouched(fake, tmp_path, body, error):
    server, client = fake
    server.answers[("GET", route("/workspace/download"))] = (200, {}, body)
    dest = tmp_path / "dest"
    dest.write_bytes(b"what was there before")
    with pytest.raises(error, match="nothing was written"):
        client.download("/workspace/f", str(dest))
    assert dest.read_bytes() == b"what was there before"
    assert [p.name for p in tmp_path.iterdir()] == ["dest"]  # no partial file left beside it
    assert SID in server.seen[-1][1]
