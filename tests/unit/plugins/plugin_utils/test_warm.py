"""The mux's side of the warm runner: a zip the runner holds is sent by reference, a MISS gets it whole."""
import base64
import json
import struct
import time

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr
from microvm_warm_testing import fed_runner


def module_payload(zip_bytes=b"PK-not-really-a-zip", params="{}"):
    return ("_ANSIBALLZ_WRAPPER = True\n_ansiballz_main(\nzip_data='%s',\nparams=%r,\n)\n"
            % (base64.b64encode(zip_bytes).decode(), params)).encode()


def sent(r):
    frame = r.feed.get_nowait()
    length, rid, kind = wr.HEADER.unpack_from(frame)
    body = frame[wr.HEADER.size:]
    assert len(body) == length
    jlen = struct.unpack("!I", body[:4])[0]
    return rid, kind, json.loads(body[4:4 + jlen]), body[4 + jlen:]


def test_whole_until_started_then_by_reference():
    r = fed_runner()
    data = module_payload()
    rid, events = r.submit({"A": "1"}, data)
    assert sent(r) == (rid, wr.RUN, {"env": {"A": "1"}}, data)
    r._dispatch(rid, wr.STARTED, b"")
    assert events.get_nowait() == ("started", None)

    data2 = module_payload(params='{"x": 2}')  # same zip, other parameters
    rid2, dummy = r.submit({}, data2)
    rid_seen, kind, meta, rest = sent(r)
    source, zip_b64 = wr.split_payload(data2, module_runners.CORE)
    assert (rid_seen, kind, meta, rest) == (rid2, wr.RUNREF, {"env": {}, "zip": wr.zip_key(zip_b64)}, source)
    assert zip_b64.encode() not in rest

    # the runner dropped it meanwhile: it gets the whole payload under the same request id
    r._dispatch(rid2, wr.MISS, b"")
    assert sent(r) == (rid2, wr.RUN, {"env": {}}, data2)
    assert wr.zip_key(zip_b64) not in r.held


def test_refused_or_non_module_payloads_are_never_referenced():
    r = fed_runner()
    data = module_payload(b"other zip")
    rid, dummy = r.submit({}, data)
    sent(r)
    r._dispatch(rid, wr.REFUSE, json.dumps({"reason": "differs"}).encode())
    rid2, dummy = r.submit({}, data)
    assert sent(r)[1] == wr.RUN  # a refused zip is not held by the runner

    rid3, dummy = r.submit({}, b"print('raw')")
    assert sent(r)[1] == wr.RUN
    r._dispatch(rid3, wr.STARTED, b"")
    assert r.held == set()


def test_the_preload_dirs_of_dead_runners_are_swept_at_start(tmp_path):
    import os
    import subprocess
    import sys
    gone = subprocess.Popen(["true"])
    gone.wait()
    runner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", wr.MARKER])
    other = subprocess.Popen(["sleep", "60"])  # alive, but not a runner (a reused pid)
    # Popen returns once exec began; the kernel sets the new command line a moment later, so wait for it
    for _attempt in range(500):
        if wr.runner_alive(runner.pid):
            break
        time.sleep(0.01)
    try:
        names = {"dead": "microvm-warm-%d-a1" % gone.pid, "live": "microvm-warm-%d-b2" % runner.pid,
                 "reused": "microvm-warm-%d-c3" % other.pid, "own": "microvm-warm-%d-d4" % os.getpid(),
                 "unrelated": "microvm-warmth", "legacy": "microvm-warm-q8x_z2"}
        for name in names.values():
            (tmp_path / name).mkdir()
        (tmp_path / names["dead"] / "preload.zip").write_bytes(b"zip")
        wr.sweep_stale_dirs(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            names[k] for k in ("live", "own", "unrelated", "legacy"))
    finally:
        runner.kill()
        other.kill()


def test_the_runner_keeps_its_files_under_the_scratch_dir_not_tmp(tmp_path):
    """Issue 42: nothing of the collection's in a guest's /tmp (a checkpoint or a fork would keep it)."""
    argv = module_runners.runner_argv("/usr/bin/python3", module_runners.runner_work_root("/workspace/.scratch"))
    assert argv[-1] == "/workspace/.scratch/warm-runners" and '"$4"' in argv[2]
    root = tmp_path / "scratch" / "warm-runners"
    assert wr.work_root_of(["-c", "src", "cfg", str(root)]) == str(root) and root.is_dir()
    assert oct(root.stat().st_mode & 0o777) == "0o700"
    assert wr.work_root_of(["-c", "src", "cfg"]) is None
    assert wr.work_root_of(["-c", "src", "cfg", "relative/dir"]) is None
