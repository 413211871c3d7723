"""Transfer bench (not a test): a big file in and out of one session, then to and from several sessions at once.

Through the plugin's transfer path (MuxClient.put / fetch, the shared mux), on its own local plane:
1. SIZE MiB copied in and out of one session REPEAT times (median),
2. the same file copied to SESSIONS sessions at once, then back from all at once,
and the aggregate throughput of 2. over 1. (the shared mux must not serialize sessions on one core).
Records the mux processes' memory, the machine's load, and how many of the machine's cores were busy during
one copy and during the concurrent ones (from /proc/stat): when one copy already keeps most cores busy (the
byte path runs through the mux, the plane's port-forward and the guest's agent), the machine itself bounds
what concurrency can add, and the bench prints that bound (cores / cores busy for one copy) beside the ratio.
It also records the CPU each mux process used during the concurrent copies: a mux at one full core while
the machine has idle cores would be the GIL serializing sessions. Writes bench/results/transfer.json.

Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/transfer_bench.py [--size-mib 256] [--sessions 4]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import ROOT

from microvm_plane_testing import mux_pids, start_local_plane, stop_local_plane, stop_muxes

from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import DEFAULT_POOL_SIZE, LinkConfig


def rss_kib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            return int(f.read().split("VmRSS:")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return 0


def busy_jiffies():
    """(busy, total) jiffies of the whole machine so far."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def cpu_jiffies(pid):
    """utime + stime of one process (its threads included)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


class Cores:
    """Cores of the machine busy, on average, between start() and stop()."""

    def start(self):
        self.t0, self.j0 = time.perf_counter(), busy_jiffies()[0]

    def stop(self):
        wall = time.perf_counter() - self.t0
        return (busy_jiffies()[0] - self.j0) / float(os.sysconf("SC_CLK_TCK")) / wall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pool", type=int, default=DEFAULT_POOL_SIZE, help="mux processes (option mux_processes)")
    ap.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "transfer.json"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="transfer-bench-")
    os.makedirs(os.path.join(tmp, "plane"))
    mux_dir = os.path.join(tmp, "mux")
    plane = start_local_plane(os.path.join(tmp, "plane"))
    result = {"size_mib": args.size_mib, "sessions": args.sessions, "pool": args.pool, "cpus": os.cpu_count(),
              "load_at_start": os.getloadavg()}
    try:
        client = plane.client()
        ids = [client.create_session({"name": "xfer-%d" % i, "agent": "custom"})["session_id"] for i in range(args.sessions)]
        for sid in ids:
            client.wait_session(sid, timeout=300)
        big = os.path.join(tmp, "big.bin")
        with open(big, "wb") as f:
            for _dummy in range(args.size_mib):
                f.write(os.urandom(1 << 20))
        muxes = [MuxClient(mux_dir, LinkConfig(session=sid, token=plane.token, api_url=plane.url, persist=300,
                                               transport="agent"),
                           pool_size=args.pool).connect() for sid in ids]
        result["slots"] = [m.slot for m in muxes]
        runs = {"in": [], "out": []}
        busy = {"in": [], "out": []}
        cores = Cores()
        for _dummy in range(args.repeat):
            start = time.perf_counter()
            cores.start()
            muxes[0].put(big, "/workspace/big.bin")
            busy["in"].append(cores.stop())
            runs["in"].append(time.perf_counter() - start)
            start = time.perf_counter()
            cores.start()
            muxes[0].fetch("/workspace/big.bin", os.path.join(tmp, "back-0"))
            busy["out"].append(cores.stop())
            runs["out"].append(time.perf_counter() - start)
        one = {d: args.size_mib / statistics.median(v) for d, v in runs.items()}
        one_busy = {d: statistics.median(v) for d, v in busy.items()}
        together = {}
        together_busy = {}
        mux_cores = {}
        hz = float(os.sysconf("SC_CLK_TCK"))
        for direction in ("in", "out"):
            def copy(i, direction=direction):
                if direction == "in":
                    muxes[i].put(big, "/workspace/big.bin")
                else:
                    muxes[i].fetch("/workspace/big.bin", os.path.join(tmp, "back-%d" % i))
            threads = [threading.Thread(target=copy, args=(i,)) for i in range(args.sessions)]
            before = {p: cpu_jiffies(p) for p in mux_pids(mux_dir)}
            start = time.perf_counter()
            cores.start()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            together_busy[direction] = cores.stop()
            wall = time.perf_counter() - start
            together[direction] = args.sessions * args.size_mib / wall
            mux_cores[direction] = sorted((round((cpu_jiffies(p) - j) / hz / wall, 2) for p, j in before.items()),
                                          reverse=True)
        for i in range(args.sessions):
            if os.path.getsize(os.path.join(tmp, "back-%d" % i)) != args.size_mib << 20:
                raise RuntimeError("back-%d has the wrong size" % i)
        pids = mux_pids(mux_dir)
        result.update({"one_session_mib_s": one, "runs_seconds": runs, "concurrent_mib_s": together,
                       "concurrent_over_one": {d: together[d] / one[d] for d in one},
                       "cores_busy_one": one_busy, "cores_busy_concurrent": together_busy,
                       "bound_from_cores": {d: os.cpu_count() / one_busy[d] for d in one},
                       "mux_cores_concurrent": mux_cores,
                       "muxes": len(pids), "muxes_rss_kib": sum(rss_kib(p) for p in pids),
                       "load_at_end": os.getloadavg(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        for m in muxes:
            m.close()
    finally:
        stop_muxes(mux_dir)
        stop_local_plane(plane)
        shutil.rmtree(tmp, ignore_errors=True)
    benchlib.print_rows([
        ("one session, %d MiB in / out" % args.size_mib, "%.0f / %.0f MiB/s" % (one["in"], one["out"])),
        ("%d sessions at once, in / out" % args.sessions, "%.0f / %.0f MiB/s aggregate" % (together["in"], together["out"])),
        ("aggregate over one, in / out",
         "%.2fx / %.2fx" % (result["concurrent_over_one"]["in"], result["concurrent_over_one"]["out"])),
        ("cores busy: one copy / concurrent, in", "%.2f / %.2f of %d" % (
            result["cores_busy_one"]["in"], result["cores_busy_concurrent"]["in"], os.cpu_count())),
        ("cores busy: one copy / concurrent, out", "%.2f / %.2f of %d" % (
            result["cores_busy_one"]["out"], result["cores_busy_concurrent"]["out"], os.cpu_count())),
        ("bound from cores (cores / busy for one), in / out",
         "%.2fx / %.2fx" % (result["bound_from_cores"]["in"], result["bound_from_cores"]["out"])),
        ("each mux's cores during the concurrent copies, in / out",
         "%s / %s" % (result["mux_cores_concurrent"]["in"], result["mux_cores_concurrent"]["out"])),
        ("mux processes (pool %d), RSS" % args.pool, "%d, %.0f MiB" % (result["muxes"], result["muxes_rss_kib"] / 1024)),
        ("load average at start / end", "%.1f / %.1f" % (result["load_at_start"][0], result["load_at_end"][0])),
    ])
    print("wrote %s" % benchlib.save_json(args.output, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
