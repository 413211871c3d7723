# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Where a warm task's time goes, hop by hop (issue 45): the 30 `command` tasks and the mix (20 `command`, 10 `copy`)
through the agent connection with the warm runner, on ansible-core 2.19 and the newest core (.venv-newest).

The runs set MICROVM_HOPS (see plugins/plugin_utils/_shared/hops.py): the worker, the mux (its own, started with
the switch) and the guest's warm runner stamp each request with time.time_ns(); bench/callbacks/microvm_ci_timing.py
gives each task's start (core queues it to a worker) and end (its result is back in the strategy). For each
`command` task, whose one request is a warm module run, the hops are:

  core, queue to plugin import   task start -> the worker starts importing the connection plugin (fork, TaskExecutor)
  plugin import                  the worker's import of plugins/connection/agent.py
  core, plugin to exec_command   Connection() made, the action plugin, the module's payload built (AnsiballZ)
  worker, to the attach          exec_command -> the worker attaches (decides warm, connects to the mux's socket)
  attach (a round trip)          the attach request (the session's settings) and its answer
  worker, attach to request      the answer read -> the warm request starts
  worker -> mux                  the request and its payload over the unix socket, read by the mux
  inside the mux                 payload in -> written to the runner's stream (runner lookup, RUNREF)
  mux -> runner                  gRPC over the port-forward's WebSocket, the agent, the runner's stdin
  runner, to the fork            the runner reads the request, checks the payload, forks
  module (fork to reaped)        the module's child: its run and exit, reaped by the runner
  runner -> mux                  EXIT over the agent, port-forward and gRPC back to the mux
  mux -> worker                  the mux's EXIT frame to the worker, read
  core, after the answer         the worker's result back in the strategy, the callbacks

Also the tasks' sum against the playbook's wall (what core does between tasks), each request kind's round trip
in the mix (warm, put, tmp) and what a copy task takes. Medians over the runs' tasks, in ms and as a share of the
task's median. Writes bench/results/hops.json and prints the table (Markdown, for docs/per-task.md).
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/hops_bench.py [--repeat 3]
       [--newest-venv .venv-newest]
"""
import argparse
import json
import os
import statistics
import sys

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import BIN, ROOT, playbook_text, run_playbook, write

from stage import Stage

HOPS = (  # (name, from, to): stamps as "side.name" (task: the callback; w: worker; m: mux; r: runner)
    ("core, queue to plugin import", "task.start", "w.import0"),
    ("plugin import", "w.import0", "w.import1"),
    ("core, plugin to exec_command", "w.import1", "w.call"),
    ("worker, to the attach", "w.call", "a.req"),
    ("attach (a round trip)", "a.req", "a.exit"),
    ("worker, attach to request", "a.exit", "w.req"),
    ("worker -> mux", "w.req", "m.payload"),
    ("inside the mux", "m.payload", "m.submitted"),
    ("mux -> runner", "m.submitted", "r.recv"),
    ("runner, to the fork", "r.recv", "r.forked"),
    ("module (fork to reaped)", "r.forked", "r.exit"),
    ("runner -> mux", "r.exit", "m.exit"),
    ("mux -> worker", "m.exit", "w.exit"),
    ("core, after the answer", "w.exit", "task.end"),
)
CALLBACKS = os.path.join(ROOT, "bench", "callbacks")


def read_lines(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tasks_of(timing, stamps):
    """Each task of one run: {"name", "stamps": {"task.start": ns, ...}, "requests": [(op, worker, mux)]}."""
    tasks = [{"name": t["task"], "stamps": {"task.start": int(t["start"] * 1e9), "task.end": int(t["end"] * 1e9)},
              "requests": []} for t in timing]
    mux = {s["hop"]: s for s in stamps if s["side"] == "mux"}

    def task_at(ns):
        for task in tasks:
            if task["stamps"]["task.start"] <= ns <= task["stamps"]["task.end"]:
                return task
        return None

    by_pid = {}  # a worker serves one task: its pid's stamps go to the task its first stamp falls in
    for s in stamps:
        if s["side"] != "worker":
            continue
        first = s.get("t0") or s.get("t") or s.get("req")
        task = by_pid.setdefault(s["pid"], task_at(first))
        if task is None:
            continue
        if s.get("event") == "import":
            task["stamps"]["w.import0"], task["stamps"]["w.import1"] = s["t0"], s["t1"]
        elif s.get("event") == "init":
            task["stamps"].setdefault("w.init", s["t"])
        elif s.get("event") == "call":
            task["stamps"].setdefault("w.call", s["t"])
        elif "hop" in s:
            task["requests"].append((s["op"], s, mux.get(s["hop"], {})))
    return tasks


def command_hops(task):
    """{hop: ms} of a task whose one request is a warm run, or None (a copy task, a cold run, stamps missing)."""
    attach = [r for r in task["requests"] if r[0] == "attach"]
    runs = [r for r in task["requests"] if r[0] != "attach"]
    if len(runs) != 1 or runs[0][0] != "warm" or len(attach) > 1:
        return None
    _op, worker, mux = runs[0]
    at = dict(task["stamps"])
    at["a.req"], at["a.exit"] = (attach[0][1]["req"], attach[0][1]["exit"]) if attach else (worker["req"], worker["req"])
    at.setdefault("w.import0", at.get("w.init"))  # the plugin already imported (a cached module): no import hop
    at.setdefault("w.import1", at.get("w.init"))
    at.update({"w.req": worker.get("req"), "w.exit": worker.get("exit")})
    at.update({"m." + k: v for k, v in mux.items() if k in ("payload", "submitted", "exit")})
    at.update({"r." + k: v for k, v in (mux.get("runner") or {}).items()})
    if any(at.get(a) is None or at.get(b) is None for _name, a, b in HOPS):
        return None
    return {name: (at[b] - at[a]) / 1e6 for name, a, b in HOPS}


def request_times(tasks):
    """{op: {"round_trip": [ms], "in_mux": [ms]}}: each request's worker round trip and its time in the mux."""
    out = {}
    for task in tasks:
        for op, worker, mux in task["requests"]:
            entry = out.setdefault(op, {"round_trip": [], "in_mux": []})
            entry["round_trip"].append((worker["exit"] - worker["req"]) / 1e6)
            if mux.get("out") and mux.get("in"):
                entry["in_mux"].append((mux["out"] - mux["in"]) / 1e6)
    return out


def measure(stage, tmp, playbook, inventory, bin_dir, repeat, label):
    """Warm-up run, then `repeat` timed runs with the stamps on: (tasks of every timed run, playbook walls)."""
    hops_file, timing = os.path.join(tmp, label + ".hops"), os.path.join(tmp, label + ".timing")
    env = stage.mux_env("hops-" + label, MICROVM_HOPS=hops_file, MICROVM_CI_TIMING=timing,
                        ANSIBLE_CALLBACK_PLUGINS=CALLBACKS, ANSIBLE_CALLBACKS_ENABLED="microvm_ci_timing")
    run_playbook(tmp, playbook, inventory, env, bin_dir)
    tasks, walls = [], []
    for _dummy in range(repeat):
        for path in (hops_file, timing):
            if os.path.exists(path):
                os.unlink(path)
        walls.append(run_playbook(tmp, playbook, inventory, env, bin_dir))
        tasks.extend(tasks_of(read_lines(timing), read_lines(hops_file)))
    return tasks, walls


def summarize(tasks, walls):
    hops = [h for h in (command_hops(t) for t in tasks) if h is not None]
    task_ms = [(t["stamps"]["task.end"] - t["stamps"]["task.start"]) / 1e6 for t in tasks]
    command_ms = [sum(h.values()) for h in hops]
    out = {"tasks": len(tasks), "command_tasks_stamped": len(hops),
           "playbook_wall_per_task_ms": round(statistics.median(walls) * 1000 / 30, 2),
           "task_median_ms": round(statistics.median(task_ms), 2),
           "between_tasks_ms": round(statistics.median(walls) * 1000 / 30 - statistics.mean(task_ms), 2)}
    if hops:
        median_task = statistics.median(command_ms)
        out["command_task_median_ms"] = round(median_task, 2)
        out["hops_ms"] = {name: round(statistics.median(h[name] for h in hops), 3) for name, _a, _b in HOPS}
        out["hops_share"] = {name: round(ms / median_task, 3) for name, ms in out["hops_ms"].items()}
    requests = request_times(tasks)
    out["requests_ms"] = {op: {"count_per_run": len(v["round_trip"]) // max(1, len(walls)),
                               "round_trip": round(statistics.median(v["round_trip"]), 3),
                               "in_mux": round(statistics.median(v["in_mux"]), 3) if v["in_mux"] else None}
                          for op, v in requests.items()}
    copies = [(t["stamps"]["task.end"] - t["stamps"]["task.start"]) / 1e6 for t in tasks if "copy" in t["name"]]
    if copies:
        out["copy_task_median_ms"] = round(statistics.median(copies), 2)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--newest-venv", default=os.path.join(ROOT, ".venv-newest"),
                        help="a venv with the newest supported ansible-core (skipped when missing)")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "hops.json"))
    args = parser.parse_args()
    cores = {"2.19": BIN}
    newest_bin = os.path.join(os.path.abspath(args.newest_venv), "bin")
    if os.path.exists(os.path.join(newest_bin, "ansible-playbook")):
        cores["newest"] = newest_bin
    stage = Stage("hopsbench")
    try:
        tmp = stage.tmp
        inventory = stage.inventory("agent", ansible_microvm_warm_runner="true")
        playbooks = {"command30": write(os.path.join(tmp, "command30.yml"), playbook_text(mixed=False)),
                     "mixed30": write(os.path.join(tmp, "mixed30.yml"), playbook_text(mixed=True))}
        result = {"repeat": args.repeat, "load_at_start": os.getloadavg(), "cores": {}, "figures": {}}
        for core, bin_dir in cores.items():
            result["cores"][core] = subprocess_version(bin_dir)
            for name, playbook in playbooks.items():
                tasks, walls = measure(stage, tmp, playbook, inventory, bin_dir, args.repeat, "%s-%s" % (name, core))
                result["figures"]["%s %s" % (name, core)] = summarize(tasks, walls)
        result["load_at_end"] = os.getloadavg()
        benchlib.save_json(args.output, result)
        report(result)
        print("wrote %s" % args.output)
    finally:
        stage.stop()
    return 0


def subprocess_version(bin_dir):
    import subprocess
    return subprocess.run([os.path.join(bin_dir, "python"), "-c", "import ansible.release as r; print(r.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def report(result):
    figures = result["figures"]
    commands = [k for k in figures if k.startswith("command30") and "hops_ms" in figures[k]]
    print("a warm `command` task, hop by hop: median ms (share of the task's median); ansible-core %s" % ", ".join(
        "%s = %s" % kv for kv in result["cores"].items()))
    print("| hop | " + " | ".join(commands) + " |\n|---|" + "---|" * len(commands))
    for name, _a, _b in HOPS:
        cells = ["%.2f (%.0f%%)" % (figures[k]["hops_ms"][name], 100 * figures[k]["hops_share"][name]) for k in commands]
        print("| %s | %s |" % (name, " | ".join(cells)))
    print("| the task (callback start to end) | " + " | ".join("%.2f" % figures[k]["command_task_median_ms"] for k in commands) + " |")
    print("| the playbook's wall / 30 | " + " | ".join("%.2f" % figures[k]["playbook_wall_per_task_ms"] for k in commands) + " |")
    for key, fig in figures.items():
        requests = ["%s x%d round trip %.2f ms (in the mux %s)" % (
            op, v["count_per_run"], v["round_trip"], "-" if v["in_mux"] is None else "%.2f ms" % v["in_mux"])
            for op, v in sorted(fig["requests_ms"].items())]
        print("%s: wall/30 %.2f ms, task %.2f ms, between tasks %.2f ms%s; requests: %s" % (
            key, fig["playbook_wall_per_task_ms"], fig["task_median_ms"], fig["between_tasks_ms"],
            ", copy task %.2f ms" % fig["copy_task_median_ms"] if "copy_task_median_ms" in fig else "", ", ".join(requests)))
    print("load average at start / end: %.1f / %.1f" % (result["load_at_start"][0], result["load_at_end"][0]))


if __name__ == "__main__":
    sys.exit(main())
