# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark of the warm module runner (option warm_runner) of the microvm.sandbox.agent connection.

Three playbooks: 30 `command` tasks, the 30-task mix (20 `command`, 10 `copy`), and the per-task floor of
ansible-core itself (30 `debug` tasks: no connection, no module), through
  - the agent connection with the warm runner on, on ansible-core 2.19 (.venv) and, with --newest-venv,
    on the newest core (.venv-newest, 2.21),
  - the agent connection with the warm runner off (plain pipelined exec, a fresh python3 per module),
  - `connection: local` (on both cores),
  - `connection: ssh` to a private sshd on 127.0.0.1 with ControlPersist and pipelining,
  - with --mitogen-venv DIR (a venv with ansible-core and mitogen), under Mitogen's mitogen_linear strategy:
    over SSH to the same sshd, and `connection: local` (Mitogen has no transport for the sandbox agent;
    local is its best case, with no network at all),
each warmed up once (mux, runner, ControlMaster started) and then timed REPEAT times, interleaved.

After each agent run it also reads what the mux served (warm, cold exec, tmp dir ops), so a figure that
silently came from the cold path shows as such. Prints per-task medians and ratios (agent_warm on each
core against every other mode of the same run) and writes bench/results/fastpath.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/fastpath_bench.py [--repeat 3]
       [--mitogen-venv .local/bench/mitogen-venv] [--newest-venv .venv-newest] [--playbooks command30,mixed30,debug30]
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
SUBJECTS = ("agent_warm", "agent_warm_newest")


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mitogen-venv", help="a venv with ansible-core and mitogen installed")
    parser.add_argument("--newest-venv", default=os.path.join(ROOT, ".venv-newest"),
                        help="a venv with the newest supported ansible-core (skipped when missing)")
    parser.add_argument("--playbooks", default=",".join(PLAYBOOKS))
    parser.add_argument("--modes", default="", help="comma-separated subset of the modes (default: all)")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "fastpath.json"))
    args = parser.parse_args()
    if args.mitogen_venv:  # the playbooks run in a temporary dir: a relative venv path would not be found there
        args.mitogen_venv = os.path.abspath(args.mitogen_venv)
    newest_bin = os.path.join(os.path.abspath(args.newest_venv), "bin")
    have_newest = os.path.exists(os.path.join(newest_bin, "ansible-playbook"))

    stage = Stage("fastbench")
    try:
        tmp, env = stage.tmp, stage.env
        texts = {"command30": playbook_text(mixed=False), "mixed30": playbook_text(mixed=True), "debug30": DEBUG30}
        playbooks = {name: write(os.path.join(tmp, name + ".yml"), texts[name]) for name in args.playbooks.split(",")}
        inventories = {
            "agent_warm": stage.inventory("agent", ansible_microvm_warm_runner="true"),
            "agent_cold": stage.inventory("agent", ansible_microvm_warm_runner="false"),
            "local": stage.inventory("local"),
            "ssh": stage.inventory("ssh"),
        }
        runners = {mode: (env, BIN) for mode in inventories}
        cores = {"": core_version(BIN)}
        if have_newest:
            cores["newest"] = core_version(newest_bin)
            for mode in ("agent_warm", "local"):
                inventories[mode + "_newest"] = inventories[mode]
                runners[mode + "_newest"] = (env, newest_bin)
        if args.mitogen_venv:
            found = subprocess.run([os.path.join(args.mitogen_venv, "bin", "python"), "-c",
                                    "import ansible_mitogen, os; print(os.path.dirname(ansible_mitogen.__file__))"],
                                   capture_output=True, text=True, check=True).stdout.strip()
            mitogen_env = dict(env, ANSIBLE_STRATEGY_PLUGINS=os.path.join(found, "plugins", "strategy"),
                               ANSIBLE_STRATEGY="mitogen_linear")
            mitogen_env.pop("PYTHONPATH", None)
            cores["mitogen"] = core_version(os.path.join(args.mitogen_venv, "bin"))
            for mode, base in (("mitogen_ssh", "ssh"), ("mitogen_local", "local")):
                inventories[mode] = inventories[base]
                runners[mode] = (mitogen_env, os.path.join(args.mitogen_venv, "bin"))
        if args.modes:
            keep = args.modes.split(",")
            inventories = {m: inv for m, inv in inventories.items() if m in keep}
        result = {"repeat": args.repeat, "cores": cores, "per_task_s": {}, "runs_s": {}, "served": {},
                  "cpu_per_task_s": {}, "load_at_start": os.getloadavg()}
        for name, playbook in playbooks.items():
            modes = [m for m in inventories if name != "debug30" or m.startswith("local") or m == "mitogen_local"]
            for mode in modes:  # warm-up: the mux and the warm runner come up here
                run_playbook(tmp, playbook, inventories[mode], *runners[mode])
            times = {mode: [] for mode in modes}
            cpus = {mode: [] for mode in modes}
            counts = {mode: {} for mode in modes}
            for i in range(args.repeat):
                order = modes[i % len(modes):] + modes[:i % len(modes)]  # interleave against drift
                for mode in order:
                    before = served(stage.mux_dir)
                    cpu_before = stage.cpu()
                    times[mode].append(run_playbook(tmp, playbook, inventories[mode], *runners[mode]))
                    cpu_after = stage.cpu()
                    cpus[mode].append({side: cpu_after[side] - cpu_before[side] for side in cpu_after})
                    after = served(stage.mux_dir)
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
        result["ratio"] = {subject: {name: {mode: round(per[subject] / per[mode], 3) for mode in per}
                                     for name, per in result["per_task_s"].items() if subject in per}
                           for subject in SUBJECTS}
        benchlib.save_json(args.output, result, sort_keys=True)
        report(result, list(inventories))
        print("wrote %s" % args.output)
    finally:
        stage.stop()
    return 0


def report(result, modes):
    cores = result["cores"]
    print("ansible-core: %s; newest: %s; Mitogen's: %s" % (cores.get(""), cores.get("newest", "-"), cores.get("mitogen", "-")))
    print("seconds per task (median run / 30); debug30 is ansible-core's own floor (no connection, no module)")
    print("%-10s" % "playbook" + "".join("%19s" % m for m in modes))
    for name, per in result["per_task_s"].items():
        print("%-10s" % name + "".join(("%18.4fs" % per[m]) if m in per else "%19s" % "-" for m in modes))
    for subject in SUBJECTS:
        if subject not in modes:
            continue
        print("%s / mode (below 1: %s is faster)" % (subject, subject))
        for name, per in result["ratio"][subject].items():
            print("%-10s" % name + "".join(("%18.2fx" % per[m]) if m in per else "%19s" % "-" for m in modes))
    print("CPU seconds per task, the controller (ansible-playbook, its workers, the mux) and the guest's warm runner; "
          "in brackets the local plane and its agent, which stand in for the platform")
    for name, per in result["cpu_per_task_s"].items():
        print("%-10s" % name + "".join(("%19s" % ("%.4f (%.4f)" % (per[m]["ours"], per[m]["platform"]))) if m in per else "%19s" % "-"
                                       for m in modes))
    for subject in SUBJECTS:
        for name, per in result["cpu_per_task_s"].items():
            if subject in per and "mitogen_local" in per:
                print("CPU per task, %s / mitogen_local, %s: %.2fx" % (
                    subject, name, per[subject]["ours"] / per["mitogen_local"]["ours"]))
    print("load average at start / end: %.1f / %.1f" % (result["load_at_start"][0], result["load_at_end"][0]))
    for name, by_mode in result["served"].items():
        for mode, counts in by_mode.items():
            print("served by the mux, %s %s (all runs): %s" % (name, mode, ", ".join(
                "%s %d" % kv for kv in sorted(counts.items()))))


if __name__ == "__main__":
    sys.exit(main())
