# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark of the warm module runner (option warm_runner) of the microvm.sandbox.agent connection.

Two playbooks, 30 `command` tasks and the 30-task mix (20 `command`, 10 `copy`), through
  - the agent connection with the warm runner off (plain pipelined exec, a fresh python3 per module),
  - the agent connection with the warm runner on,
  - `connection: local`,
  - with --mitogen-venv DIR (a venv with ansible-core and mitogen): `connection: local` under Mitogen's
    mitogen_linear strategy (Mitogen has no transport for the sandbox agent, so local is its best case),
each warmed up once (mux and runner started) and then timed REPEAT times, interleaved.

Prints per-task medians and writes bench/results/fastpath.json.
Usage: PYTHONPATH=.local/collections:localplane .venv/bin/python bench/fastpath_bench.py [--repeat 3]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIONS = os.path.join(ROOT, ".local", "collections")
for p in (COLLECTIONS, os.path.join(ROOT, "localplane")):
    if p not in sys.path:
        sys.path.insert(0, p)

from microvm_localplane.testing import start_local_plane, stop_local_plane  # noqa: E402

BIN = os.path.dirname(sys.executable)
PLAYBOOK = """
- hosts: target
  gather_facts: false
  tasks:
{tasks}
"""
COMMAND_TASK = "    - ansible.builtin.command: echo {n}\n"
COPY_TASK = "    - ansible.builtin.copy: {{content: \"file {n}\\n\", dest: \"{{{{ dest_dir }}}}/f{n}.txt\"}}\n"


def playbook_text(mixed):
    tasks = []
    for n in range(30):
        tasks.append(COPY_TASK.format(n=n) if mixed and n % 3 == 2 else COMMAND_TASK.format(n=n))
    return PLAYBOOK.format(tasks="".join(tasks))


def run_playbook(workdir, playbook, inventory, env, bin_dir=BIN):
    start = time.perf_counter()
    proc = subprocess.run([os.path.join(bin_dir, "ansible-playbook"), "-i", inventory, playbook], cwd=workdir,
                          env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0 or "failed=0" not in proc.stdout:
        raise RuntimeError("playbook failed (%s):\n%s\n%s" % (inventory, proc.stdout[-3000:], proc.stderr[-2000:]))
    return elapsed


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--mitogen-venv", help="a venv with ansible-core and mitogen installed")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "fastpath.json"))
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="fastbench-")
    plane = None
    try:
        os.makedirs(os.path.join(tmp, "plane"))
        plane = start_local_plane(os.path.join(tmp, "plane"))
        client = plane.client()
        session = client.wait_session(client.create_session({"name": "fastbench", "agent": "none"})["session_id"],
                                      timeout=120)
        local_dir = os.path.join(tmp, "local-dest")
        os.makedirs(local_dir)
        env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS, ANSIBLE_NOCOLOR="1", ANSIBLE_HOST_KEY_CHECKING="0",
                   ANSIBLE_RETRY_FILES_ENABLED="0", MICROVM_MUX_DIR=os.path.join(tmp, "mux"), MICROVM_PERSIST="300",
                   **plane.env)
        env["PYTHONPATH"] = COLLECTIONS
        playbooks = {"command30": write(os.path.join(tmp, "command30.yml"), playbook_text(False)),
                     "mixed30": write(os.path.join(tmp, "mixed30.yml"), playbook_text(True))}
        agent = ("target ansible_host=%s ansible_connection=microvm.sandbox.agent ansible_python_interpreter=/usr/bin/python3 "
                 "dest_dir=/workspace ansible_microvm_warm_runner=%s\n")
        inventories = {
            "agent_cold": write(os.path.join(tmp, "cold.ini"), agent % (session["name"], "false")),
            "agent_warm": write(os.path.join(tmp, "warm.ini"), agent % (session["name"], "true")),
            "local": write(os.path.join(tmp, "local.ini"),
                           "target ansible_connection=local ansible_python_interpreter=/usr/bin/python3 "
                           "dest_dir=%s\n" % local_dir),
        }
        runners = {mode: (env, BIN) for mode in inventories}
        if args.mitogen_venv:
            found = subprocess.run([os.path.join(args.mitogen_venv, "bin", "python"), "-c",
                                    "import ansible_mitogen, os; print(os.path.dirname(ansible_mitogen.__file__))"],
                                   capture_output=True, text=True, check=True).stdout.strip()
            mitogen_env = dict(env, ANSIBLE_STRATEGY_PLUGINS=os.path.join(found, "plugins", "strategy"),
                               ANSIBLE_STRATEGY="mitogen_linear")
            mitogen_env.pop("PYTHONPATH", None)
            inventories["mitogen_local"] = inventories["local"]
            runners["mitogen_local"] = (mitogen_env, os.path.join(args.mitogen_venv, "bin"))
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
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2, sort_keys=True)
        print("%-10s %12s %12s %12s %14s %10s" % ("playbook", "agent cold", "agent warm", "local", "mitogen local",
                                                  "warm/cold"))
        for name, per in result["per_task_s"].items():
            mito = ("%13.3fs" % per["mitogen_local"]) if "mitogen_local" in per else "%14s" % "-"
            row = (name, per["agent_cold"], per["agent_warm"], per["local"], mito, per["agent_warm"] / per["agent_cold"])
            print("%-10s %11.3fs %11.3fs %11.3fs %s %9.2fx" % row)
        print("wrote %s" % args.output)
    finally:
        if plane is not None:
            stop_local_plane(plane)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
