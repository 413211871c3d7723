"""Benchmark of the microvm.sandbox.agent connection, side by side in one run (not a timed test).

1. A 30-task playbook (20 `command`, 10 `copy`) through
   - `connection: microvm.sandbox.agent` against a local-plane sandbox,
   - `connection: local`,
   - `connection: ssh` to a private sshd on 127.0.0.1 with ControlPersist and pipelining,
   each warmed up once (mux / ControlMaster started) and then timed REPEAT times, interleaved.
2. A 256 MiB file copied in and out REPEAT times, interleaved (median): the plugin's put_file/fetch_file path (the shared mux)
   against scp to localhost over the same warm ControlMaster. Each copy also records the CPU time each side's
   processes used, per MiB: ours (the mux), the local plane's port-forward (its server process) and guest agent
   (the guest's process tree), against scp's client (with its ssh), the ControlMaster and sshd (with scp -t).

Prints a table with ratios and writes bench/results/connection.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/connection_bench.py [--repeat 3] [--size-mib 256]
"""
import argparse
import os
import statistics
import subprocess
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import ROOT, children_cpu, cpu_seconds, playbook_text, processes, run_playbook, tree, write

from microvm_plane_testing import mux_pids
from stage import Stage

from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig


def cpu_groups(stage, mux_dir):
    """The processes of each side of a copy, by name: {name: [pids]}."""
    procs = processes()
    plane = stage.plane.process.pid
    masters = [pid for pid, (_ppid, _comm, cmd) in procs.items()
               if cmd.startswith("ssh: ") and stage.sshd.dir in cmd]
    return {"mux": mux_pids(mux_dir), "plane_port_forward": [plane],
            "guest_agent": [p for p in tree(procs, plane) if p != plane],
            "ssh_controlmaster": masters, "sshd": tree(procs, stage.sshd.proc.pid)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--copies-only", action="store_true", help="skip the playbooks: only the 256 MiB copies")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "connection.json"))
    args = parser.parse_args()

    stage = Stage("connbench")
    try:
        tmp, plane, session, sshd, env = stage.tmp, stage.plane, stage.session, stage.sshd, stage.env
        mux_dir, ssh_dir = stage.mux_dir, stage.ssh_dir
        write(os.path.join(tmp, "playbook.yml"), playbook_text(mixed=True))
        inventories = {mode: stage.inventory(mode) for mode in ("agent", "local", "ssh")}
        if args.copies_only:
            inventories = {}
        for mode in inventories:  # warm-up: the agent's mux and ssh's ControlMaster come up here
            run_playbook(tmp, "playbook.yml", inventories[mode], env)
        times = {mode: [] for mode in inventories}
        for i in range(args.repeat):
            order = list(inventories)[i % 3:] + list(inventories)[:i % 3]  # interleave against drift
            for mode in order:
                times[mode].append(run_playbook(tmp, "playbook.yml", inventories[mode], env))
        per_task = {mode: statistics.median(t) / 30 for mode, t in times.items()}
        ratio_to_local = {m: per_task[m] / per_task["local"] for m in per_task} if per_task else {}

        # 256 MiB in and out: the plugin's transfer path vs scp over the warm ControlMaster
        big = os.path.join(tmp, "big.bin")
        with open(big, "wb") as f:
            for _dummy in range(args.size_mib):
                f.write(os.urandom(1 << 20))
        mux = MuxClient(mux_dir, LinkConfig(session=session["name"], token=plane.token, api_url=plane.url,
                                            persist=300, transport="agent")).connect()
        scp = ["scp", "-q", "-P", str(sshd.port)] + sshd.options
        copies = {
            "agent_in": lambda: mux.put(big, "/workspace/big.bin"),
            "agent_out": lambda: mux.fetch("/workspace/big.bin", os.path.join(tmp, "big.agent")),
            "scp_in": lambda: subprocess.run(scp + [big, "root@127.0.0.1:%s/big.bin" % ssh_dir], check=True),
            "scp_out": lambda: subprocess.run(scp + ["root@127.0.0.1:%s/big.bin" % ssh_dir, os.path.join(tmp, "big.scp")],
                                              check=True),
        }
        if args.copies_only:  # no ssh playbook ran: start the ControlMaster now, so no timed copy pays for it
            subprocess.run(["ssh", "-p", str(sshd.port)] + sshd.options + ["root@127.0.0.1", "true"], check=True)
        copy_runs = {name: [] for name in copies}
        cpu_runs = {name: [] for name in copies}  # per copy: {process group: CPU ms per MiB}
        for _dummy in range(args.repeat):  # interleaved, like the playbooks; the median counts
            for name, copy in copies.items():
                groups = cpu_groups(stage, mux_dir)
                before = {g: cpu_seconds(pids) for g, pids in groups.items()}
                before_children = children_cpu()
                start = time.perf_counter()
                copy()
                copy_runs[name].append(round(time.perf_counter() - start, 3))
                after_groups = cpu_groups(stage, mux_dir)
                used = {g: cpu_seconds(after_groups[g]) - before[g] for g in groups}
                used["scp_client"] = children_cpu() - before_children  # scp and its ssh, reaped by us
                side = ("mux", "plane_port_forward", "guest_agent") if name.startswith("agent") else \
                    ("scp_client", "ssh_controlmaster", "sshd")
                cpu_runs[name].append({g: round(used[g] * 1000.0 / args.size_mib, 3) for g in side})
        mux.close()
        transfer = {name: statistics.median(runs) for name, runs in copy_runs.items()}
        for path in ("big.agent", "big.scp"):
            if os.path.getsize(os.path.join(tmp, path)) != args.size_mib << 20:
                raise RuntimeError("%s has the wrong size" % path)

        mib = float(args.size_mib)
        cpu = {name: {g: statistics.median(r[g] for r in runs) for g in runs[0]} for name, runs in cpu_runs.items()}
        # The target: our side (the mux) at most what scp's side of the controller spends (its client with ssh,
        # and the ControlMaster that does the encryption).
        mux_over_ssh = {d: cpu["agent_" + d]["mux"] / (cpu["scp_" + d]["scp_client"] + cpu["scp_" + d]["ssh_controlmaster"])
                        for d in ("in", "out")}
        result = {
            "tasks": 30, "repeat": args.repeat, "runs_seconds": times,
            "per_task_seconds": per_task,
            "ratio_to_local": ratio_to_local,
            "copy_mib": args.size_mib,
            "copy_seconds": transfer,
            "copy_runs_seconds": copy_runs,
            "copy_mib_per_second": {k: mib / v for k, v in transfer.items()},
            "copy_ratio_agent_to_scp": {"in": transfer["scp_in"] / transfer["agent_in"],
                                        "out": transfer["scp_out"] / transfer["agent_out"]},
            "copy_cpu_ms_per_mib": cpu,
            "mux_cpu_over_scp_client_side": mux_over_ssh,
            "copy_cpu_ms_per_mib_runs": cpu_runs,
            "targets": {"per_task_max_ratio_to_local": 1.15, "copy_min_ratio_to_scp": 1.0,
                        "mux_cpu_max_ratio_to_scp_client_side": 1.0},
            "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if per_task:
            print("30-task playbook (20 command, 10 copy), median of %d runs after a warm-up:" % args.repeat)
            print("  %-8s %10s %10s %12s" % ("mode", "run s", "per task", "vs local"))
        for mode in per_task:
            print("  %-8s %10.2f %10.3f %11.2fx" % (
                mode, statistics.median(times[mode]), per_task[mode], result["ratio_to_local"][mode]))
        print("%d MiB file (higher MiB/s is better; ratio > 1 means the agent is faster than scp):" % args.size_mib)
        for direction in ("in", "out"):
            print("  %-4s agent %7.1f MiB/s   scp %7.1f MiB/s   ratio %.2f" % (
                direction, result["copy_mib_per_second"]["agent_" + direction],
                result["copy_mib_per_second"]["scp_" + direction], result["copy_ratio_agent_to_scp"][direction]))
        print("CPU per MiB of each process group (ms, median): ours is the mux; the plane's port-forward and guest agent "
              "stand in for the platform; scp's are its client (with ssh), the ControlMaster and sshd")
        for name, groups in result["copy_cpu_ms_per_mib"].items():
            print("  %-10s %s" % (name, "   ".join("%s %.2f" % kv for kv in groups.items())))
        print("the mux over scp's controller side (client + ControlMaster), CPU per MiB: in %.2fx, out %.2fx "
              "(target at most 1.00x); load average %.1f" % (mux_over_ssh["in"], mux_over_ssh["out"], os.getloadavg()[0]))
        print("wrote %s" % benchlib.save_json(args.output, result))
    finally:
        stage.stop()


if __name__ == "__main__":
    main()
