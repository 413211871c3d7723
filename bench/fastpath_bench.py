# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark of the warm module runner (option warm_runner) of the microvm.sandbox.agent connection.

Two playbooks, 30 `command` tasks and the 30-task mix (20 `command`, 10 `copy`), through
  - the agent connection with the warm runner off (plain pipelined exec, a fresh python3 per module),
  - the agent connection with the warm runner on,
  - `connection: local`,
  - `connection: ssh` to a private sshd on 127.0.0.1 with ControlPersist and pipelining,
  - with --mitogen-venv DIR (a venv with ansible-core and mitogen), under Mitogen's mitogen_linear strategy:
    over SSH to the same sshd, and `connection: local` (Mitogen has no transport for the sandbox agent;
    local is its best case, with no network at all),
each warmed up once (mux, runner, ControlMaster started) and then timed REPEAT times, interleaved.

Prints per-task medians and writes bench/results/fastpath.json.
Usage: PYTHONPATH=.local/collections:localplane .venv/bin/python bench/fastpath_bench.py [--repeat 3]
"""
import argparse
import os
import statistics
import subprocess
import sys

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import BIN, ROOT, playbook_text, run_playbook, write

from stage import Stage

MODES = ("agent_cold", "agent_warm", "local", "ssh", "mitogen_ssh", "mitogen_local")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mitogen-venv", help="a venv with ansible-core and mitogen installed")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "fastpath.json"))
    args = parser.parse_args()
    if args.mitogen_venv:  # the playbooks run in a temporary dir: a relative venv path would not be found there
        args.mitogen_venv = os.path.abspath(args.mitogen_venv)

    stage = Stage("fastbench")
    try:
        tmp, env = stage.tmp, stage.env
        playbooks = {"command30": write(os.path.join(tmp, "command30.yml"), playbook_text(mixed=False)),
                     "mixed30": write(os.path.join(tmp, "mixed30.yml"), playbook_text(mixed=True))}
        inventories = {
            "agent_cold": stage.inventory("agent", ansible_microvm_warm_runner="false"),
            "agent_warm": stage.inventory("agent", ansible_microvm_warm_runner="true"),
            "local": stage.inventory("local"),
            "ssh": stage.inventory("ssh"),
        }
        runners = {mode: (env, BIN) for mode in inventories}
        if args.mitogen_venv:
            found = subprocess.run([os.path.join(args.mitogen_venv, "bin", "python"), "-c",
                                    "import ansible_mitogen, os; print(os.path.dirname(ansible_mitogen.__file__))"],
                                   capture_output=True, text=True, check=True).stdout.strip()
            mitogen_env = dict(env, ANSIBLE_STRATEGY_PLUGINS=os.path.join(found, "plugins", "strategy"),
                               ANSIBLE_STRATEGY="mitogen_linear")
            mitogen_env.pop("PYTHONPATH", None)
            for mode, base in (("mitogen_ssh", "ssh"), ("mitogen_local", "local")):
                inventories[mode] = inventories[base]
                runners[mode] = (mitogen_env, os.path.join(args.mitogen_venv, "bin"))
        result = {"repeat": args.repeat, "per_task_s": {}, "runs_s": {}}
        for name, playbook in playbooks.items():
            for mode in inventories:  # warm-up: the mux and the warm runner come up here
                run_playbook(tmp, playbook, inventories[mode], *runners[mode])
            times = {mode: [] for mode in inventories}
            modes = list(inventories)
            for i in range(args.repeat):
                order = modes[i % len(modes):] + modes[:i % len(modes)]  # interleave against drift
                for mode in order:
                    times[mode].append(run_playbook(tmp, playbook, inventories[mode], *runners[mode]))
            result["runs_s"][name] = {mode: [round(t, 3) for t in ts] for mode, ts in times.items()}
            result["per_task_s"][name] = {mode: round(statistics.median(ts) / 30, 4) for mode, ts in times.items()}
        result["warm_ratio_to"] = {name: {mode: round(per["agent_warm"] / per[mode], 3) for mode in per}
                                   for name, per in result["per_task_s"].items()}
        benchlib.save_json(args.output, result, sort_keys=True)
        print("seconds per task (median run / 30); the ratio is agent_warm / mode, below 1 means agent_warm is faster")
        print("%-10s" % "playbook" + "".join("%15s" % m for m in MODES))
        for name, per in result["per_task_s"].items():
            print("%-10s" % name + "".join(("%14.3fs" % per[m]) if m in per else "%15s" % "-" for m in MODES))
            print("%-10s" % "" + "".join(("%14.2fx" % (per["agent_warm"] / per[m])) if m in per else "%15s" % "-"
                                         for m in MODES))
        print("wrote %s" % args.output)
    finally:
        stage.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
