"""Load bench (not a test): 50 sessions x 30 tasks with forks 25 through the agent connection, nothing lost.

Starts its own local control plane, creates SESSIONS sessions, runs one warm-up task per host
(opening each session's channel in the shared mux), then a 30-task playbook (20 `shell` tasks that each append one
numbered line to /workspace/load.txt, 10 `copy`) with --forks FORKS. Then checks every session over
REST: exactly the 20 lines in order and the 10 files. Records the RSS of the plane process (and of
its whole process tree: guests included) and of all the muxes, after the warm-up and after the run.
Prints a table and writes bench/results/load.json.

Usage: PYTHONPATH=.local/collections:localplane .venv/bin/python bench/load_bench.py [--sessions 50] [--forks 25] [--output FILE]
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import BIN, ROOT, ansible_env, playbook_argv, timed_run

from microvm_plane_testing import mux_pids, start_local_plane, stop_local_plane, stop_muxes

TASKS = 30


def playbook():
    lines = ["- hosts: all", "  gather_facts: false", "  tasks:"]
    n_cmd = 0
    for n in range(TASKS):
        if n % 3 == 2:
            lines.append('    - ansible.builtin.copy: {content: "file %d\\n", dest: /workspace/load/f%d.txt}' % (n, n))
        else:
            lines.append('    - ansible.builtin.shell: "mkdir -p /workspace/load && echo %d >> /workspace/load.txt"' % n_cmd)
            n_cmd += 1
    return "\n".join(lines) + "\n", n_cmd


WARMUP = "- hosts: all\n  gather_facts: false\n  tasks:\n    - ansible.builtin.command: 'true'\n"


def rss_kib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree(pid):
    """pid and all its descendants."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open("/proc/%s/stat" % d) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def snapshot(plane, mux_dir):
    muxes = mux_pids(mux_dir)
    per_mux = [rss_kib(p) for p in muxes]
    return {"plane_rss_kib": rss_kib(plane.process.pid),
            "plane_tree_rss_kib": sum(rss_kib(p) for p in tree(plane.process.pid)),
            "muxes": len(muxes), "muxes_rss_kib_total": sum(per_mux),
            "mux_rss_kib_max": max(per_mux) if per_mux else 0}


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
            f.write("[all]\n" + "".join("s%02d ansible_host=%s\n" % (i, sid) for i, sid in enumerate(ids)))
            f.write("\n[all:vars]\nansible_connection=microvm.sandbox.agent\nansible_python_interpreter=/usr/bin/python3\n")
        text, n_cmd = playbook()
        with open(os.path.join(work, "load.yml"), "w") as f:
            f.write(text)
        with open(os.path.join(work, "warmup.yml"), "w") as f:
            f.write(WARMUP)
        env = ansible_env(plane, mux_dir, 600, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
        forks = ("--forks", str(args.forks))
        warm, result["warmup_s"] = timed_run(playbook_argv(inv, "warmup.yml", *forks), env, work)
        if warm.returncode != 0:
            raise SystemExit("warm-up failed:\n" + warm.stdout[-4000:] + warm.stderr[-2000:])
        result["after_warmup"] = snapshot(plane, mux_dir)
        proc, result["run_s"] = timed_run(playbook_argv(inv, "load.yml", *forks), env, work)
        result["rc"] = proc.returncode
        result["after_run"] = snapshot(plane, mux_dir)
        recap = [line for line in proc.stdout.splitlines() if "ok=" in line and "failed=" in line]
        result["recap_all_ok"] = len(recap) == args.sessions and all(
            "ok=%d " % TASKS in line and "unreachable=0" in line and "failed=0" in line for line in recap)
        # nothing lost, nothing run twice
        want = "".join("%d\n" % i for i in range(n_cmd))
        bad = []
        for sid in ids:
            got = client.request("POST", "/sessions/%s/sandbox/exec" % sid,
                                 body={"argv": ["sh", "-c", "cat /workspace/load.txt; ls /workspace/load | wc -l"]})
            if got.get("stdout") != want + "%d\n" % (TASKS - n_cmd):
                bad.append(sid)
        result["sessions_complete"] = args.sessions - len(bad)
        result["sessions_bad"] = bad
        result["tasks_total"] = args.sessions * TASKS
        result["per_task_ms"] = round(1000 * result["run_s"] / result["tasks_total"], 1)
    finally:
        stop_muxes(mux_dir)
        stop_local_plane(plane)
        shutil.rmtree(work, ignore_errors=True)

    rows = [("sessions x tasks (forks)", "%d x %d (%d)" % (args.sessions, TASKS, args.forks)),
            ("playbook rc / recap all ok", "%s / %s" % (result["rc"], result["recap_all_ok"])),
            ("sessions complete (exact lines + files)", "%d/%d" % (result["sessions_complete"], args.sessions)),
            ("create + READY, all sessions", "%.1f s" % result["create_all_s"]),
            ("warm-up (1 task/host)", "%.1f s" % result["warmup_s"]),
            ("30-task run", "%.1f s (%.0f ms per host-task)" % (result["run_s"], result["per_task_ms"]))]
    for key, label in (("plane_rss_kib", "plane RSS"), ("plane_tree_rss_kib", "plane + guests RSS"),
                       ("muxes_rss_kib_total", "muxes RSS total"), ("mux_rss_kib_max", "largest mux RSS")):
        rows.append(("%s: before / warm / after" % label, "%.1f / %.1f / %.1f MiB" % tuple(
            result[k].get(key, 0) / 1024 for k in ("plane_before", "after_warmup", "after_run"))))
    benchlib.print_rows(rows)
    benchlib.save_json(args.output, result, sort_keys=True)
    return 0 if result["rc"] == 0 and not result["sessions_bad"] and result["recap_all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
