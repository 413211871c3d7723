"""A guest flooding the mux's paths, for tests/integration/test_hostile_mux.py and bench/fairness_bench.py.

A session's output streamed as a worker reads it (and drops it), the guest's chmod replaced by one that prints a
flood before doing its job (the mux calls it for a run's TMPDIR), and the mux's RSS read from /proc.
"""
import os
import threading
import time

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient

MIB = 1024 * 1024


def connect(plane, session, mux_dir):
    """A worker's mux client for session, in the one mux process of mux_dir (pool of one)."""
    cfg = LinkConfig(session=session, token=plane.token, api_url=plane.url, persist=30, transport="agent")
    return MuxClient(mux_dir, cfg, pool_size=1).connect()


def status_kib(pid, field):
    with open("/proc/%d/status" % pid) as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak(pid):
    """Start VmHWM afresh from the current RSS (Linux: clear_refs 5), so the peak is the flood's."""
    with open("/proc/%d/clear_refs" % pid, "w") as f:
        f.write("5")


def run_of(tag):
    """A run (as the worker names one) the mux has not seen: its first command makes its TMPDIR (mkdir, chmod)."""
    rid = "%s-%d-%d" % (tag, os.getpid(), time.monotonic_ns())
    return {"id": rid, "pid": os.getpid(), "start": "0", "dir": "/workspace/.scratch/run.%s" % rid}


# The guest's chmod (which the mux's run TMPDIR helper calls) prints a flood on both streams, then does its job.
SHIM = r'''
set -e
real=$(command -v chmod)
[ -e "$real.real" ] || cp "$real" "$real.real"
cat > /tmp/chmod.shim <<EOF
#!/bin/sh
head -c $1 /dev/zero | tr '\0' o
head -c $1 /dev/zero | tr '\0' e >&2
[ -e /tmp/chmod.fail ] && exit 1
exec $real.real "\$@"
EOF
$real.real 755 /tmp/chmod.shim
mv -f /tmp/chmod.shim "$real"
'''


def stream_and_drop(client, argv, progress):
    """Run a command through the mux's exec op as a worker does, counting its output into progress[0] and keeping none."""
    sock = client.connect()._socket()
    mp.send_frame(sock, mp.REQUEST, {"op": "exec", "argv": argv, "env": {}, "workdir": "", "timeout": 0, "run": None})
    mp.send_frame(sock, mp.STDIN_EOF)
    for kind, payload in client._frames(sock):
        if kind in (mp.STDOUT, mp.STDERR):
            progress[0] += len(payload)
        elif kind == mp.EXIT:
            return
        else:
            raise AssertionError("frame %d: %r" % (kind, payload))


def small_tasks(client, count):
    """Seconds each of `count` small commands takes, one after the other."""
    took = []
    for _dummy in range(count):
        start = time.monotonic()
        assert client.exec(["true"])[0] == 0
        took.append(time.monotonic() - start)
    return took


def flooding(plane, session, mux_dir, measure):
    """measure() while session streams 100 MB commands one after the other (its worker reading and dropping the
    output) and its guest's chmod prints 2 x 16 MB each time the mux makes a run's TMPDIR there -> what it returns."""
    flooder, helpers = connect(plane, session, mux_dir), connect(plane, session, mux_dir)
    stop = threading.Event()
    streamed, helped = [0], [0]

    def flood_output():
        while not stop.is_set():
            stream_and_drop(flooder, ["head", "-c", "100000000", "/dev/zero"], streamed)

    def flood_helpers():
        while not stop.is_set():
            assert helpers.exec(["true"], run=run_of("fair"))[0] == 0
            helped[0] += 1

    threads = [threading.Thread(target=flood_output, daemon=True), threading.Thread(target=flood_helpers, daemon=True)]
    try:
        for t in threads:
            t.start()
        while streamed[0] < 4 * MIB:  # the flood is flowing
            time.sleep(0.01)
        result = measure()
        flowing = streamed[0]
        stop.set()
        for t in threads:
            t.join(60)
        assert streamed[0] > flowing and helped[0] >= 1, (streamed, helped)  # both floods went on throughout
        return result
    finally:
        stop.set()
        flooder.close()
        helpers.close()
