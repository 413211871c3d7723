"""Load bench (not a test): 50 sessions x 30 tasks with forks 25 through the agent connection, nothing lost.

Starts its own local control plane, creates SESSIONS sessions, runs one warm-up task on one host and then
on every host (opening each session's channel in the shared mux), then a 30-task playbook (20 `shell` tasks
that each append one numbered line to /workspace/load.txt, 10 `copy`) with --forks FORKS. Then checks every
session over REST: exactly the 20 lines in order and the 10 files, and exits 1 if any session lost or
repeated a task. Records the controller's memory (PSS and RSS summed over the collection's mux processes)
with one session open, with all of them, at its peak during the run and after it, and what each
additional session adds; and the plane's (its process, and its tree with the guests).
Prints the figures as a Markdown table (docs/guarantees.md, Load, quotes it) and writes bench/results/load.json.

Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/load_bench.py \
    [--sessions 50] [--forks 25] [--output FILE]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import (BIN, ROOT, PeakSampler, ansible_env, kib_per_additional_session, mib, playbook_argv, playbook_tree,
                      processes, timed_run, total, tree)

from microvm_load import TASKS, incomplete_sessions, inventory, load_playbook
from microvm_plane_testing import mux_pids, start_local_plane, stop_local_plane, stop_muxes


WARMUP = "- hosts: all\n  gather_facts: false\n  tasks:\n    - ansible.builtin.command: 'true'\n"


def snapshot(plane, mux_dir):
    """The controller's muxes and the plane (its own process; its tree, guests included), now."""
    return {"muxes": total(mux_pids(mux_dir)), "plane": total([plane.process.pid]),
            "plane_tree": total(tree(processes(), plane.process.pid))}


def load_groups(mux_dir):
    """The processes sampled during the run: the collection's muxes and the ansible-playbook tree."""
    def groups(procs):
        return {"muxes": mux_pids(mux_dir), "ansible_playbook_tree": playbook_tree(procs, "load.yml")}
    return groups


def report(result):
    """The figures as (name, value) rows, in the shape of docs/guarantees.md's Load table."""
    sessions, tasks = result["sessions"], result["tasks"]
    rows = [("sessions x tasks (forks)",
             "%d x %d (%d) = %d host-tasks" % (sessions, tasks, result["forks"], result["tasks_total"])),
            ("playbook rc / every recap `ok=%d unreachable=0 failed=0`" % tasks,
             "%s / %s" % (result["rc"], "yes" if result["recap_all_ok"] else "no")),
            ("sessions with exactly the %d lines in order and the %d files" % (result["commands"], tasks - result["commands"]),
             "%d/%d%s" % (result["sessions_complete"], sessions,
                          "" if result["sessions_bad"] else " (nothing lost, nothing run twice)")),
            ("create + READY of all %d sessions" % sessions, "%.1f s" % result["create_all_s"]),
            ("warm-up, 1 task per host (opens %d links)" % sessions, "%.1f s" % result["warmup_s"]),
            ("%d-task run" % tasks, "%.0f s (%.0f ms per host-task)" % (result["run_s"], result["per_task_ms"]))]
    stages = (result["muxes_one_session"], result["after_warmup"]["muxes"], result["peak_during_run"]["muxes"],
              result["after_run"]["muxes"])
    rows += [("controller: the collection's mux processes", "%d" % result["after_warmup"]["muxes"]["processes"]),
             ("controller: muxes PSS, 1 session / all warm / peak in the run / after",
              " / ".join(mib(x["pss_kib"]) for x in stages)),
             ("controller: muxes RSS, 1 session / all warm / peak in the run / after",
              " / ".join(mib(x["rss_kib"]) for x in stages)),
             ("controller: largest mux RSS, warm / after",
              "%s / %s" % (mib(stages[1]["largest_rss_kib"]), mib(stages[3]["largest_rss_kib"]))),
             ("controller: each additional session adds (PSS)", "%.0f KiB" % result["mux_kib_per_additional_session"]),
             ("controller: ansible-playbook and its workers, peak PSS",
              mib(result["peak_during_run"]["ansible_playbook_tree"]["pss_kib"]))]
    for key, name in (("plane", "plane process RSS"), ("plane_tree", "plane + guests (its process tree) RSS")):
        rows.append(("%s: before / warm / after" % name, " / ".join(
            mib(result[k][key]["rss_kib"]) for k in ("plane_before", "after_warmup", "after_run"))))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=50)
    ap.add_argument("--forks", type=int, default=25)
    ap.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "load.json"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="load-bench-")
    state = os.path.join(work, "plane")
    os.makedirs(state)
    mux_dir = os.path.join(work, "mux")
    plane = start_local_plane(state)
    client = plane.client()
    result = {"sessions": args.sessions, "tasks": TASKS, "forks": args.forks}
    try:
        t = time.monotonic()
        ids = [client.create_session({"name": "load-%02d-%s" % (i, os.urandom(3).hex()), "agent": "custom"})["session_id"]
               for i in range(args.sessions)]
        for sid in ids:
            client.wait_session(sid, timeout=300)
        result["create_all_s"] = round(time.monotonic() - t, 2)
        result["plane_before"] = snapshot(plane, mux_dir)
        inv = os.path.join(work, "inventory.ini")
        with open(inv, "w") as f:
            f.write(inventory(ids))
        text, n_cmd = load_playbook()
        result["commands"] = n_cmd
        with open(os.path.join(work, "load.yml"), "w") as f:
            f.write(text)
        with open(os.path.join(work, "warmup.yml"), "w") as f:
            f.write(WARMUP)
        env = ansible_env(plane, mux_dir, 600, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
        forks = ("--forks", str(args.forks))
        # one session's link first: what a mux process costs by itself, to tell the per-session cost apart
        warm, _seconds = timed_run(playbook_argv(inv, "warmup.yml", "--limit", "s00"), env, work)
        if warm.returncode != 0:
            raise SystemExit("warm-up of one session failed:\n" + warm.stdout[-4000:] + warm.stderr[-2000:])
        result["muxes_one_session"] = total(mux_pids(mux_dir))
        warm, result["warmup_s"] = timed_run(playbook_argv(inv, "warmup.yml", *forks), env, work)
        if warm.returncode != 0:
            raise SystemExit("warm-up failed:\n" + warm.stdout[-4000:] + warm.stderr[-2000:])
        result["after_warmup"] = snapshot(plane, mux_dir)
        result["mux_kib_per_additional_session"] = kib_per_additional_session(
            result["muxes_one_session"], result["after_warmup"]["muxes"], args.sessions)
        with PeakSampler(load_groups(mux_dir)) as sampler:
            proc, result["run_s"] = timed_run(playbook_argv(inv, "load.yml", *forks), env, work)
        result["peak_during_run"] = sampler.peak
        result["rc"] = proc.returncode
        result["after_run"] = snapshot(plane, mux_dir)
        recap = [line for line in proc.stdout.splitlines() if "ok=" in line and "failed=" in line]
        result["recap_all_ok"] = len(recap) == args.sessions and all(
            "ok=%d " % TASKS in line and "unreachable=0" in line and "failed=0" in line for line in recap)
        bad = incomplete_sessions(client, ids, n_cmd)  # nothing lost, nothing run twice
        result["sessions_complete"] = args.sessions - len(bad)
        result["sessions_bad"] = bad
        result["tasks_total"] = args.sessions * TASKS
        result["per_task_ms"] = round(1000 * result["run_s"] / result["tasks_total"], 1)
    finally:
        stop_muxes(mux_dir)
        stop_local_plane(plane)
        shutil.rmtree(work, ignore_errors=True)

    rows = report(result)
    benchlib.print_markdown(rows)
    print("wrote %s" % benchlib.save_json(args.output, result, sort_keys=True))
    return 0 if result["rc"] == 0 and not result["sessions_bad"] and result["recap_all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
