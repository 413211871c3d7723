"""One mux carries every session of its user: what a hostile guest sends through the mux's own paths is bounded.

Real stack: the worker's mux client -> mux -> gRPC -> port-forward -> local plane -> guest agent. Each test asserts a
bound on the mux (its peak RSS, read from /proc), not only that nothing crashed:

- the output of the mux's own helper commands (a run's TMPDIR, staged copies, sweeps) is kept to a few KiB;
- a warm runner that breaks its frame protocol is cut, its task fails naming the limit, the next task gets a new runner;
- a session flooding output does not slow another session's tasks in the same mux.
"""
import base64
import json
import statistics
import time

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import capped, module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from microvm_flood import MIB, SHIM, connect, flooding, reset_peak, run_of, small_tasks, status_kib
from microvm_plane_testing import mux_pids, stop_muxes
from test_connection import new_session
from test_connection_fastpath import make_zip

FLOOD = 48 * MIB            # per stream of the helper: without the cap the mux held both, joined (about 200 MiB)
RSS_BUDGET = 64 * MIB       # the mux's growth through a flood (measured: see the tests' docstrings)


@pytest.fixture
def mux_dir(tmp_path):
    path = str(tmp_path / "mux")
    yield path
    stop_muxes(path)


def mux_pid(mux_dir):
    pids = mux_pids(mux_dir)
    assert len(pids) == 1, pids
    return pids[0]


def test_a_helper_printing_a_flood_costs_the_mux_a_few_kib(plane, sandbox, mux_dir):
    """The guest's chmod prints 48 MB on stdout and 48 MB on stderr each time the mux makes a run's TMPDIR: the task
    still runs, the mux's peak RSS grows by far less than the flood (measured: 12 MiB with the cap, gRPC's own
    receive window; 201 MiB without), and a failing helper's error says its output was cut."""
    client = connect(plane, sandbox["name"], mux_dir)
    try:
        rc, out, err, _info = client.exec(["/bin/sh", "-c", SHIM, "sh", str(FLOOD)])
        assert rc == 0, (out, err)
        assert client.exec(["true"])[0] == 0
        pid = mux_pid(mux_dir)
        reset_peak(pid)
        before = status_kib(pid, "VmRSS")
        run = run_of("flood")
        started = time.monotonic()
        rc, out, _err, _info = client.exec(["ls", "-ld", run["dir"]], run=run)
        took = time.monotonic() - started
        print("helper flood of 2 x %d MiB: %.1f s" % (FLOOD // MIB, took))
        grown = (status_kib(pid, "VmHWM") - before) * 1024
        assert rc == 0 and b"drwxrwxrwt" in out, out  # made and chmod-ed by the real chmod after the flood
        print("mux RSS %d MiB, grew by %.1f MiB" % (before // 1024, grown / MIB))
        assert grown < RSS_BUDGET, "the mux grew by %d MiB through a helper's flood" % (grown // MIB)

        # a failing helper: its message is the first KiB of its stderr, marked as cut
        client.exec(["/bin/sh", "-c", SHIM + "touch /tmp/chmod.fail", "sh", str(MIB)])
        with pytest.raises(errors.SandboxError) as e:
            client.exec(["true"], run=run_of("fail"))
        assert capped.CUT_NOTE in str(e.value) and len(str(e.value)) < 3 * capped.HELPER_OUTPUT_LIMIT, str(e.value)[:300]
    finally:
        client.close()


# A module that writes a forged frame into its runner's protocol pipe: a header announcing 4 GiB, then 8 MiB of it.
FORGE = r'''
_ANSIBALLZ_WRAPPER = True
import json, os, struct, sys
runner = os.getppid()
if os.environ.get("FORGE"):
    fds = "/proc/%d/fd" % runner
    target = None
    for name in sorted(os.listdir(fds), key=int):
        with open("/proc/%d/fdinfo/%s" % (runner, name)) as info:
            flags = int(next(line for line in info if line.startswith("flags:")).split()[1], 8)
        link = os.readlink(os.path.join(fds, name))
        if int(name) > 2 and flags & 3 == 1 and link.startswith("pipe:") and link != os.readlink(fds + "/1"):
            target = os.path.join(fds, name)   # write-only, and not the runner's stderr: its protocol pipe
    with open(target, "wb") as pipe:
        pipe.write(struct.pack("!IIB", 0xFFFFFFF0, 1, 12) + b"x" * (8 << 20))
print(json.dumps({"runner": runner}))
'''


def forge_payload():
    zip_data = base64.b64encode(make_zip("X = 1\n")).decode()
    return ("ARGS = dict(\nzip_data='%s',\n)\n" % zip_data + FORGE).encode()


def test_a_forged_runner_frame_fails_its_task_and_the_next_gets_a_new_runner(plane, sandbox, mux_dir):
    """A module writes a frame header announcing 4 GiB into its warm runner's protocol pipe, then 8 MiB: the task
    fails naming the frame limit, the mux grows by little (it never buffers past the header), and the next task on
    the session runs in a new runner."""
    client = connect(plane, sandbox["name"], mux_dir)
    try:
        payload = forge_payload()
        rc, out, err, info = client.warm("/usr/bin/python3", {}, payload)
        assert rc == 0 and info.get("warm"), (out, err)
        first = json.loads(out)["runner"]
        pid = mux_pid(mux_dir)
        reset_peak(pid)
        before = status_kib(pid, "VmRSS")
        with pytest.raises(errors.CommandLost) as e:
            client.warm("/usr/bin/python3", {"FORGE": "1"}, payload)
        grown = (status_kib(pid, "VmHWM") - before) * 1024
        print("forged frame: mux RSS %d MiB, grew by %.1f MiB" % (before // 1024, grown / MIB))
        assert "past the %d bytes" % module_runners.FRAME_MAX in str(e.value) and "warm_runner" in str(e.value), e.value
        assert grown < 32 * MIB, "the mux grew by %d MiB through a forged frame" % (grown // MIB)
        rc, out, err, info = client.warm("/usr/bin/python3", {}, payload)
        assert rc == 0 and info.get("warm"), (out, err)
        assert json.loads(out)["runner"] != first  # a new runner: the broken one was cut
    finally:
        client.close()


@pytest.fixture
def other(plane):
    """A second READY session, deleted after the test."""
    session = new_session(plane, "fair-b")
    yield session
    try:
        plane.client().delete_session(session["session_id"])
    except Exception:  # already gone
        pass


@pytest.mark.serial  # a ratio of timings: other workers' load would blur it
def test_a_flooding_session_does_not_slow_another_in_the_same_mux(plane, sandbox, other, mux_dir, tmp_path):
    """Session b runs small commands while session a floods (its output streamed, its helpers' output drained), from a
    mux of its own and then from b's mux. Sharing the mux costs b's median command at most 3.5x what the same flood
    costs it from another process, and the mux's peak RSS grows by less than its budget.

    Not `b alone` as the reference: on a 2-core machine the flood's other processes (the guest's head, the plane's
    relay, the reading worker) slow b 1.5-4.4x even when a is in another mux. Sharing the mux measured 0.8-1.8x that
    (1.3-3.1x before the mux's GIL switch interval was shortened while requests compete, _mux/switch_interval.py). 1.5x is within the noise
    of a loaded 2-core machine, so the bound keeps a 2x margin over the worst measured: it catches one session stalling
    another, not jitter."""
    client = connect(plane, other["name"], mux_dir)
    apart = str(tmp_path / "apart")
    try:
        assert client.exec(["/bin/sh", "-c", SHIM, "sh", str(16 * MIB)])[0] == 0  # b's guest; a's below
        assert client.exec(["true"], run=run_of("b"))[0] == 0
        pid = mux_pid(mux_dir)
        small_tasks(client, 3)  # warm: the link, the channel
        alone = statistics.median(small_tasks(client, 15))
        with_a = connect(plane, sandbox["name"], mux_dir)
        assert with_a.exec(["/bin/sh", "-c", SHIM, "sh", str(16 * MIB)])[0] == 0 and mux_pids(mux_dir) == [pid]
        with_a.close()
        elsewhere = flooding(plane, sandbox["name"], apart, lambda: statistics.median(small_tasks(client, 15)))
        reset_peak(pid)
        before = status_kib(pid, "VmRSS")
        shared = flooding(plane, sandbox["name"], mux_dir, lambda: statistics.median(small_tasks(client, 15)))
        grown = (status_kib(pid, "VmHWM") - before) * 1024
        print("b alone %.1f ms; during a's flood from another mux %.1f ms, from b's mux %.1f ms (x%.2f); mux grew by %.1f MiB"
              % (alone * 1000, elsewhere * 1000, shared * 1000, shared / elsewhere, grown / MIB))
        assert shared <= 3.5 * elsewhere, "b's commands took %.1f ms with a flooding in its mux, %.1f ms with a elsewhere" % (
            shared * 1000, elsewhere * 1000)
        assert grown < 2 * RSS_BUDGET, "the mux grew by %d MiB through a's flood" % (grown // MIB)
    finally:
        client.close()
        stop_muxes(apart)
