"""The two roads side by side in one run (not a timed test): the agent, the documented API (`transport: api`), SSH.

1. A 30-task playbook (20 `command`, 10 `copy`) through `microvm.sandbox.agent` with `transport: agent`, with
   `transport: api`, and through `connection: ssh` (ControlPersist, pipelining) to a private sshd on
   127.0.0.1; each warmed up once, then timed REPEAT times, interleaved (median per task).
2. A SIZE MiB file copied in and out REPEAT times, interleaved (median): the mux's put/fetch on each road,
   and scp over the warm ControlMaster. On the api road a file over 50 MiB comes out through a staged
   transfer (object storage) and one over 500 MiB goes in through one: `--size-mib 520` stages both ways.

Ratios are against the agent road measured in the same run. Writes bench/results/api_road.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/api_road_bench.py [--repeat 3] [--size-mib 256]
"""
import argparse
import os
import statistics
import subprocess
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import ROOT, playbook_text, run_playbook, write

from stage import Stage

from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig

MODES = ("agent", "api", "ssh")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "api_road.json"))
    args = parser.parse_args()

    stage = Stage("roadbench")
    try:
        tmp, plane, session, sshd = stage.tmp, stage.plane, stage.session, stage.sshd
        write(os.path.join(tmp, "playbook.yml"), playbook_text(mixed=True))
        inventories = {"agent": stage.inventory("agent"),
                       "api": stage.inventory("agent", ansible_microvm_transport="api"),
                       "ssh": stage.inventory("ssh")}
        for mode in MODES:  # warm-up: each road's link in the mux and ssh's ControlMaster come up here
            run_playbook(tmp, "playbook.yml", inventories[mode], stage.env)
        times = {mode: [] for mode in MODES}
        for i in range(args.repeat):
            order = list(MODES)[i % 3:] + list(MODES)[:i % 3]  # interleave against drift
            for mode in order:
                times[mode].append(run_playbook(tmp, "playbook.yml", inventories[mode], stage.env))
        per_task = {mode: statistics.median(t) / 30 for mode, t in times.items()}

        big = os.path.join(tmp, "big.bin")
        with open(big, "wb") as f:
            for _dummy in range(args.size_mib):
                f.write(os.urandom(1 << 20))
        muxes = {road: MuxClient(stage.mux_dir, LinkConfig(session=session["name"], token=plane.token,
                                                           api_url=plane.url, persist=300, transport=road)).connect()
                 for road in ("agent", "api")}
        scp = ["scp", "-q", "-P", str(sshd.port)] + sshd.options
        copies = {}
        for road, mux in muxes.items():
            copies[road + "_in"] = (lambda m=mux, r=road: m.put(big, "/workspace/big.%s" % r))
            copies[road + "_out"] = (lambda m=mux, r=road: m.fetch("/workspace/big.%s" % r, os.path.join(tmp, "back.%s" % r)))
        copies["scp_in"] = lambda: subprocess.run(scp + [big, "root@127.0.0.1:%s/big.bin" % stage.ssh_dir], check=True)
        copies["scp_out"] = lambda: subprocess.run(scp + ["root@127.0.0.1:%s/big.bin" % stage.ssh_dir,
                                                          os.path.join(tmp, "back.scp")], check=True)
        runs = {name: [] for name in copies}
        for _dummy in range(args.repeat):
            for name, copy in copies.items():
                start = time.perf_counter()
                copy()
                runs[name].append(round(time.perf_counter() - start, 3))
        for mux in muxes.values():
            mux.close()
        for name in ("back.agent", "back.api", "back.scp"):
            if os.path.getsize(os.path.join(tmp, name)) != args.size_mib << 20:
                raise RuntimeError("%s has the wrong size" % name)
        seconds = {name: statistics.median(r) for name, r in runs.items()}
        from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_transfer
        size = args.size_mib << 20
        api_ways = {"in": "staged" if size > api_transfer.MAX_UPLOAD else "streaming",
                    "out": "staged" if size > api_transfer.STREAM_DOWNLOAD_MAX else "streaming"}
        mib = float(args.size_mib)
        result = {
            "tasks": 30, "repeat": args.repeat, "runs_seconds": times, "per_task_seconds": per_task,
            "per_task_ratio_to_agent": {m: per_task[m] / per_task["agent"] for m in MODES},
            "copy_mib": args.size_mib, "copy_seconds": seconds, "copy_runs_seconds": runs, "api_transfer": api_ways,
            "copy_mib_per_second": {k: mib / v for k, v in seconds.items()},
            "copy_time_ratio_to_agent": {k: v / seconds["agent_" + k.rsplit("_", 1)[1]] for k, v in seconds.items()},
            "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        print("30-task playbook (20 command, 10 copy), median of %d runs after a warm-up:" % args.repeat)
        print("  %-6s %9s %9s %10s" % ("road", "run s", "per task", "vs agent"))
        for mode in MODES:
            print("  %-6s %9.2f %9.3f %9.2fx" % (mode, statistics.median(times[mode]), per_task[mode],
                                                 result["per_task_ratio_to_agent"][mode]))
        print("%d MiB file, median seconds (and time vs the agent road; api in %s, out %s):"
              % (args.size_mib, api_ways["in"], api_ways["out"]))
        for direction in ("in", "out"):
            print("  %-4s " % direction + "   ".join(
                "%s %6.2f s (%.2fx)" % (road, seconds["%s_%s" % (road, direction)],
                                        result["copy_time_ratio_to_agent"]["%s_%s" % (road, direction)])
                for road in ("agent", "api", "scp")))
        print("wrote %s" % benchlib.save_json(args.output, result))
    finally:
        stage.stop()


if __name__ == "__main__":
    main()
