"""Fleet bench (not a test): one controller, many sandboxes, against SSH to as many hosts, in one run.

Starts its own local control plane with SESSIONS sessions and a private sshd, then runs the same
10-task playbook (7 `command`, 3 `copy`) with --forks FORKS
  - through `connection: microvm.sandbox.agent` to the SESSIONS sessions (the shared multiplexer),
  - through `connection: ssh` with ControlPersist and pipelining to SESSIONS inventory aliases of the
    local sshd, each alias with its own ControlPath (one ControlMaster per host, as with real hosts),
first cold (no mux, no ControlMaster), then warm, interleaved. While each run goes, it samples the
memory (PSS and RSS, summed) of the collection's processes (the muxes), of ssh's processes (masters
and per-task clients), and of the ansible-playbook process tree. It also records the muxes' memory
with one session open and with all of them, and the plane's memory (plane and guests) for the fleet.

Prints a table and writes bench/results/fleet.json. Note the machine's load: it is shared.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/fleet_bench.py [--sessions 100] [--forks 50]
"""
import argparse
import concurrent.futures
import os
import shutil
import sys
import tempfile
import threading
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import BIN, ROOT, ansible_env, playbook_argv, playbook_text, timed_run, write

from stage import PYTHON, Sshd

from microvm_plane_testing import mux_pids, start_local_plane, stop_local_plane, stop_muxes

TASKS = 10


def memory_kib(pid):
    """(PSS, RSS) of one process in KiB; zeros when it is gone."""
    pss = rss = 0
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


def processes():
    """{pid: (ppid, comm, cmdline)} of every process we can read."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                stat = f.read()
            with open("/proc/%s/cmdline" % d, "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        out[int(d)] = (int(stat.rsplit(")", 1)[1].split()[1]), comm, cmdline)
    return out


def tree(procs, root):
    children = {}
    for pid, (ppid, _comm, _cmd) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def total(pids):
    pss = rss = 0
    for pid in pids:
        p, r = memory_kib(pid)
        pss += p
        rss += r
    return {"pss_kib": pss, "rss_kib": rss, "processes": len(pids)}


class Sampler:
    """Peak memory of the muxes, ssh's processes and the ansible-playbook tree while a run goes."""

    def __init__(self, mux_dir, ssh_dir):
        self.mux_dir, self.ssh_dir = mux_dir, ssh_dir
        self.peak = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def sample(self):
        procs = processes()
        muxes = mux_pids(self.mux_dir)
        ssh = [pid for pid, (_ppid, comm, cmd) in procs.items() if comm == "ssh" and self.ssh_dir in cmd]

        def is_run(pid):
            return "ansible-playbook" in procs.get(pid, (0, "", ""))[2] and "fleet.yml" in procs[pid][2]

        playbooks = [pid for pid, (ppid, _comm, _cmd) in procs.items() if is_run(pid) and not is_run(ppid)]
        playbook_tree = [p for root in playbooks for p in tree(procs, root)]
        now = {"muxes": total(muxes), "ssh": total(ssh),
               "ansible_playbook_tree": total([p for p in playbook_tree if p not in ssh])}
        for name, value in now.items():
            if value["pss_kib"] >= self.peak.get(name, {}).get("pss_kib", -1):
                self.peak[name] = value
        return now

    def run(self):
        while not self.stop_event.wait(0.5):
            self.sample()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        self.thread.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--forks", type=int, default=50)
    ap.add_argument("--phases", default="cold,warm", help="cold (no mux, no ControlMaster yet), warm, or both")
    ap.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "fleet.json"))
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fleet-bench-")
    os.makedirs(os.path.join(work, "plane"))
    mux_dir = os.path.join(work, "mux")
    plane = start_local_plane(os.path.join(work, "plane"))
    sshd = None
    result = {"sessions": args.sessions, "tasks": TASKS, "forks": args.forks, "machine": {"cpus": os.cpu_count()},
              "load_at_start": os.getloadavg()}
    try:
        client = plane.client()
        t = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the local plane starts a few guests at a time
            ids = list(pool.map(lambda i: client.create_session({"name": "fleet-%03d" % i, "agent": "custom"})["session_id"],
                                range(args.sessions)))
            list(pool.map(lambda sid: client.wait_session(sid, timeout=600), ids))
        result["create_all_s"] = round(time.monotonic() - t, 1)
        procs = processes()
        result["plane"] = total(tree(procs, plane.process.pid))
        sshd = Sshd(work)
        ssh_dest = os.path.join(work, "ssh-dest")
        # one ControlPath per alias: each inventory host gets its own ControlMaster, as distinct hosts would
        base_args = " ".join(o for o in sshd.options[:-2] if not o.startswith("ControlPath="))
        hosts = ["h%03d" % i for i in range(args.sessions)]
        for h in hosts:
            os.makedirs(os.path.join(ssh_dest, h))
        write(os.path.join(work, "ssh.ini"), "".join(
            "%s ansible_host=127.0.0.1 ansible_port=%d ansible_user=root ansible_connection=ssh ansible_pipelining=true "
            "ansible_ssh_private_key_file=%s ansible_ssh_args='%s -o ControlPath=%s' dest_dir=%s %s\n"
            % (h, sshd.port, sshd.key, base_args.replace("-o -o", "-o"), os.path.join(sshd.dir, "cp-" + h),
               os.path.join(ssh_dest, h), PYTHON) for h in hosts))
        write(os.path.join(work, "agent.ini"), "".join(
            "%s ansible_host=%s ansible_connection=microvm.sandbox.agent dest_dir=/workspace %s\n" % (h, sid, PYTHON)
            for h, sid in zip(hosts, ids)))
        write(os.path.join(work, "one.ini"), "h000 ansible_host=%s ansible_connection=microvm.sandbox.agent "
              "dest_dir=/workspace %s\n" % (ids[0], PYTHON))
        text = playbook_text(mixed=True, count=TASKS).replace("hosts: target", "hosts: all")
        write(os.path.join(work, "fleet.yml"), text)
        env = ansible_env(plane, mux_dir, 600, PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
        forks = ("--forks", str(args.forks))

        # the muxes with one session open, then with all
        proc, _s = timed_run(playbook_argv("one.ini", "fleet.yml"), env, work)
        if proc.returncode != 0:
            raise SystemExit("one-session run failed:\n" + proc.stdout[-3000:] + proc.stderr[-2000:])
        result["muxes_one_session"] = total(mux_pids(mux_dir))

        runs = {}
        phases = [p for p in ("cold", "warm") if p in args.phases.split(",")]
        for phase in phases:
            for mode in ("agent", "ssh"):
                if phase == "cold" and mode == "agent":  # the one-session run above started one: a cold start
                    stop_muxes(mux_dir)
                    deadline = time.time() + 20
                    while mux_pids(mux_dir) and time.time() < deadline:
                        time.sleep(0.2)
                with Sampler(mux_dir, sshd.dir) as sampler:
                    load = os.getloadavg()
                    proc, seconds = timed_run(playbook_argv(mode + ".ini", "fleet.yml", *forks), env, work)
                    after = sampler.sample()
                if mode == "agent":
                    # every session's link is open now: the muxes' memory for the fleet, taken before the SSH run
                    # (which can outlast the persist time) lets them go idle
                    result["muxes_all_sessions"] = total(mux_pids(mux_dir))
                recap = [line for line in proc.stdout.splitlines() if "ok=" in line and "failed=" in line]
                ok = proc.returncode == 0 and len(recap) == args.sessions and all(
                    "ok=%d " % TASKS in line and "unreachable=0" in line and "failed=0" in line for line in recap)
                runs["%s_%s" % (mode, phase)] = {"seconds": round(seconds, 2), "ok": ok, "rc": proc.returncode,
                                                 "load_before": load, "peak": sampler.peak, "at_end": after}
                if not ok:
                    print("%s %s run failed:\n%s\n%s" % (mode, phase, proc.stdout[-3000:], proc.stderr[-2000:]))
        result["runs"] = runs
        # each process of the pool costs what the one serving one session costs; the rest is per session
        one, many = result["muxes_one_session"]["pss_kib"], result["muxes_all_sessions"]["pss_kib"]
        procs = result["muxes_all_sessions"]["processes"]
        result["mux_kib_per_additional_session"] = round((many - procs * one) / max(1, args.sessions - procs), 1)
        result["plane_after"] = total(tree(processes(), plane.process.pid))
        result["load_at_end"] = os.getloadavg()
    finally:
        if sshd is not None:
            for i in range(args.sessions):
                os.system("ssh -O exit -o ControlPath=%s x >/dev/null 2>&1" % os.path.join(sshd.dir, "cp-h%03d" % i))
            sshd.proc.terminate()
            sshd.proc.wait(10)
        stop_muxes(mux_dir)
        stop_local_plane(plane)
        shutil.rmtree(work, ignore_errors=True)

    def mib(kib):
        return "%.0f MiB" % (kib / 1024.0)

    rows = [("sessions / hosts, tasks, forks", "%d, %d, %d" % (args.sessions, TASKS, args.forks)),
            ("create + READY, all sessions", "%.1f s" % result["create_all_s"]),
            ("plane + %d guests (PSS / RSS)" % args.sessions,
             "%s / %s" % (mib(result["plane_after"]["pss_kib"]), mib(result["plane_after"]["rss_kib"])))]
    for name, run in runs.items():
        rows.append(("%s: wall, ok" % name, "%.1f s, %s (load before %.1f)" % (run["seconds"], run["ok"], run["load_before"][0])))
    for phase in phases:
        a, s = runs["agent_" + phase], runs["ssh_" + phase]
        rows.append(("%s: agent / ssh wall" % phase, "%.2fx" % (a["seconds"] / s["seconds"])))
        rows.append(("%s: peak muxes vs ssh processes (PSS)" % phase, "%s vs %s" % (
            mib(a["peak"].get("muxes", {}).get("pss_kib", 0)), mib(s["peak"].get("ssh", {}).get("pss_kib", 0)))))
        rows.append(("%s: peak ansible-playbook tree agent / ssh (PSS)" % phase, "%s / %s" % (
            mib(a["peak"]["ansible_playbook_tree"]["pss_kib"]), mib(s["peak"]["ansible_playbook_tree"]["pss_kib"]))))
    rows.append(("muxes: 1 session / all (PSS)", "%s / %s (%d processes)" % (
        mib(result["muxes_one_session"]["pss_kib"]), mib(result["muxes_all_sessions"]["pss_kib"]),
        result["muxes_all_sessions"]["processes"])))
    rows.append(("mux memory per additional session", "%.1f MiB" % (result["mux_kib_per_additional_session"] / 1024.0)))
    benchlib.print_rows(rows)
    print("wrote %s" % benchlib.save_json(args.output, result))
    return 0 if all(r["ok"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
