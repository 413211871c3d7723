"""Benchmark of microvm.sandbox.sync against rsync over SSH and ansible.builtin.copy, side by side in one run
(not a timed test).

Trees: 500 files (20 directories of 25) and 10,000 files (100 of 100), 1-4 KiB each. For each tree, with and
without delete: the first sync into an empty destination, a sync with nothing changed, and a sync after one file
changed (with delete, one more file removed); then a pull of the same tree out, the same three ways.
- sync:  `ansible-playbook` running one microvm.sandbox.sync task through the agent connection to a local-plane
         sandbox, Ansible's own start-up included (the session's mux is warm, as in any play after its first task);
         and the task's own time ("sync task", from its -vvv timing line: guest command start to the end);
- rsync: `rsync -a [--delete]` over SSH to a private sshd on 127.0.0.1 (ControlPersist warm), the tool
         ansible.posix.synchronize runs;
- synchronize: `ansible-playbook` running ansible.posix.synchronize (rsync over SSH, the same sshd and ControlPersist)
         to that sshd, Ansible's own start-up included: the peer a playbook user would otherwise reach for. Its
         collection is unpacked from the `ansible` release pinned in bench/requirements-synchronize.txt;
- copy:  `ansible-playbook` running ansible.builtin.copy of the directory through the agent connection (500-file
         tree only by default: it takes a module run per file; --copy-large times the 10,000-file tree too).
With --big, a 50,000-file tree plus --big-gib GiB in large files is pushed and pulled once, and the peak memory
(VmHWM) of the processes involved is reported: the session's mux and the ansible-playbook process tree.

Prints a table with ratios to synchronize and rsync, and writes bench/results/sync.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/sync_bench.py [--repeat 3] [--big]
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import ROOT, playbook_argv, timed_run, write

from stage import Stage

from microvm_plane_testing import mux_pids

SYNC_PLAY = """
- hosts: target
  gather_facts: false
  tasks:
    - microvm.sandbox.sync:
        mode: {mode}
        src: "{src}"
        dest: "{dest}"
        delete: {delete}
"""
COPY_PLAY = """
- hosts: target
  gather_facts: false
  tasks:
    - ansible.builtin.copy:
        src: "{src}/"
        dest: "{dest}/"
"""
SYNCHRONIZE_PLAY = """
- hosts: target
  gather_facts: false
  tasks:
    - ansible.posix.synchronize:
        mode: {mode}
        src: "{src}/"
        dest: "{dest}/"
        delete: {delete}
        use_ssh_args: true
"""
TASK_TIME = re.compile(r"SYNC (?:done|applied) after ([0-9.]+)s")
NOOP_PLAY = """
- hosts: target
  gather_facts: false
  tasks:
    - ansible.builtin.debug: {msg: start-up only}
"""


def make_tree(root, files, per_dir, big_files=0, big_bytes=0):
    for i in range(files):
        d = os.path.join(root, "dir%03d" % (i // per_dir))
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "file%05d.txt" % i), "wb") as f:
            f.write(os.urandom(1024 + (i * 37) % 3072))
    for i in range(big_files):
        with open(os.path.join(root, "big%d.bin" % i), "wb") as f:
            for _mib in range(big_bytes >> 20):
                f.write(os.urandom(1 << 20))


def change_one(root, delete_one):
    """One file gets new content (and a new mtime); with delete_one, another file goes."""
    target = os.path.join(root, "dir000", "file00000.txt")
    with open(target, "ab") as f:
        f.write(b"changed %f\n" % time.time())
    os.utime(target, (time.time() + 5, time.time() + 5))
    if delete_one:
        gone = os.path.join(root, "dir000", "file00001.txt")
        if os.path.exists(gone):
            os.unlink(gone)


class Bench:
    def __init__(self, stage, repeat):
        self.stage = stage
        self.repeat = repeat
        self.env = stage.env
        self.inventory = stage.inventory("agent")
        self.ssh_inventory = stage.inventory("ssh")
        posix_path = "%s:%s" % (benchlib.COLLECTIONS, benchlib.posix_collection())
        self.posix_env = dict(self.env, ANSIBLE_COLLECTIONS_PATH=posix_path)
        self.rsync_ssh = "ssh -p %d %s" % (stage.sshd.port, " ".join(stage.sshd.options))
        self.client = stage.plane.client()
        self.n = 0
        self.task_seconds = []

    def guest(self, script):
        res = self.client.request("POST", "/sessions/%s/sandbox/exec" % self.stage.session["session_id"],
                                  body={"argv": ["sh", "-c", script]})
        if res["exit_code"] != 0:
            raise RuntimeError("guest command failed: %s" % res)
        return res["stdout"]

    def play(self, text, *options, inventory=None, env=None):
        """Seconds of one ansible-playbook run (and its stdout)."""
        self.n += 1
        name = "play-%d.yml" % self.n
        write(self.stage.path(name), text)
        proc, elapsed = timed_run(playbook_argv(inventory or self.inventory, name, *options), env or self.env,
                                  self.stage.tmp)
        if proc.returncode != 0 or "failed=0" not in proc.stdout:
            raise RuntimeError("playbook failed:\n%s\n%s" % (proc.stdout[-3000:], proc.stderr[-2000:]))
        return elapsed, proc.stdout

    def sync(self, mode, src, dest, delete):
        """Seconds of the whole ansible-playbook run; the sync task's own seconds go to self.task_seconds."""
        elapsed, out = self.play(SYNC_PLAY.format(mode=mode, src=src, dest=dest, delete=str(delete).lower()), "-vvv")
        found = TASK_TIME.findall(out)
        self.task_seconds.append(float(found[-1]) if found else float("nan"))
        return elapsed

    def synchronize(self, mode, src, dest, delete):
        """Seconds of ansible-playbook running ansible.posix.synchronize (rsync over SSH) to the private sshd."""
        return self.play(SYNCHRONIZE_PLAY.format(mode=mode, src=src, dest=dest, delete=str(delete).lower()),
                         inventory=self.ssh_inventory, env=self.posix_env)[0]

    def copy(self, src, dest):
        return self.play(COPY_PLAY.format(src=src, dest=dest))[0]

    @staticmethod
    def rsync(src, dest, delete, ssh, pull=False):
        argv = ["rsync", "-a"] + (["--delete"] if delete else []) + ["-e", ssh]
        remote = "root@127.0.0.1:%s/" % dest if not pull else "root@127.0.0.1:%s/" % src
        argv += [src + "/", remote] if not pull else [remote, dest + "/"]
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        return time.perf_counter() - start

    def push_case(self, label, tree, delete, with_copy):
        """first / unchanged / one changed, each timed `repeat` times on fresh copies of the tree."""
        times = {}
        for r in range(self.repeat):
            src = self.stage.path("%s-src-%d" % (label, r))
            shutil.rmtree(src, ignore_errors=True)
            shutil.copytree(tree, src, symlinks=True)
            dests = {"sync": "/workspace/%s-%d" % (label, r), "rsync": os.path.join(self.stage.ssh_dir, "%s-%d" % (label, r)),
                     "synchronize": os.path.join(self.stage.ssh_dir, "%s-synchronize-%d" % (label, r)),
                     "copy": "/workspace/%s-copy-%d" % (label, r)}
            runners = {"sync": lambda s=src, d=dests["sync"]: self.sync("push", s, d, delete),
                       "rsync": lambda s=src, d=dests["rsync"]: self.rsync(s, d, delete, self.rsync_ssh),
                       "synchronize": lambda s=src, d=dests["synchronize"]: self.synchronize("push", s, d, delete)}
            if with_copy:
                runners["copy"] = lambda s=src, d=dests["copy"]: self.copy(s, d)
            for step in ("first", "unchanged", "one_changed"):
                if step == "one_changed":
                    change_one(src, delete)
                for tool, run in runners.items():
                    times.setdefault(step, {}).setdefault(tool, []).append(run())
                    if tool == "sync":
                        times[step].setdefault("sync_task", []).append(self.task_seconds[-1])
            self.guest("rm -rf %s %s" % (dests["sync"], dests["copy"]))
            shutil.rmtree(dests["rsync"], ignore_errors=True)
            shutil.rmtree(dests["synchronize"], ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
        return times

    def pull_case(self, label, tree):
        """The tree pushed once, then pulled out: first / unchanged / one changed (in the sandbox)."""
        times = {}
        src_guest = "/workspace/%s-pullsrc" % label
        src_ssh = os.path.join(self.stage.ssh_dir, "%s-pullsrc" % label)
        self.sync("push", tree, src_guest, False)
        shutil.copytree(tree, src_ssh, symlinks=True)
        for r in range(self.repeat):
            outs = {tool: self.stage.path("%s-out-%s-%d" % (label, tool, r)) for tool in ("sync", "rsync", "synchronize")}
            runners = {"sync": lambda d=outs["sync"]: self.sync("pull", src_guest, d, True),
                       "rsync": lambda d=outs["rsync"]: self.rsync(src_ssh, d, True, self.rsync_ssh, pull=True),
                       "synchronize": lambda d=outs["synchronize"]: self.synchronize("pull", src_ssh, d, True)}
            for step in ("first", "unchanged", "one_changed"):
                if step == "one_changed":
                    self.guest("echo changed-%d >> %s/dir000/file00000.txt" % (r, src_guest))
                    change_one(src_ssh, False)
                for tool, run in runners.items():
                    times.setdefault(step, {}).setdefault(tool, []).append(run())
                    if tool == "sync":
                        times[step].setdefault("sync_task", []).append(self.task_seconds[-1])
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
        self.guest("rm -rf %s" % src_guest)
        shutil.rmtree(src_ssh, ignore_errors=True)
        return times

    def noop(self):
        return statistics.median([self.play(NOOP_PLAY)[0] for _dummy in range(self.repeat)])


def vm_hwm(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def big_case(bench, gib):
    """50,000 files and `gib` GiB pushed and pulled once; peak memory of the mux and of ansible-playbook's tree."""
    tree = bench.stage.path("big-tree")
    make_tree(tree, 50_000, 500, big_files=max(1, gib * 2), big_bytes=512 << 20)
    out = {}
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out["push_seconds"] = bench.sync("push", tree, "/workspace/big", True)
    out["push_unchanged_seconds"] = bench.sync("push", tree, "/workspace/big", True)
    out["pull_seconds"] = bench.sync("pull", "/workspace/big", bench.stage.path("big-out"), True)
    out["controller_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    out["controller_peak_rss_before_bytes"] = before_children * 1024
    pids = mux_pids(bench.stage.mux_dir)
    out["mux_peak_rss_bytes"] = max([vm_hwm(p) or 0 for p in pids] or [0])
    out["tree"] = {"files": 50_000 + max(1, gib * 2), "bytes": sum(
        os.path.getsize(os.path.join(d, f)) for d, _s, fs in os.walk(tree) for f in fs)}
    bench.guest("rm -rf /workspace/big")
    shutil.rmtree(tree, ignore_errors=True)
    shutil.rmtree(bench.stage.path("big-out"), ignore_errors=True)
    return out


def summarise(times):
    return {step: {tool: statistics.median(runs) for tool, runs in tools.items()} for step, tools in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copy-large", action="store_true", help="also time ansible.builtin.copy of 10,000 files")
    parser.add_argument("--big", action="store_true", help="also push and pull 50,000 files and --big-gib GiB once")
    parser.add_argument("--big-gib", type=int, default=2)
    parser.add_argument("--big-only", action="store_true", help="with --big: only the big case, not the tables")
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "sync.json"))
    args = parser.parse_args()

    stage = Stage("syncbench")
    try:
        bench = Bench(stage, args.repeat)
        trees = {"500": stage.path("tree-500"), "10000": stage.path("tree-10000")}
        make_tree(trees["500"], 500, 25)
        make_tree(trees["10000"], 10_000, 100)
        bench.sync("push", trees["500"], "/workspace/warmup", False)  # the mux comes up here
        bench.rsync(trees["500"], os.path.join(stage.ssh_dir, "warmup"), False, bench.rsync_ssh)  # and the ControlMaster
        results = {"repeat": args.repeat, "ansible_noop_playbook_seconds": bench.noop(), "cases": {}}
        for size, tree in ({} if args.big and args.big_only else trees).items():
            for delete in (False, True):
                label = "push-%s%s" % (size, "-delete" if delete else "")
                with_copy = size == "500" or args.copy_large
                results["cases"][label] = summarise(bench.push_case(label, tree, delete, with_copy and not delete))
                print(label, json.dumps(results["cases"][label]), flush=True)
            label = "pull-%s" % size
            results["cases"][label] = summarise(bench.pull_case(label, tree))
            print(label, json.dumps(results["cases"][label]), flush=True)
        # peak memory after the 10,000-file runs: the session's mux, and the largest ansible-playbook process
        results["peak_rss_bytes"] = {
            "mux": max([vm_hwm(p) or 0 for p in mux_pids(stage.mux_dir)] or [0]),
            "largest_child_process": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}
        if args.big:
            results["big"] = big_case(bench, args.big_gib)
            print("big", json.dumps(results["big"]), flush=True)
        results["machine"] = {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()}
        results["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        print()
        print("seconds, median of %d (sync and copy: a whole ansible-playbook run; a no-op playbook takes %.2f s)"
              % (args.repeat, results["ansible_noop_playbook_seconds"]))
        print("  %-18s %-12s %6s %9s %6s %11s %6s %10s %10s %10s" % (
            "case", "step", "sync", "sync task", "rsync", "synchronize", "copy", "sync/synch", "sync/rsync",
            "task/rsync"))
        for label, steps in results["cases"].items():
            for step, tools in steps.items():
                copy = tools.get("copy")
                print("  %-18s %-12s %6.2f %9.2f %6.2f %11.2f %6s %9.2fx %9.2fx %9.2fx" % (
                    label, step, tools["sync"], tools["sync_task"], tools["rsync"], tools["synchronize"],
                    "%.2f" % copy if copy is not None else "-", tools["sync"] / tools["synchronize"],
                    tools["sync"] / tools["rsync"], tools["sync_task"] / tools["rsync"]))
        print("peak RSS: mux %.0f MiB, largest ansible-playbook process (or rsync/ssh) %.0f MiB" % (
            results["peak_rss_bytes"]["mux"] / 2.0 ** 20, results["peak_rss_bytes"]["largest_child_process"] / 2.0 ** 20))
        print("wrote %s" % benchlib.save_json(args.output, results))
    finally:
        stage.stop()


if __name__ == "__main__":
    main()
