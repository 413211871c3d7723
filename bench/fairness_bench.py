"""One mux, several sessions, one of them hostile (not a timed test): what a flood costs the mux and its neighbours.

Session b runs small commands (`true`) in the mux; session a floods: 100 MB commands streamed one after the other
(the worker reading and dropping the output) while its guest's chmod prints 2 x 16 MB each time the mux makes a
run's TMPDIR there (the mux's own helper). Reported: b's median command alone, with a flooding from a mux of its
own (the machine's load only), and with a flooding in b's mux (the ratio is what sharing the mux costs); and the
mux's peak RSS (VmHWM) before and during the flood, per session it carries.

With --switch-interval SECONDS the muxes run with their GIL switch interval fixed (MICROVM_MUX_SWITCH_INTERVAL,
see _mux/switch_interval.py: 0.0005 was the rule before issue 45, 0.005 is Python's default); without it, the mux's
own rule (short only while requests compete).

Writes bench/results/fairness.json (fairness-<SECONDS>.json with --switch-interval).
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/fairness_bench.py [--repeat 3]
       [--switch-interval 0.005]
"""
import argparse
import os
import statistics

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import ROOT

from microvm_flood import MIB, SHIM, connect, flooding, reset_peak, small_tasks, status_kib
from microvm_plane_testing import mux_pids, stop_muxes
from stage import Stage

TASKS = 15


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--switch-interval", help="the muxes' fixed GIL switch interval, in seconds")
    parser.add_argument("--output")
    args = parser.parse_args()
    if args.switch_interval:  # the muxes are started from this process: they inherit it
        os.environ["MICROVM_MUX_SWITCH_INTERVAL"] = args.switch_interval
    args.output = args.output or os.path.join(ROOT, "bench", "results", "fairness%s.json" % (
        "-" + args.switch_interval if args.switch_interval else ""))

    stage = Stage("fairbench")
    apart = os.path.join(stage.tmp, "apart")
    client = flood_client = None
    try:
        plane, quiet = stage.plane, stage.session
        api = plane.client()
        loud = api.wait_session(api.create_session({"name": "fairbench-a", "agent": "custom"})["session_id"], timeout=120)
        client = connect(plane, quiet["name"], stage.mux_dir)
        flood_client = connect(plane, loud["name"], stage.mux_dir)
        assert flood_client.exec(["/bin/sh", "-c", SHIM, "sh", str(16 * MIB)])[0] == 0
        (pid,) = mux_pids(stage.mux_dir)
        small_tasks(client, 3)
        idle_kib = status_kib(pid, "VmRSS")
        alone, elsewhere, shared, peaks = [], [], [], []
        for _dummy in range(args.repeat):
            alone.append(statistics.median(small_tasks(client, TASKS)))
            elsewhere.append(flooding(plane, loud["name"], apart, lambda: statistics.median(small_tasks(client, TASKS))))
            reset_peak(pid)
            shared.append(flooding(plane, loud["name"], stage.mux_dir, lambda: statistics.median(small_tasks(client, TASKS))))
            peaks.append(status_kib(pid, "VmHWM"))
        result = {
            "sessions_in_mux": 2, "switch_interval": args.switch_interval or "adaptive",
            "b_median_ms": {"alone": statistics.median(alone) * 1000, "a_flooding_elsewhere": statistics.median(elsewhere) * 1000,
                            "a_flooding_in_the_same_mux": statistics.median(shared) * 1000},
            "sharing_cost_ratio": statistics.median(shared) / statistics.median(elsewhere),
            "mux_rss_idle_mib": idle_kib / 1024.0,
            "mux_peak_rss_during_flood_mib": max(peaks) / 1024.0,
            "mux_peak_rss_per_session_mib": max(peaks) / 1024.0 / 2,
        }
        benchlib.print_rows([
            ("b's median `true`, alone", "%.1f ms" % result["b_median_ms"]["alone"]),
            ("... a flooding from its own mux", "%.1f ms" % result["b_median_ms"]["a_flooding_elsewhere"]),
            ("... a flooding in b's mux", "%.1f ms (x%.2f of the line above)" % (
                result["b_median_ms"]["a_flooding_in_the_same_mux"], result["sharing_cost_ratio"])),
            ("mux RSS, idle with 2 sessions", benchlib.mib(idle_kib)),
            ("mux peak RSS during the flood", "%s (%s per session)" % (benchlib.mib(max(peaks)), benchlib.mib(max(peaks) / 2))),
        ])
        print("wrote %s" % benchlib.save_json(args.output, result))
    finally:
        for c in (client, flood_client):
            if c is not None:
                c.close()
        stop_muxes(apart)
        stage.stop()


if __name__ == "__main__":
    main()
