"""The api road's job script (_guest/api_job.sh) run under /bin/sh on this host, in a temp dir: no plane.

What the road (api_exec.Jobs) relies on: a job that outlives its slice answers `running` and a later `wait`
answers `done`; output past the inline bound stays in the job dir for download (kept=1); `kill` stops the job's
whole process group with rc 143; and the job dirs of a crashed mux are found and removed by the next link's sweep.
"""
import base64
import os
import subprocess
import time

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_exec, run_dirs
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_client import ExecResult
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_exec import STDIN_INLINE, STDIN_NONE

pytestmark = pytest.mark.skipif(not os.path.exists("/bin/sh"), reason="needs /bin/sh")


def script(mode, job, wait, have=(0, 0), args=(), stdin=b"", limit=0):
    """(stdout, stderr before the trailer, the trailer's words) of one run of the job script, as one exec would."""
    proc = subprocess.run(["/bin/sh", "-c", api_exec.JOB_SCRIPT, "sh", mode, str(job), str(wait), str(have[0]),
                           str(have[1]), str(limit)] + list(args), input=stdin, capture_output=True, timeout=60, check=False)
    said = api_exec.trailer(api_exec.Answer(proc.returncode, proc.stdout, proc.stderr, 0, ()))
    assert said is not None, proc
    return proc.stdout, said[1], said[0]


def gone(pid):
    """A process that no longer runs (a zombie nobody reaped counts as gone)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_job_that_outlives_its_slice_answers_running_then_done(tmp_path):
    job = tmp_path / "job"
    out, err, said = script("run", job, 1, args=[STDIN_NONE, "/bin/sh", "-c", "sleep 2; echo late"])
    assert said == ["running", "0", "0", "0"] and out == b"" and err == b""
    assert (job / "pid").exists() and not (job / "rc").exists()
    deadline = time.monotonic() + 30
    while True:
        out, err, said = script("wait", job, 5)
        if said[0] == "done" or time.monotonic() > deadline:
            break
    assert said == ["done", "0", "5", "0", "0"], said
    assert base64.b64decode(out) == b"late\n"
    assert not job.exists()  # sent inline: nothing left to download


def test_stdin_inline_and_a_quick_job_answer_in_one_run(tmp_path):
    job = tmp_path / "job"
    out, err, said = script("run", job, 5, args=[STDIN_INLINE, "/bin/sh", "-c", "cat; echo oops >&2; exit 3"],
                            stdin=b"\x00\xffdata")
    assert said == ["done", "3", "6", "5", "0"]
    assert base64.b64decode(out) == b"\x00\xffdata" and base64.b64decode(err) == b"oops\n"
    assert not job.exists()


def test_output_past_the_inline_bound_is_kept_for_download(tmp_path):
    job = tmp_path / "job"
    size = api_exec.INLINE_MAX + 1
    out, _err, said = script("run", job, 20, args=[STDIN_NONE, "head", "-c", str(size), "/dev/zero"])
    assert said == ["done", "0", str(size), "0", "1"] and out == b""
    assert (job / "out").stat().st_size == size  # left for the road to download, then drop
    _out, _err, said = script("drop", job, 0)
    assert said == ["absent"] and not job.exists()


def test_kill_stops_the_job_and_its_grandchildren(tmp_path):
    job = tmp_path / "job"
    pids = tmp_path / "pids"
    command = 'sh -c "sleep 300" & echo $! >"$1"; sleep 300 & echo $! >>"$1"; wait'
    _out, _err, said = script("run", job, 0, args=[STDIN_NONE, "/bin/sh", "-c", command, "sh", str(pids)])
    assert said[0] == "running"
    deadline = time.monotonic() + 10
    while len(pids.read_text().split()) < 2 if pids.exists() else True:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = [int(p) for p in pids.read_text().split()] + [int((job / "pid").read_text())]
    assert not any(gone(p) for p in started)
    _out, _err, said = script("kill", job, 0)
    assert said[:2] == ["done", "143"], said
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in started):
        assert time.monotonic() < deadline, [p for p in started if not gone(p)]
        time.sleep(0.05)
    _out, _err, said = script("drop", job, 0)
    assert said == ["absent"] and not job.exists()


def test_a_slice_that_ends_at_once_never_leaves_the_exec_waiting_for_the_job(tmp_path):
    """The watcher's signal may come before the script's `wait` begins (a zero slice, a loaded guest): it is sent
    again until the script goes on, so the exec answers `running` instead of waiting for the whole job. Many runs at
    once make the early signal likely (before the fix, a few in a hundred waited out their job)."""
    import concurrent.futures

    def run(i):  # a job that ends by itself a little later: a run that waited for it would answer `done`
        return script("run", tmp_path / ("job%d" % i), 0, args=[STDIN_NONE, "sleep", "5"])[2]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        said = list(pool.map(run, range(96)))
    assert all(words == ["running", "0", "0", "0"] for words in said), [w for w in said if w[0] != "running"]


def test_a_running_job_sends_exactly_the_bytes_its_word_counts_while_its_files_grow(tmp_path):
    """A poll of a job still writing: the output sent is what the word says was read, never the file as it has
    grown since (a stream read whole from its start once sent the grown file)."""
    job = tmp_path / "job"
    writer = "i=0; while [ $i -lt 4000 ]; do echo line-$i-xxxxxxxxxxxxxxxx; echo err-$i >&2; i=$((i + 1)); done"
    _out, _err, said = script("run", job, 0, args=[STDIN_NONE, "/bin/sh", "-c", writer])
    have = [0, 0]
    for _poll in range(200):
        if said[0] == "done":
            break
        out, err, said = script("wait", job, 0, tuple(have))
        if said[0] == "running":
            assert (len(base64.b64decode(out)), len(base64.b64decode(err))) == (int(said[1]) - have[0], int(said[2]) - have[1])
            have = [int(said[1]), int(said[2])]
    script("drop", job, 0)


def state(pid):
    with open("/proc/%d/stat" % pid) as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("limit", [0, 3 * api_exec.BACKLOG])
def test_a_job_runs_ahead_of_the_road_up_to_its_output_limit_then_is_paused(tmp_path, limit):
    """Without a limit a job more than BACKLOG bytes ahead of the road is paused, as a pipe would hold it; with one, not
    before it has written more than the limit (the road then stops it at once, without moving what it wrote): the
    word's last number says what it wrote. Polls that read nothing, as a road would while it waits."""
    job = tmp_path / "job"
    flood = "while :; do head -c 65536 /dev/zero; sleep 0.01; done"  # a few MB/s: a poll sees it pass each bound
    _out, _err, said = script("run", job, 0, args=[STDIN_NONE, "/bin/sh", "-c", flood], limit=limit)
    pid = int((job / "pid").read_text())
    try:
        deadline = time.monotonic() + 30
        while state(pid) != "T":  # each poll pauses it when it may: until then it writes on
            assert time.monotonic() < deadline, said
            _out, _err, said = script("wait", job, 0, limit=limit)
            assert said[0] == "running"
        written = int(script("wait", job, 0, limit=limit)[2][3])
        assert written > max(limit, api_exec.BACKLOG)
        if not limit:
            assert written < 3 * api_exec.BACKLOG  # paused soon after BACKLOG, long before the other case's limit
    finally:
        script("drop", job, 0)


def test_wait_on_a_job_that_is_not_there_answers_absent(tmp_path):
    assert script("wait", tmp_path / "nothing", 0)[2] == ["absent"]


class HostLink:
    """Just what RunDirs' sweep asks of a SessionLink, its guest helpers run by /bin/sh on this host."""

    def __init__(self, scratch):
        self.label = "host"
        self.cfg = type("Cfg", (), {"scratch_dir": str(scratch), "host_tag": "tag"})()

    def guest(self, script_text, *args):
        proc = subprocess.run(["/bin/sh", "-c", script_text, "sh"] + list(args), capture_output=True, timeout=60, check=False)
        assert proc.returncode == 0, proc
        return ExecResult(proc.returncode, stdout=proc.stdout, stderr=proc.stderr)


def test_the_job_dirs_of_a_crashed_mux_are_swept_by_the_next_link(tmp_path):
    """A mux killed with a job running leaves api.<tag>-<pid>-<start>/jobs/<id>: the next link's sweep stops the
    job's processes and removes the dir; the dir of a mux that still runs (this process) is left alone."""
    crashed = tmp_path / ("api.tag-%d-1" % os.getpid())  # our pid with another start time: a mux that is gone
    alive = tmp_path / run_dirs.api_dir_name("tag")
    other = tmp_path / ("api.othertag-%d-1" % os.getpid())  # another controller's: not ours to judge
    job = crashed / "jobs" / "0123abcd"
    _out, _err, said = script("run", job, 0, args=[STDIN_NONE, "sleep", "300"])
    assert said[0] == "running"
    pid = int((job / "pid").read_text())
    (alive / "jobs").mkdir(parents=True)
    other.mkdir()
    run_dirs.RunDirs(HostLink(tmp_path)).sweep_stale("tag")
    assert not crashed.exists() and alive.exists() and other.exists()
    deadline = time.monotonic() + 10
    while not gone(pid):
        assert time.monotonic() < deadline, "the crashed mux's job still runs"
        time.sleep(0.05)
