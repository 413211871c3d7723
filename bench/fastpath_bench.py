# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark of the warm module runner (option warm_runner) of the microvm.sandbox.agent connection.

Three playbooks: 30 `command` tasks, the 30-task mix (20 `command`, 10 `copy`), and the per-task floor of
ansible-core itself (30 `debug` tasks: no connection, no module), through
  - the agent connection with the warm runner on, on ansible-core 2.19 (.venv) and, with --newest-venv,
    on the newest core (.venv-newest, 2.21), its host from the sessions inventory (agent_warm: the plugin loaded
    before the workers fork) and from a static ini inventory (agent_warm_static: each worker loads it),
  - the agent connection with the warm runner off (plain pipelined exec, a fresh python3 per module),
  - `connection: local` (on both cores),
  - `connection: ssh` to a private sshd on 127.0.0.1 with ControlPersist and pipelining,
  - with --mitogen-venv DIR (a venv with ansible-core 2.19 and mitogen), under Mitogen's mitogen_linear strategy:
    over SSH to the same sshd, and `connection: local` (Mitogen has no transport for the sandbox agent;
    local is its best case, with no network at all); with --mitogen-newest-venv DIR (the newest core and mitogen)
    Mitogen `local` on the newest core too (mitogen_local_newest), the peer of agent_warm_newest,
  - with --switch-intervals, the warm agent with its mux's GIL switch interval fixed at 0.5 ms (agent_warm_gil05ms,
    the rule before issue 45) and at Python's 5 ms (agent_warm_gil5ms), each from a mux of its own, against
    agent_warm (the mux's rule: short only while requests compete, _mux/switch_interval.py),
each warmed up once (mux, runner, ControlMaster started) and then timed REPEAT times, interleaved.

After each agent run it also reads what the mux served (warm, cold exec, tmp dir ops), so a figure that
silently came from the cold path shows as such. Prints per-task medians and ratios (agent_warm on each
core against every other mode of the same run), the CPU per task of each, and issue 45's targets (wall and CPU,
each core against Mitogen `local` on the same core) as met or missed; writes bench/results/fastpath.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/fastpath_bench.py [--repeat 3]
       [--mitogen-venv .local/bench/mitogen-venv] [--mitogen-newest-venv .local/bench/mitogen-newest-venv]
       [--newest-venv .venv-newest] [--switch-intervals] [--playbooks command30,mixed30,debug30]
"""
import argparse
import os
import statistics
import subprocess
import sys

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import BIN, ROOT, playbook_text, run_playbook, write

from stage import Stage

from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import pool_status

PLAYBOOKS = ("command30", "mixed30", "debug30")
DEBUG30 = "- hosts: target\n  gather_facts: false\n  tasks:\n" + "".join(
    "    - ansible.builtin.debug: {msg: %d}\n" % n for n in range(30))
# The agent modes whose ratio to every other mode is printed.
SUBJECTS = ("agent_warm", "agent_warm_newest", "agent_warm_static", "agent_warm_static_newest")
# Issue 45's targets: (playbook, subject, its Mitogen peer on the same core, at most this ratio on wall and on CPU).
TARGETS = (("command30", "agent_warm", "mitogen_local", 0.85), ("mixed30", "agent_warm", "mitogen_local", 0.90),
           ("command30", "agent_warm_newest", "mitogen_local_newest", 0.85),
           ("mixed30", "agent_warm_newest", "mitogen_local_newest", 0.90),
           ("command30", "agent_warm_static", "mitogen_local", 0.85), ("mixed30", "agent_warm_static", "mitogen_local", 0.90),
           ("command30", "agent_warm_static_newest", "mitogen_local_newest", 0.85),
           ("mixed30", "agent_warm_static_newest", "mitogen_local_newest", 0.90))
# --switch-intervals: mode -> the mux's fixed GIL switch interval (MICROVM_MUX_SWITCH_INTERVAL)
SWITCH_MODES = {"agent_warm_gil05ms": "0.0005", "agent_warm_gil5ms": "0.005"}


def core_version(bin_dir):
    out = subprocess.run([os.path.join(bin_dir, "python"), "-c", "import ansible.release as r; print(r.__version__)"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out


def served(mux_dir):
    """The mux pool's counters: {how: count} summed over its processes."""
    total = {}
    for status in pool_status(mux_dir).values():
        for how, count in status.get("served", {}).items():
            total[how] = total.get(how, 0) + count
    return total


def mitogen_runner(venv, env):
    """(environment, bin dir) that run ansible-playbook of `venv` under Mitogen's mitogen_linear strategy."""
    found = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                            "import ansible_mitogen, os; print(os.path.dirname(ansible_mitogen.__file__))"],
                           capture_output=True, text=True, check=True).stdout.strip()
    mitogen_env = dict(env, ANSIBLE_STRATEGY_PLUGINS=os.path.join(found, "plugins", "strategy"),
                       ANSIBLE_STRATEGY="mitogen_linear")
    mitogen_env.pop("PYTHONPATH", None)
    return mitogen_env, os.path.join(venv, "bin")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mitogen-venv", help="a venv with ansible-core and mitogen installed")
    parser.add_argument("--mitogen-newest-venv", help="a venv with the newest ansible-core and mitogen installed")
    parser.add_argument("--switch-intervals", action="store_true",
                        help="also the warm agent with its mux's GIL switch interval fixed at 0.5 ms and at 5 ms")
    parser.add_argument("--newest-venv", default=os.path.join(ROOT, ".venv-newest"),
                        help="a venv with the newest supported ansible-core (skipped when missing)")
    parser.add_argument("--playbooks", default=",".join(PLAYBOOKS))
    parser.add_argument("--modes", default="", help="comma-separated subset of the modes (default: all)")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "fastpath.json"))
    args = parser.parse_args()
    # the playbooks run in a temporary dir: a relative venv path would not be found there
    mitogen_venvs = {suffix: os.path.abspath(venv) for suffix, venv in (("", args.mitogen_venv),
                                                                        ("_newest", args.mitogen_newest_venv)) if venv}
    newest_bin = os.path.join(os.path.abspath(args.newest_venv), "bin")
    have_newest = os.path.exists(os.path.join(newest_bin, "ansible-playbook"))

    stage = Stage("fastbench")
    try:
        tmp, env = stage.tmp, stage.env
        texts = {"command30": playbook_text(mixed=False), "mixed30": playbook_text(mixed=True), "debug30": DEBUG30}
        playbooks = {name: write(os.path.join(tmp, name + ".yml"), texts[name]) for name in args.playbooks.split(",")}
        inventories = {
            # the session as the sessions inventory makes it (the documented way: it loads the connection in
            # ansible-playbook itself, before the workers fork); _static: a hand-written ini inventory naming the
            # connection, where each task's worker loads it (7 ms a task more, docs/connection.md)
            "agent_warm": stage.sessions_inventory(ansible_microvm_warm_runner="true"),
            "agent_warm_static": stage.inventory("agent", ansible_microvm_warm_runner="true"),
            "agent_cold": stage.inventory("agent", ansible_microvm_warm_runner="false"),
            "local": stage.inventory("local"),
            "ssh": stage.inventory("ssh"),
        }
        runners = {mode: (env, BIN) for mode in inventories}
        cores = {"": core_version(BIN)}
        if have_newest:
            cores["newest"] = core_version(newest_bin)
            for mode in ("agent_warm", "agent_warm_static", "local"):
                inventories[mode + "_newest"] = inventories[mode]
                runners[mode + "_newest"] = (env, newest_bin)
        for suffix, venv in mitogen_venvs.items():
            cores["mitogen" + suffix] = core_version(os.path.join(venv, "bin"))
            for mode, base in (("mitogen_ssh", "ssh"), ("mitogen_local", "local")):
                if suffix and mode == "mitogen_ssh":
                    continue  # on the newest core only the peer: Mitogen's best case
                inventories[mode + suffix] = inventories[base]
                runners[mode + suffix] = mitogen_runner(venv, env)
        mux_dirs = {mode: stage.mux_dir for mode in inventories}
        if args.switch_intervals:
            for mode, interval in SWITCH_MODES.items():
                inventories[mode] = inventories["agent_warm"]
                runners[mode] = (stage.mux_env(mode, MICROVM_MUX_SWITCH_INTERVAL=interval), BIN)
                mux_dirs[mode] = stage.mux_dirs[-1]
        if args.modes:
            keep = args.modes.split(",")
            inventories = {m: inv for m, inv in inventories.items() if m in keep}
        result = {"repeat": args.repeat, "cores": cores, "per_task_s": {}, "runs_s": {}, "served": {},
                  "cpu_per_task_s": {}, "load_at_start": os.getloadavg(), "left_out": {}}
        for name, playbook in playbooks.items():
            modes = [m for m in inventories if name != "debug30" or m.startswith("local") or m.startswith("mitogen_local")]
            for mode in list(modes):  # warm-up: the mux and the warm runner come up here
                try:
                    run_playbook(tmp, playbook, inventories[mode], *runners[mode])
                except RuntimeError as e:
                    if not mode.startswith("mitogen"):
                        raise
                    # a peer that does not run on its core is left out, with why, not the whole bench
                    result["left_out"][mode] = str(e)[-2000:]
                    print("left out %s: Mitogen failed on ansible-core %s:\n%s" % (
                        mode, cores.get("mitogen_newest" if mode.endswith("_newest") else "mitogen"), str(e)[-2000:]))
                    modes.remove(mode)
                    inventories.pop(mode)
            times = {mode: [] for mode in modes}
            cpus = {mode: [] for mode in modes}
            counts = {mode: {} for mode in modes}
            for i in range(args.repeat):
                order = modes[i % len(modes):] + modes[:i % len(modes)]  # interleave against drift
                for mode in order:
                    before = served(mux_dirs[mode])
                    cpu_before = stage.cpu()
                    times[mode].append(run_playbook(tmp, playbook, inventories[mode], *runners[mode]))
                    cpu_after = stage.cpu()
                    cpus[mode].append({side: cpu_after[side] - cpu_before[side] for side in cpu_after})
                    after = served(mux_dirs[mode])
                    for how in after:
                        if after[how] != before.get(how, 0):
                            counts[mode][how] = counts[mode].get(how, 0) + after[how] - before.get(how, 0)
            result["runs_s"][name] = {mode: [round(t, 3) for t in ts] for mode, ts in times.items()}
            result["per_task_s"][name] = {mode: round(statistics.median(ts) / 30, 4) for mode, ts in times.items()}
            result["served"][name] = {mode: c for mode, c in counts.items() if c}
            # CPU per task, each side (see Stage.cpu), median over the runs of their sum: unlike the wall time it
            # hardly moves with the machine's load; "ours" is what the controller and the guest's runner used
            result["cpu_per_task_s"][name] = {mode: {
                "ours": round(statistics.median(c["controller"] + c["runner"] for c in runs) / 30, 4),
                "controller": round(statistics.median(c["controller"] for c in runs) / 30, 4),
                "runner": round(statistics.median(c["runner"] for c in runs) / 30, 4),
                "platform": round(statistics.median(c["platform"] for c in runs) / 30, 4)} for mode, runs in cpus.items()}
        result["load_at_end"] = os.getloadavg()
        result["targets"] = targets(result)
        result["ratio"] = {subject: {name: {mode: round(per[subject] / per[mode], 3) for mode in per}
                                     for name, per in result["per_task_s"].items() if subject in per}
                           for subject in SUBJECTS}
        benchlib.save_json(args.output, result, sort_keys=True)
        report(result, list(inventories))
        print("wrote %s" % args.output)
    finally:
        stage.stop()
    return 0


def targets(result):
    """Issue 45's targets: [{playbook, subject, peer, target, wall, cpu, met}] for those this run measured."""
    out = []
    for name, subject, peer, target in TARGETS:
        per, cpu = result["per_task_s"].get(name, {}), result["cpu_per_task_s"].get(name, {})
        if subject in per and peer in per:
            wall = round(per[subject] / per[peer], 3)
            cpu_ratio = round(cpu[subject]["ours"] / cpu[peer]["ours"], 3)
            out.append({"playbook": name, "subject": subject, "peer": peer, "target": target, "wall": wall,
                        "cpu": cpu_ratio, "wall_met": wall <= target, "cpu_met": cpu_ratio <= target})
    return out


def report(result, modes):
    cores = result["cores"]
    w = max([19] + [len(m) + 2 for m in modes])  # column width
    print("ansible-core: %s; newest: %s; Mitogen's: %s and %s" % (
        cores.get(""), cores.get("newest", "-"), cores.get("mitogen", "-"), cores.get("mitogen_newest", "-")))
    print("seconds per task (median run / 30); debug30 is ansible-core's own floor (no connection, no module)")
    print("%-10s" % "playbook" + "".join("%*s" % (w, m) for m in modes))
    for name, per in result["per_task_s"].items():
        print("%-10s" % name + "".join(("%*.4fs" % (w - 1, per[m])) if m in per else "%*s" % (w, "-") for m in modes))
    for subject in SUBJECTS:
        if subject not in modes:
            continue
        print("%s / mode (below 1: %s is faster)" % (subject, subject))
        for name, per in result["ratio"][subject].items():
            print("%-10s" % name + "".join(("%*.2fx" % (w - 1, per[m])) if m in per else "%*s" % (w, "-") for m in modes))
    print("CPU seconds per task, the controller (ansible-playbook, its workers, the mux) and the guest's warm runner; "
          "in brackets the local plane and its agent, which stand in for the platform")
    for name, per in result["cpu_per_task_s"].items():
        print("%-10s" % name + "".join(("%*s" % (w, "%.4f (%.4f)" % (per[m]["ours"], per[m]["platform"]))) if m in per else "%*s" % (w, "-")
                                       for m in modes))
    for subject in SUBJECTS + tuple(SWITCH_MODES):
        for name, per in result["cpu_per_task_s"].items():
            for peer in ("mitogen_local", "mitogen_local_newest", "agent_warm"):
                if subject in per and peer in per and subject != peer:
                    print("CPU per task, %s / %s, %s: %.2fx" % (subject, peer, name, per[subject]["ours"] / per[peer]["ours"]))
    for t in result["targets"]:
        print("issue 45 target, %s %s / %s at most %.2fx: wall %.2fx %s, CPU %.2fx %s" % (
            t["playbook"], t["subject"], t["peer"], t["target"], t["wall"], "met" if t["wall_met"] else "MISSED",
            t["cpu"], "met" if t["cpu_met"] else "MISSED"))
    print("load average at start / end: %.1f / %.1f" % (result["load_at_start"][0], result["load_at_end"][0]))
    for name, by_mode in result["served"].items():
        for mode, counts in by_mode.items():
            print("served by the mux, %s %s (all runs): %s" % (name, mode, ", ".join(
                "%s %d" % kv for kv in sorted(counts.items()))))


if __name__ == "__main__":
    sys.exit(main())
