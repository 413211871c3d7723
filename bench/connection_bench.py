"""Benchmark of the microvm.sandbox.agent connection, side by side in one run (not a timed test).

1. A 30-task playbook (20 `command`, 10 `copy`) through
   - `connection: microvm.sandbox.agent` against a local-plane sandbox,
   - `connection: local`,
   - `connection: ssh` to a private sshd on 127.0.0.1 with ControlPersist and pipelining,
   each warmed up once (mux / ControlMaster started) and then timed REPEAT times, interleaved.
2. A 256 MiB file copied in and out REPEAT times (default 5), the peers interleaved in a rotating order:
   - the agent road's put/fetch through the shared mux on .venv's Python (ansible-core 2.19), as it is;
   - the same with MICROVM_MUX_BULK=off in the mux's environment (the bulk byte path off: gRPC alone);
   - both again with the mux on .venv-newest's Python (the newest ansible-core), when that venv exists;
   - scp to localhost over a ControlMaster.
   Each mux is a separate one, in its own mux dir, started by bench/mux_copier.py run on that venv's Python with
   that environment (MuxClient starts its mux with its own interpreter and environment). Every reply's "via"
   ("bulk" or "grpc"; absent before the bulk path) is recorded; a mux with the bulk path off that says "bulk" is
   an error.

   Honest copies:
   - Fresh files on both sides every round: round R puts to /workspace/big-<peer>-R.bin and fetches it back to
     a new local big-<peer>-R.bin; scp copies to a new ssh-dest/big-scp-R.bin and back to a new local
     big-scp-R.bin. Nothing is overwritten in place (scp, SFTP by default in OpenSSH 9, truncates and rewrites
     an existing target; the mux renames a download over the old file). The previous round's files are removed
     before the round starts, outside the timed part.
   - The ControlMaster's CPU counted whatever happens to it: the bench starts it as its own child (`ssh -M -N`,
     ControlPersist=no, stage.ControlMaster) and reads its utime + stime from /proc/<pid>/stat while it lives,
     or from the rusage os.wait4 returns once it has ended (then it is taken out of the children's rusage, which
     counts scp's client). scp runs with ControlMaster=no on that master's ControlPath, so it never starts a
     master of its own; `ssh -O check` before and after each scp copy must name the master's pid, or the copy
     did not go through it and the bench stops.
   Each copy records its wall time (a mux copy is timed in the copier around the mux's request alone; scp's
   includes starting scp and ssh, part of its cost) and the CPU time of each side's processes, per MiB: ours
   (the mux), the local plane's port-forward (its server process) and guest agent (the guest's process tree),
   which stand in for the platform, against scp's client (scp and its ssh: this process's reaped children),
   the ControlMaster and sshd (its process tree: the connection's sftp server inside).
   Reported, never asserted: min and median of the wall time, the throughput (MiB/s, best and median) and the
   CPU per MiB of each group; and for each mux, over scp in the same run and both ways, the mux's CPU per MiB
   over scp's controller side (client + ControlMaster; target at most 0.8x) and the throughput over scp's
   (target at least 1.0x).

Prints a table with ratios and writes bench/results/connection.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/connection_bench.py
       [--repeat 5] [--size-mib 256] [--copies-only] [--newest-venv .venv-newest]
"""
import argparse
import os
import statistics
import subprocess
import time
from typing import Any

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import BIN, COLLECTIONS, ROOT, children_cpu, cpu_seconds, playbook_text, processes, run_playbook, tree, write

from microvm_plane_testing import mux_pids, stop_muxes
from mux_copier import MuxCopier
from stage import ControlMaster, Stage

TARGET_CPU = 0.8  # the mux's CPU per MiB over scp's controller side: at most
TARGET_THROUGHPUT = 1.0  # the mux's throughput over scp's: at least
BULK_ENV = "MICROVM_MUX_BULK"  # "off" in a mux's environment turns the bulk byte path off
DIRECTIONS = ("in", "out")


def stats(values: list[float]) -> dict[str, float]:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4)}


def copier_env(bulk_off: bool) -> dict[str, str]:
    """The environment of a copier (and so of the mux it starts): the collection importable, the bulk path as asked."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([COLLECTIONS] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop(BULK_ENV, None)
    if bulk_off:
        env[BULK_ENV] = "off"
    return env


def mux_peers(stage: Stage, newest_venv: str) -> tuple[dict[str, MuxCopier], dict[str, str]]:
    """{peer: MuxCopier}: the default mux and one with the bulk path off, on .venv's Python and on the newest
    venv's when it exists; and a note per skipped peer."""
    pythons = {"agent": os.path.join(BIN, "python")}
    skipped = {}
    newest_python = os.path.join(os.path.abspath(newest_venv), "bin", "python")
    if os.path.exists(newest_python):
        pythons["agent_newest"] = newest_python
    else:
        skipped["agent_newest"] = ("no %s: the newest core's muxes are not measured (make .venv-newest/.stamp "
                                   "creates it)" % newest_python)
    peers: dict[str, MuxCopier] = {}
    try:
        for base, python in pythons.items():
            for bulk_off in (False, True):
                name = base + ("_bulk_off" if bulk_off else "")
                peers[name] = MuxCopier(python, copier_env(bulk_off), stage.path("mux-" + name), stage.session["name"],
                                        stage.plane.url, stage.plane.token)
    except BaseException:
        close_peers(peers)
        raise
    return peers, skipped


def close_peers(peers: dict[str, MuxCopier]) -> None:
    for copier in peers.values():
        copier.close()
        stop_muxes(copier.mux_dir)


def check_size(path: str, size_mib: int) -> None:
    if os.path.getsize(path) != size_mib << 20:
        raise RuntimeError("%s has %d bytes, not %d MiB" % (path, os.path.getsize(path), size_mib))


class Copies:
    """The copies of one run: each peer's in and out copy per round, their wall and CPU per MiB, the mux's "via"."""

    def __init__(self, stage: Stage, peers: dict[str, MuxCopier], master: ControlMaster, size_mib: int) -> None:
        self.stage, self.peers, self.master, self.mib = stage, peers, master, float(size_mib)
        self.size_mib = size_mib
        self.source = stage.path("big.bin")
        with open(self.source, "wb") as f:
            for _dummy in range(size_mib):
                f.write(os.urandom(1 << 20))
        self.scp = ["scp", "-q", "-P", str(stage.sshd.port)] + master.client_options()
        names = ["%s_%s" % (peer, d) for peer in list(peers) + ["scp"] for d in DIRECTIONS]
        self.seconds: dict[str, list[float]] = {name: [] for name in names}
        self.cpu: dict[str, list[dict[str, float]]] = {name: [] for name in names}  # per copy: {process group: CPU ms per MiB}
        self.via: dict[str, list[str | None]] = {name: [] for name in names if not name.startswith("scp")}

    def files(self, peer: str, round_no: int) -> tuple[str, str]:
        """(the copy's target in: guest or ssh-dest path, the local file the copy out writes)"""
        local = self.stage.path("big-%s-%d.bin" % (peer, round_no))
        if peer == "scp":
            return os.path.join(self.stage.ssh_dir, "big-scp-%d.bin" % round_no), local
        return "/workspace/big-%s-%d.bin" % (peer, round_no), local

    def remove_round(self, round_no: int) -> None:
        """The files of round `round_no`, both sides (outside the timed part)."""
        for peer in list(self.peers) + ["scp"]:
            target, local = self.files(peer, round_no)
            for path in ((target, local) if peer == "scp" else (local,)):
                if os.path.exists(path):
                    os.remove(path)
            if peer != "scp":
                self.peers[peer].remove([target])

    def groups(self, peer: str) -> dict[str, list[int]]:
        """{group: pids} of the processes on the agent road's sides of a copy through `peer`'s mux."""
        procs = processes()
        plane = self.stage.plane.process.pid
        return {"mux": mux_pids(self.peers[peer].mux_dir), "plane_port_forward": [plane],
                "guest_agent": [p for p in tree(procs, plane) if p != plane]}

    def copy(self, peer: str, direction: str, round_no: int) -> None:
        """One timed copy: its wall seconds and CPU ms per MiB of each group recorded."""
        name = "%s_%s" % (peer, direction)
        target, local = self.files(peer, round_no)
        if peer == "scp":
            self.scp_copy(name, [self.source, "root@127.0.0.1:" + target] if direction == "in"
                          else ["root@127.0.0.1:" + target, local])
        else:
            copier = self.peers[peer]
            before = {g: (pids, cpu_seconds(pids)) for g, pids in self.groups(peer).items()}
            done = copier.put(self.source, target) if direction == "in" else copier.fetch(target, local)
            after = self.groups(peer)
            # a pid gone since is counted by its parent (its cutime); a new one with all it used
            used = {g: cpu_seconds(set(after[g]) | set(pids)) - was for g, (pids, was) in before.items()}
            self.record(name, done["seconds"], used)
            via = done["reply"].get("via")
            self.via[name].append(via)
            if via == "bulk" and peer.endswith("_bulk_off"):
                raise RuntimeError("%s: the mux answered via bulk with %s=off in its environment" % (name, BULK_ENV))
        if direction == "out":
            check_size(local, self.size_mib)

    def scp_copy(self, name: str, argv: list[str]) -> None:
        if not self.master.used():
            raise RuntimeError("the bench's ControlMaster (pid %d) is not serving %s before %s; see %s"
                               % (self.master.proc.pid, self.master.path, name, self.master.log.name))
        sshd = tree(processes(), self.stage.sshd.proc.pid)
        master_before = self.master.cpu_seconds()
        was_running = self.master.rusage_seconds is None
        sshd_before = cpu_seconds(sshd)
        children_before = children_cpu()
        start = time.perf_counter()
        subprocess.run(self.scp + argv, check=True)
        seconds = time.perf_counter() - start
        master_used = self.master.cpu_seconds() - master_before  # reaps the master if it ended
        client_used = children_cpu() - children_before
        if was_running and self.master.rusage_seconds is not None:
            client_used -= self.master.rusage_seconds  # the master ended and was reaped here: not scp's
        sshd_used = cpu_seconds(set(sshd) | set(tree(processes(), self.stage.sshd.proc.pid))) - sshd_before
        if not self.master.used():
            raise RuntimeError("the bench's ControlMaster (pid %d) ended during %s: the copy may not have gone "
                               "through it; see %s" % (self.master.proc.pid, name, self.master.log.name))
        self.record(name, seconds, {"scp_client": client_used, "ssh_controlmaster": master_used, "sshd": sshd_used})

    def record(self, name: str, seconds: float, used: dict[str, float]) -> None:
        self.seconds[name].append(round(seconds, 3))
        cpu = {g: round(s * 1000.0 / self.mib, 3) for g, s in used.items()}
        if "scp_client" in cpu:
            cpu["scp_controller_side"] = round(cpu["scp_client"] + cpu["ssh_controlmaster"], 3)
        self.cpu[name].append(cpu)

    def run(self, repeat: int) -> None:
        order = list(self.peers) + ["scp"]
        for round_no in range(repeat):
            if round_no:
                self.remove_round(round_no - 1)
            for peer in order[round_no % len(order):] + order[:round_no % len(order)]:  # against drift
                for direction in DIRECTIONS:
                    self.copy(peer, direction, round_no)
        self.remove_round(repeat - 1)

    def summary(self) -> dict[str, dict[str, Any]]:
        """{copy: {seconds, mib_per_second, cpu_ms_per_mib, via}}, min and median of the runs."""
        out: dict[str, dict[str, Any]] = {}
        for name, runs in self.seconds.items():
            wall = stats(runs)
            out[name] = {"seconds": wall,
                         "mib_per_second": {"best": round(self.mib / wall["min"], 1),
                                            "median": round(self.mib / wall["median"], 1)},
                         "cpu_ms_per_mib": {g: stats([r[g] for r in self.cpu[name]]) for g in self.cpu[name][0]}}
            if name in self.via:
                out[name]["via"] = sorted({v or "-" for v in self.via[name]})
        return out


def ratios(summary: dict[str, dict[str, Any]], peers: dict[str, MuxCopier]) -> dict[str, dict[str, Any]]:
    """{peer: {direction: ...}}: the mux's CPU per MiB over scp's controller side, and its throughput over scp's."""
    out: dict[str, dict[str, Any]] = {}
    for peer in peers:
        out[peer] = {}
        for d in DIRECTIONS:
            ours, scp = summary["%s_%s" % (peer, d)], summary["scp_" + d]
            mux, side = ours["cpu_ms_per_mib"]["mux"], scp["cpu_ms_per_mib"]["scp_controller_side"]
            out[peer][d] = {
                "mux_cpu_over_scp_controller_side": {k: round(mux[k] / side[k], 3) if side[k] else None
                                                     for k in ("min", "median")},
                "throughput_over_scp": {k: round(ours["mib_per_second"][k] / scp["mib_per_second"][k], 3)
                                        for k in ("best", "median")}}
    return out


def copy_bench(stage: Stage, args: argparse.Namespace) -> dict[str, Any]:
    """The copies' part of connection.json: the keys of earlier runs (medians; agent_* is the default mux on
    .venv) and the new ones (copy_summary, copy_ratios, copy_peers, copy_skipped, copy_via_runs)."""
    peers, skipped = mux_peers(stage, args.newest_venv)
    master = None
    try:
        master = ControlMaster(stage.sshd, stage.path("ssh/bench-master.sock"))
        copies = Copies(stage, peers, master, args.size_mib)
        copies.run(args.repeat)
        master_pid, master_ended = master.proc.pid, master.rusage_seconds is not None
    finally:
        if master is not None:
            master.stop()
        close_peers(peers)
    summary = copies.summary()
    ratio = ratios(summary, peers)
    median = {name: s["seconds"]["median"] for name, s in summary.items()}
    cpu_median = {name: {g: v["median"] for g, v in s["cpu_ms_per_mib"].items()} for name, s in summary.items()}
    mib = float(args.size_mib)
    return {
        "copy_mib": args.size_mib,
        "copy_repeat": args.repeat,
        "copy_seconds": median,
        "copy_runs_seconds": copies.seconds,
        "copy_mib_per_second": {k: mib / v for k, v in median.items()},
        "copy_ratio_agent_to_scp": {d: median["scp_" + d] / median["agent_" + d] for d in DIRECTIONS},
        "copy_cpu_ms_per_mib": cpu_median,
        "mux_cpu_over_scp_client_side": {d: ratio["agent"][d]["mux_cpu_over_scp_controller_side"]["median"]
                                         for d in DIRECTIONS},
        "copy_cpu_ms_per_mib_runs": copies.cpu,
        "copy_summary": summary,
        "copy_ratios": ratio,
        "copy_peers": {peer: {"python": c.hello["python"], "ansible_core": c.hello["ansible_core"],
                              "env": {BULK_ENV: "off"} if peer.endswith("_bulk_off") else {}}
                       for peer, c in peers.items()},
        "copy_skipped": skipped,
        "copy_via_runs": copies.via,
        "controlmaster": {"pid": master_pid, "ended_during_run": master_ended,
                          "checked": "ssh -O check named its pid before and after every scp copy"},
    }


def print_copies(result: dict[str, Any], size_mib: int) -> None:
    peers = result["copy_peers"]
    print("%d MiB file, %d rounds, fresh files each round; min / median (throughput: best / median):"
          % (size_mib, result["copy_repeat"]))
    for peer, info in peers.items():
        env = "".join(" %s=%s" % kv for kv in info["env"].items())
        print("  %-22s Python %s, ansible-core %s%s" % (peer, info["python"], info["ansible_core"], env))
    for peer, note in result["copy_skipped"].items():
        print("  %-22s skipped: %s" % (peer, note))
    print("  %-26s %-15s %-15s %s" % ("copy", "wall s", "MiB/s", "CPU ms per MiB (min / median)"))
    for name, s in result["copy_summary"].items():
        cpu = "   ".join("%s %.2f / %.2f" % (g, v["min"], v["median"]) for g, v in s["cpu_ms_per_mib"].items())
        via = "" if "via" not in s else "  via %s" % ",".join(s["via"])
        print("  %-26s %6.2f / %-6.2f %6.1f / %-6.1f %s%s" % (
            name, s["seconds"]["min"], s["seconds"]["median"], s["mib_per_second"]["best"],
            s["mib_per_second"]["median"], cpu, via))
    print("  ours is the mux; the plane's port-forward and guest agent stand in for the platform; scp's are its client "
          "(with ssh), the ControlMaster and sshd; scp_controller_side = client + ControlMaster")
    print("each mux against scp in the same run (median; min or best in brackets); targets: CPU at most %.1fx, "
          "throughput at least %.1fx" % (TARGET_CPU, TARGET_THROUGHPUT))
    for peer, by_dir in result["copy_ratios"].items():
        for d, r in by_dir.items():
            cpu, thr = r["mux_cpu_over_scp_controller_side"], r["throughput_over_scp"]
            print("  %-22s %-4s mux CPU / scp controller side %s (%s)%s   throughput / scp %.2fx (%.2fx)%s" % (
                peer, d, fmt_ratio(cpu["median"]), fmt_ratio(cpu["min"]),
                "" if cpu["median"] is not None and cpu["median"] <= TARGET_CPU else " MISSED",
                thr["median"], thr["best"], "" if thr["median"] >= TARGET_THROUGHPUT else " MISSED"))


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else "%.2fx" % value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--copies-only", action="store_true", help="skip the playbooks: only the 256 MiB copies")
    parser.add_argument("--newest-venv", default=os.path.join(ROOT, ".venv-newest"),
                        help="a venv with the newest supported ansible-core (its muxes skipped when missing)")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "connection.json"))
    args = parser.parse_args()
    load_at_start = os.getloadavg()

    stage = Stage("connbench")
    try:
        tmp, env = stage.tmp, stage.env
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

        copies = copy_bench(stage, args)
        result = {
            "tasks": 30, "repeat": args.repeat, "runs_seconds": times,
            "per_task_seconds": per_task,
            "ratio_to_local": ratio_to_local,
            **copies,
            "targets": {"per_task_max_ratio_to_local": 1.15, "copy_min_ratio_to_scp": TARGET_THROUGHPUT,
                        "mux_cpu_max_ratio_to_scp_client_side": TARGET_CPU},
            "machine": {"cpus": os.cpu_count(), "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if per_task:
            print("30-task playbook (20 command, 10 copy), median of %d runs after a warm-up:" % args.repeat)
            print("  %-8s %10s %10s %12s" % ("mode", "run s", "per task", "vs local"))
        for mode in per_task:
            print("  %-8s %10.2f %10.3f %11.2fx" % (
                mode, statistics.median(times[mode]), per_task[mode], result["ratio_to_local"][mode]))
        print_copies(result, args.size_mib)
        print("load average: %.1f %.1f %.1f at the start, %.1f %.1f %.1f at the end (%d CPUs)"
              % (load_at_start + os.getloadavg() + (os.cpu_count() or 0,)))
        print("wrote %s" % benchlib.save_json(args.output, result))
    finally:
        stage.stop()


if __name__ == "__main__":
    main()
