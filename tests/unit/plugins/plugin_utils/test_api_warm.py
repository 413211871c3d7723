"""The api road's warm runner on this host, no plane: module_runner.py in socket mode (as the api road starts it
in a guest, detached) and _guest/warm_client.py, the program each task's buffered exec runs, answering like the
job script (api_exec.trailer).

The whole road through the real stack is tests/integration/test_connection_fastpath.py with MICROVM_TEST_TRANSPORT=api.
"""
import base64
import io
import json
import os
import struct
import subprocess
import sys
import time
import zipfile

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import source_of
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import warm_client as wc
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_exec, module_runners

PAYLOAD = r'''
_ANSIBALLZ_WRAPPER = True
import os, sys, time
print("pid %d" % os.getpid())
sys.stdout.flush()
if os.environ.get("ACTION") == "sleep":
    time.sleep(float(os.environ.get("SECONDS_", "60")))
if os.environ.get("ACTION") == "big":
    sys.stdout.write("x" * int(os.environ["SIZE"]))
'''


def payload():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in ("ansible/__init__.py", "ansible/module_utils/__init__.py", "ansible/modules/__init__.py",
                     "ansible/module_utils/_internal/__init__.py", "ansible/module_utils/_internal/_ansiballz/__init__.py",
                     "ansible/module_utils/_internal/_ansiballz/_loader.py", "ansible/module_utils/basic.py"):
            z.writestr(name, "")
    return ("ARGS = dict(\nzip_data='%s',\n)\n" % base64.b64encode(buf.getvalue()).decode() + PAYLOAD).encode()


def run_frame(rid, env):
    meta = json.dumps({"env": env}).encode()
    body = struct.pack("!I", len(meta)) + meta + payload()
    return wr.HEADER.pack(len(body), rid, wr.RUN) + body


def frames_of(data):
    out, pos = [], 0
    while pos < len(data):
        length, rid, kind = wr.HEADER.unpack_from(data, pos)
        out.append((rid, kind, data[pos + wr.HEADER.size:pos + wr.HEADER.size + length]))
        pos += wr.HEADER.size + length
    return out


@pytest.fixture
def runner(tmp_path):
    """A socket-mode runner in tmp_path/warm, started as the api road starts it (its own session, detached)."""
    work = tmp_path / "warm"
    work.mkdir(mode=0o700)
    sock = str(work / "sock")
    argv = module_runners.runner_python_argv(sys.executable, str(work)) + [sock]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=str(tmp_path), env={"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 20
    while not os.path.exists(sock):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
        time.sleep(0.02)
    yield proc, sock, tmp_path
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def client(sock, job, frames, slice_s=20, inline=api_exec.INLINE_MAX, wait=0):
    """(rc, stdout, stderr before the trailer, the trailer's words) of one warm client exec."""
    argv = [sys.executable, "-I", "-S", "-c", source_of(wc), sock, str(job), str(slice_s), str(inline),
            api_exec.TRAILER.decode()] + (["%g" % wait] if wait else [])
    proc = subprocess.run(argv, input=frames, capture_output=True, timeout=60, check=False)
    said = api_exec.trailer(api_exec.Answer(proc.returncode, proc.stdout, proc.stderr, 0, ()))
    return proc.returncode, proc.stdout, (said[1] if said else proc.stderr), (said[0] if said else None)


def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_one_exec_brings_a_module_s_whole_answer_inline(runner):
    _proc, sock, tmp = runner
    rc, out, _err, said = client(sock, tmp / "jobs" / "a", run_frame(7, {}))
    assert rc == 0 and said[:1] == ["done"], (rc, _err)
    got = frames_of(base64.b64decode(out))
    assert int(said[2]) == len(base64.b64decode(out))
    assert [k for _r, k, _b in got][0] == wr.READY and got[-1][:2] == (7, wr.EXIT)  # the client's id, not the runner's
    assert json.loads(got[-1][2]) == {"rc": 0}
    assert b"".join(b for r, k, b in got if k == wr.OUT).startswith(b"pid ")
    assert not (tmp / "jobs" / "a").exists()  # nothing left: no job dir for a quick answer
    # the next task's exec: the same runner (its module_utils stay loaded), a new connection
    rc, out, _err, said = client(sock, tmp / "jobs" / "b", run_frame(7, {}))
    assert said[:1] == ["done"] and frames_of(base64.b64decode(out))[-1][1] == wr.EXIT


def test_a_module_past_the_slice_is_handed_to_a_keeper_the_job_script_follows(runner):
    _proc, sock, tmp = runner
    job = tmp / "jobs" / "slow"
    rc, out, _err, said = client(sock, job, run_frame(3, {"ACTION": "sleep", "SECONDS_": "2"}), slice_s=0.5)
    assert rc == 0 and said == ["running", "0", "0"] and out == b""
    deadline = time.monotonic() + 30
    while True:  # as the road polls it: the job script's `wait`
        proc = subprocess.run(["/bin/sh", "-c", api_exec.JOB_SCRIPT, "sh", "wait", str(job), "5", "0", "0", "0"],
                              capture_output=True, timeout=60, check=False)
        words = api_exec.trailer(api_exec.Answer(0, proc.stdout, proc.stderr, 0, ()))[0]
        if words[0] == "done" or time.monotonic() > deadline:
            break
    assert words[:2] == ["done", "0"], words
    got = frames_of(base64.b64decode(proc.stdout))
    assert got[-1][:2] == (3, wr.EXIT) and json.loads(got[-1][2]) == {"rc": 0}


def test_an_answer_past_the_inline_bound_is_kept_for_download(runner):
    _proc, sock, tmp = runner
    job = tmp / "jobs" / "big"
    rc, _out, _err, said = client(sock, job, run_frame(4, {"ACTION": "big", "SIZE": "300000"}), inline=100000)
    assert rc == 0 and said == ["running", "0", "0"]
    deadline = time.monotonic() + 30
    while not (job / "rc").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    got = frames_of((job / "out").read_bytes())
    assert got[-1][:2] == (4, wr.EXIT) and sum(len(b) for _r, k, b in got if k == wr.OUT) > 300000


def test_killing_the_client_s_process_group_stops_the_module(runner):
    """The road's kill (the job script's, on the pid the client wrote) closes the connection: the runner kills the
    module it started for it."""
    _proc, sock, tmp = runner
    job = tmp / "jobs" / "k"
    rc, _out, _err, said = client(sock, job, run_frame(5, {"ACTION": "sleep"}), slice_s=0.5)
    assert said == ["running", "0", "0"]
    deadline = time.monotonic() + 10
    while b"pid " not in ((job / "out").read_bytes() if (job / "out").exists() else b""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    module = int([b for _r, k, b in frames_of((job / "out").read_bytes()) if k == wr.OUT][0].split()[1])
    assert alive(module)
    proc = subprocess.run(["/bin/sh", "-c", api_exec.JOB_SCRIPT, "sh", "kill", str(job), "0", "0", "0", "0"],
                          capture_output=True, timeout=60, check=False)
    assert api_exec.trailer(api_exec.Answer(0, proc.stdout, proc.stderr, 0, ()))[0][:2] == ["done", "143"]
    deadline = time.monotonic() + 10
    while alive(module):
        assert time.monotonic() < deadline, "the module outlived its client"
        time.sleep(0.05)


def test_no_runner_at_the_socket_is_exit_code_3_and_nothing_left(tmp_path):
    rc, out, err, said = client(str(tmp_path / "nothing" / "sock"), tmp_path / "jobs" / "x", run_frame(1, {}))
    assert rc == wc.NO_RUNNER and said is None and b"no warm runner" in err and out == b""
    assert not (tmp_path / "jobs" / "x").exists()


def test_the_runner_stops_once_its_socket_file_is_removed(runner):
    proc, sock, _tmp = runner
    os.unlink(sock)
    assert proc.wait(timeout=20) == 0


# -- the mux's side (module_runners.ApiModuleRunner) with a stand-in road: one layer ----------------------------

class FakeJobs:
    """Answers each exec's frames as a runner would (READY first), or as `script` says for the next exec."""

    def __init__(self):
        self.execs = []
        self.script = []  # per exec: a function (frames) -> the frames to answer

    def run(self, call, frames, start=None):
        self.execs.append(wr.HEADER.unpack_from(frames)[2] if frames else None)
        answer = self.script.pop(0)(frames) if self.script else self.runner(frames)
        yield "stdout", answer
        yield "exit", None

    @staticmethod
    def frame(rid, kind, body=b""):
        return wr.HEADER.pack(len(body), rid, kind) + body

    def runner(self, frames):
        ready = self.frame(0, wr.READY, json.dumps({"python": "3", "pid": 1}).encode())
        if not frames:
            return ready
        _length, rid, kind = wr.HEADER.unpack_from(frames)
        if kind == wr.RUNREF:
            return ready + self.frame(rid, wr.MISS)
        return ready + self.frame(rid, wr.STARTED) + self.frame(rid, wr.OUT, b"out") + self.frame(rid, wr.EXIT, b'{"rc": 0}')


class FakeClient:
    label = "box"
    api_dir = "/scratch/api.x-1-1"

    def __init__(self):
        self.jobs = FakeJobs()


def events_of(q):
    got = []
    while True:
        kind, data = q.get(timeout=10)
        got.append((kind, data))
        if kind in ("exit", "refuse", "dead", "done"):
            return got


def test_a_runner_that_dropped_a_held_zip_gets_the_whole_payload_on_a_new_exec():
    client = FakeClient()
    runner = module_runners.ApiModuleRunners(client).get("/usr/bin/python3")
    data = payload()
    _rid, q = runner.submit({}, data)
    assert events_of(q)[-1] == ("exit", 0)
    _rid, q = runner.submit({}, data)  # its zip is held now: sent by reference, answered MISS, then whole
    assert events_of(q) == [("started", None), ("stdout", b"out"), ("exit", 0)]
    assert client.jobs.execs == [None, wr.RUN, wr.RUNREF, wr.RUN] and runner.alive


def test_an_answer_that_ends_before_the_last_frame_is_a_lost_runner():
    client = FakeClient()
    runner = module_runners.ApiModuleRunners(client).get("/usr/bin/python3")
    client.jobs.script.append(lambda frames: FakeJobs.frame(0, wr.READY, b"{}") + FakeJobs.frame(1, wr.STARTED))
    _rid, q = runner.submit({}, payload())
    got = events_of(q)
    assert got[0] == ("started", None) and got[-1][0] == "dead" and not runner.alive


def test_a_hostile_frame_ends_the_runner_and_the_task_is_lost_not_hung():
    client = FakeClient()
    runner = module_runners.ApiModuleRunners(client).get("/usr/bin/python3")
    client.jobs.script.append(lambda frames: wr.HEADER.pack(module_runners.FRAME_MAX + 1, 1, wr.OUT))
    _rid, q = runner.submit({}, payload())
    got = events_of(q)
    assert got[-1][0] == "dead" and "frame of" in got[-1][1] and not runner.alive


def test_the_warm_clients_frame_constants_are_the_runners():
    """warm_client.py runs alone in the guest (stdlib only, no import of ours), so it carries its own copy of the
    runner's frame header and kinds: kept in step here."""
    assert wc.HEADER.format == wr.HEADER.format
    assert (wc.READY, wc.LAST) == (wr.READY, wr.LAST)
    assert wc.ASKS == (wr.RUN, wr.RUNREF, wr.TMP)
