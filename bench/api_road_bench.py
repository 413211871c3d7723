"""The two roads side by side in one run (not a timed test): the agent, the documented API (`transport: api`), SSH.

0. Per `command` task, each road with its warm runner: (a 30-`command` playbook minus an empty playbook) / 30,
   on `transport: agent` and `transport: api` in the same run, on ansible-core 2.19 (.venv) and on the newest
   core (.venv-newest, when there): the api road's ratio to the agent road (its target: at most 2x).
1. A 30-task playbook (20 `command`, 10 `copy`) through `microvm.sandbox.agent` with `transport: agent`, with
   `transport: api`, and through `connection: ssh` (ControlPersist, pipelining) to a private sshd on
   127.0.0.1; each warmed up once, then timed REPEAT times, interleaved (median per task).
2. A SIZE MiB file copied in and out REPEAT times, interleaved (median): the mux's put/fetch on each road
   (with the mux's CPU per MiB), and scp over the warm ControlMaster. On the api road a file over 50 MiB comes out through a staged
   transfer (object storage) and one over 500 MiB goes in through one: `--size-mib 520` stages both ways.

Ratios are against the agent road measured in the same run. Writes bench/results/api_road.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/api_road_bench.py [--repeat 3] [--size-mib 256]
       [--newest-venv .venv-newest] [--only-commands]
"""
import argparse
import os
import statistics
import subprocess
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import BIN, PLAYBOOK, ROOT, playbook_argv, playbook_text, run_playbook, timed_run, write

from microvm_plane_testing import mux_pids
from stage import Stage

from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig

MODES = ("agent", "api", "ssh")
ROADS = ("agent", "api")


def core_version(bin_dir):
    """"ansible-core <version>" of the venv bin_dir."""
    return "ansible-core " + subprocess.run([os.path.join(bin_dir, "python"), "-c", "import ansible.release as r; "
                                             "print(r.__version__)"], capture_output=True, text=True, check=True).stdout.strip()


def run_book(tmp, book, inventory, env, bin_dir):
    """Seconds of one run; an empty playbook has no recap to check, only its exit code."""
    if not book.endswith("empty.yml"):
        return run_playbook(tmp, book, inventory, env, bin_dir=bin_dir)
    proc, seconds = timed_run(playbook_argv(inventory, book, bin_dir=bin_dir), env, tmp)
    if proc.returncode != 0:
        raise RuntimeError("the empty playbook failed:\n%s\n%s" % (proc.stdout[-2000:], proc.stderr[-2000:]))
    return seconds


def per_command_task(stage, inventories, repeat, cores):
    """{core: {road: seconds per `command` task}}: (30 commands minus an empty playbook) / 30, the runs of both
    roads and both playbooks interleaved, medians of `repeat`; each road's warm runner up after a warm-up."""
    tmp = stage.tmp
    books = {"command30": write(os.path.join(tmp, "command30.yml"), playbook_text(mixed=False)),
             "empty": write(os.path.join(tmp, "empty.yml"), PLAYBOOK.replace("{tasks}", "").replace("tasks:", "tasks: []"))}
    result = {}
    for core, bin_dir in cores.items():
        for road in ROADS:
            run_playbook(tmp, books["command30"], inventories[road], stage.env, bin_dir=bin_dir)
        times = {(road, book): [] for road in ROADS for book in books}
        for i in range(repeat):
            order = list(times)[i % len(times):] + list(times)[:i % len(times)]  # interleave against drift
            for road, book in order:
                times[(road, book)].append(run_book(tmp, books[book], inventories[road], stage.env, bin_dir))
        per = {road: max(0.0, statistics.median(times[(road, "command30")]) - statistics.median(times[(road, "empty")])) / 30
               for road in ROADS}
        result[core] = {"per_task_seconds": per, "api_to_agent": per["api"] / per["agent"] if per["agent"] else None,
                        "runs_seconds": {"%s_%s" % key: [round(t, 3) for t in ts] for key, ts in times.items()}}
        print("%s: per command task, agent %.3f s, api %.3f s: api/agent %.2fx"
              % (core, per["agent"], per["api"], result[core]["api_to_agent"] or 0), flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "api_road.json"))
    parser.add_argument("--newest-venv", default=os.path.join(ROOT, ".venv-newest"),
                        help="a venv with the newest supported ansible-core (skipped when missing)")
    parser.add_argument("--only-commands", action="store_true", help="part 0 only (per command task)")
    parser.add_argument("--changed-copies", action="store_true",
                        help="part 1's copies change their file at every run (each puts it), not only the first")
    args = parser.parse_args()
    cores = {core_version(BIN): BIN}
    newest_bin = os.path.join(os.path.abspath(args.newest_venv), "bin")
    if os.path.exists(os.path.join(newest_bin, "ansible-playbook")):
        cores[core_version(newest_bin)] = newest_bin

    stage = Stage("roadbench")
    try:
        tmp, plane, session, sshd = stage.tmp, stage.plane, stage.session, stage.sshd
        write(os.path.join(tmp, "playbook.yml"), playbook_text(mixed=True, changed=args.changed_copies))
        inventories = {"agent": stage.inventory("agent"),
                       "api": stage.inventory("agent", ansible_microvm_transport="api"),
                       "ssh": stage.inventory("ssh")}
        commands = per_command_task(stage, inventories, args.repeat, cores)
        if args.only_commands:
            doc = {"per_command_task": commands, "repeat": args.repeat,
                   "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
                   "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            print("wrote %s" % benchlib.save_json(args.output, doc))
            return
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
        mux_cpu = {name: [] for name in copies if not name.startswith("scp")}  # the mux's CPU seconds per copy
        for _dummy in range(args.repeat):
            for name, copy in copies.items():
                cpu = benchlib.cpu_seconds(mux_pids(stage.mux_dir))
                start = time.perf_counter()
                copy()
                runs[name].append(round(time.perf_counter() - start, 3))
                if name in mux_cpu:
                    mux_cpu[name].append(benchlib.cpu_seconds(mux_pids(stage.mux_dir)) - cpu)
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
            "per_command_task": commands,
            "tasks": 30, "changed_copies": args.changed_copies, "repeat": args.repeat, "runs_seconds": times,
            "per_task_seconds": per_task,
            "per_task_ratio_to_agent": {m: per_task[m] / per_task["agent"] for m in MODES},
            "copy_mib": args.size_mib, "copy_seconds": seconds, "copy_runs_seconds": runs, "api_transfer": api_ways,
            "copy_mib_per_second": {k: mib / v for k, v in seconds.items()},
            "copy_time_ratio_to_agent": {k: v / seconds["agent_" + k.rsplit("_", 1)[1]] for k, v in seconds.items()},
            "copy_mux_cpu_ms_per_mib": {k: 1000 * statistics.median(v) / mib for k, v in mux_cpu.items()},
            "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        print("30-task playbook (20 command, 10 %s copy), median of %d runs after a warm-up:"
              % ("changed" if args.changed_copies else "unchanged", args.repeat))
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
        print("  the mux's CPU per MiB: " + ", ".join("%s %.2f ms" % (k, v) for k, v in
                                                      result["copy_mux_cpu_ms_per_mib"].items()))
        print("wrote %s" % benchlib.save_json(args.output, result))
    finally:
        stage.stop()


if __name__ == "__main__":
    main()
