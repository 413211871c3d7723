"""The api road on the platform's DOCUMENTED exec answer: buffered JSON, 1 MiB per stream, a clamped timeout.

The local plane answers as documented here (no interactive stdin for the team, so no event stream); the road's
client (plugins/plugin_utils/_mux/api_road.py and api_exec.py) must still carry output past the cap whole, and
tasks past the clamp, and a module argument bigger than one request body. The exec clamp is lowered through the
plane's setting (exec_max_timeout) so a task longer than it takes seconds, not minutes.
"""
import hashlib
import os
import time

import pytest
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_road
from test_connection import inventory

from microvm_plane_testing import stop_muxes, team

PREFIX = "/v2/harness-runtime"


@pytest.fixture
def client(plane, sandbox):
    with team(plane, interactive_stdin=False, closed_ports=[8443]):
        c = api_road.ApiRoadClient(plane.url, PREFIX, plane.token, sandbox["session_id"], "box", connect_timeout=30)
        yield c
        c.close()


def run(client, argv, timeout=0, stdin=b""):
    """(exit, stdout, stderr) of one command, collected whole (not the helpers' capped collector)."""
    call, feed = client.exec_stream(argv, timeout=timeout, stdin=stdin)
    out, err = bytearray(), bytearray()
    for kind, data in client.iter_exec(call, feed):
        if kind == "stdout":
            out += data
        elif kind == "stderr":
            err += data
        else:
            return data, bytes(out), bytes(err)
    raise AssertionError("no exit")


def leftovers(client):
    """The job dirs left in the session's scratch dir (every job removes its own)."""
    res = client.jobs.raw(["sh", "-c", "ls -A /workspace/.scratch/.api-jobs 2>/dev/null || :"])
    return res.stdout.split()


def test_output_past_the_cap_arrives_whole(client):
    """3 MB of stdout and 1.5 MB of stderr, each past the answer's 1 MiB, arrive byte for byte; so do bytes the
    answer's text could not carry."""
    script = "head -c 3000000 /dev/urandom | od -An -v -tx1 | head -c 3000000; head -c 1500000 /dev/zero | tr '\\0' e >&2"
    exit_, out, err = run(client, ["sh", "-c", script])
    assert exit_.exit_code == 0 and len(out) == 3000000 and err == b"e" * 1500000
    exit_, out, err = run(client, ["sh", "-c", "printf 'caf\\303\\251\\n'; printf '\\377\\000bin' >&2"])
    assert (out, err) == ("café\n".encode(), b"\xff\x00bin"), "bytes that are not UTF-8 text come exact too"
    assert leftovers(client) == []


def test_a_task_longer_than_the_clamp_runs_to_its_end_and_a_timeout_stops_one(plane, client):
    """With the plane's clamp at 4 s: a 9 s command ends normally, polled; one with a 2 s timeout is stopped then
    (its whole process group: nothing it started runs on)."""
    with team(plane, interactive_stdin=False, closed_ports=[8443], exec_max_timeout=4):
        started = time.monotonic()
        exit_, out, _err = run(client, ["sh", "-c", "sleep 9; echo finished; exit 5"])
        took = time.monotonic() - started
        assert (exit_.exit_code, out, exit_.timed_out) == (5, b"finished\n", False)
        assert took < 30, "polled every few seconds, not once a minute"
        exit_, out, _err = run(client, ["sh", "-c", "echo begun; sleep 4; touch /workspace/after-timeout"], timeout=2)
        assert exit_.timed_out and out == b"begun\n"
        time.sleep(4)
        assert client.jobs.raw(["test", "-e", "/workspace/after-timeout"]).exit_code == 1, "stopped at its timeout"
    assert leftovers(client) == []


def test_a_worker_that_goes_away_stops_its_long_command(plane, client):
    """The mux cancels the call when its worker hangs up (task timeout, ^C): the job is stopped and removed."""
    import threading
    call, feed = client.exec_stream(["sh", "-c", "sleep 8; touch /workspace/should-not-exist"], stdin=b"")
    events = client.iter_exec(call, feed)
    threading.Timer(1.0, call.cancel).start()  # what the mux does when the worker hangs up (exec_ops)
    with pytest.raises(Exception, match="worker went away|cancelled"):
        list(events)
    time.sleep(8)
    assert client.jobs.raw(["test", "-e", "/workspace/should-not-exist"]).exit_code == 1
    assert leftovers(client) == []


MODULE_ARG = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - name: the module's argument is the payload (pipelined on the module's one-shot stdin, staged when too big)
      ansible.builtin.command:
        cmd: sha1sum
        stdin: "{{ lookup('ansible.builtin.file', playbook_dir ~ '/arg.txt') }}"
        stdin_add_newline: false
      register: r
    - ansible.builtin.debug: {msg: "REMOTE={{ r.stdout.split()[0] }}"}
"""


@pytest.mark.parametrize("kib", [400, 3 * 1024])
def test_a_big_module_argument_goes_through_one_shot_stdin(plane, sandbox, tmp_path, playbook_runner, kib):
    """400 KiB and 3 MiB of module argument, inline or staged as its size needs: the module gets it whole."""
    work = tmp_path / "work"
    work.mkdir()
    text = os.urandom(kib * 512).hex()
    (work / "arg.txt").write_text(text)
    env = dict(plane.env, MICROVM_MUX_DIR=str(tmp_path / "mux"), MICROVM_TRANSPORT="api", ANSIBLE_PIPELINING="true")
    try:
        with team(plane, interactive_stdin=False, closed_ports=[8443]):
            res = playbook_runner(MODULE_ARG, inventory({"box": sandbox["session_id"]}), env, workdir=str(work))
    finally:
        stop_muxes(str(tmp_path / "mux"))
    assert res.rc == 0, res
    assert "REMOTE=%s" % hashlib.sha1(text.encode()).hexdigest() in res.stdout, res
