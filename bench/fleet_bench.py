"""Fleet bench (not a test): one controller, many sandboxes, against SSH to as many hosts, in one run (issue 46).

For each COUNT of --counts (default 100; `make bench-fleet`: 100 and 500) it starts its own local control plane
with COUNT sessions (created in parallel: the plane boots a few guests at a time) and a private sshd, then runs
the same TASKS-task playbook (2 `command`, then a `copy`, repeated) with --forks FORKS, one ansible-playbook
run per side:
  - through `connection: microvm.sandbox.agent` to the COUNT sessions (the shared multiplexer), twice: with a
    static ini inventory ("agent") and with the collection's sessions inventory ("sessions", the documented way
    to target sessions, which loads the connection in ansible-playbook before it forks: its workers share it),
  - through `connection: ssh` with pipelining to COUNT inventory aliases of the local sshd, each alias with
    its own ControlPath (one ControlMaster per host, as with real hosts),
both with the same idle limit (--persist: the plugin's `persist`, ssh's ControlPersist; default 60 s, both
defaults), cold (no mux, no ControlMaster yet) and, with --phases cold,warm, warm.

Per run: the wall; link opens and warm-runner starts per session (the muxes' logs) and ControlMaster starts
per host (target: 1 each); the controller's memory at its peak (PSS, sampled: the muxes and the
ansible-playbook tree for ours, ssh's masters and clients and the tree for SSH) and CPU seconds; and apart
from the controller, the far side's cost: the plane and its guests (PSS/RSS at the end, CPU seconds), the
sshd and its sessions. Then the targets: linear cost from the smallest count to the largest (the agent's
wall per session-task), at most 0.1x SSH's wall, at most SSH's controller memory.

Writes bench/results/fleet-COUNT.json per count and bench/results/fleet-summary.json. Everything it starts
(sessions, plane, sshd, ControlMasters, muxes) is torn down at the end, on failure, Ctrl-C or SIGTERM.
The machine's load and resources (memory, threads, file descriptors) are recorded before and after: the
machine is shared, and they are what bounds the count. Memory bounds it first here (the local plane's guests
live on the controller's machine): a count the available memory will not hold, projected from the previous
count's cost per session, is lowered to the largest that fits (--no-fit: run it as asked), and a count whose
creation or run takes the available memory below --mem-floor-mib is stopped and torn down.

Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/fleet_bench.py
           [--counts 100,500] [--forks 50] [--tasks 10] [--persist 60] [--phases cold[,warm]] [--ssh-counts 100]
"""
import argparse
import concurrent.futures
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import (BIN, ROOT, PeakSampler, ansible_env, children_cpu, cpu_seconds, kib_per_additional_session, mib,
                      playbook_argv, playbook_text, playbook_tree, processes, timed_run, total, tree, write)

import fleet_counts
from stage import PYTHON, Sshd

from microvm_plane_testing import mux_pids, start_local_plane, stop_local_plane, stop_muxes

OURS = ("agent", "sessions")  # our sides: the static ini inventory, the sessions inventory plugin
LINEAR_TARGET = 1.2     # the agent's wall per session-task at the largest count over the smallest: "about 1"
SSH_WALL_TARGET = 0.1   # the agent's wall over SSH's, at most


def resources():
    """What bounds a fleet on this machine, now: load, memory, kernel tasks (threads share pid_max), fds."""
    meminfo = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            meminfo[key] = int(value.split()[0])
    with open("/proc/loadavg") as f:
        loadavg = f.read().split()
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    with open("/proc/sys/fs/file-nr") as f:
        files_open = int(f.read().split()[0])
    import resource
    return {"load": [float(x) for x in loadavg[:3]], "tasks": int(loadavg[3].split("/")[1]), "pid_max": pid_max,
            "mem_available_mib": meminfo["MemAvailable"] // 1024, "mem_total_mib": meminfo["MemTotal"] // 1024,
            "files_open": files_open, "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


class OutOfMemory(Exception):
    """The machine's available memory fell below the bench's floor: the count does not fit beside the others."""


def mem_available_mib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    return 0


def check_memory(floor_mib, what):
    """OutOfMemory when less than floor_mib is available: the machine is shared, an OOM kill would hit anyone."""
    available = mem_available_mib()
    if available < floor_mib:
        raise OutOfMemory("%s: %d MiB available, below the floor of %d MiB (--mem-floor-mib): this machine does not "
                          "hold this count beside what else runs on it; try a smaller one" % (what, available, floor_mib))


def create_sessions(client, count, threads, floor_mib):
    """COUNT sessions, created and waited for READY from `threads` threads -> their ids (in name order).

    On an error, Ctrl-C or memory below the floor the pool is left at once (queued creates cancelled): the caller
    stops the plane."""
    def one(i):
        check_memory(floor_mib, "creating session %d" % (i + 1))
        sid = client.create_session({"name": "fleet-%03d" % i, "agent": "custom"})["session_id"]
        client.wait_session(sid, timeout=900)
        return sid
    pool = concurrent.futures.ThreadPoolExecutor(threads)
    try:
        ids = list(pool.map(one, range(count)))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return ids


def delete_sessions(client, ids, threads):
    """Delete the sessions (errors ignored: the plane's stop ends whatever is left)."""
    def one(sid):
        with contextlib.suppress(Exception):
            client.delete_session(sid)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, ids))


class Fleet:
    """One count's stage: a plane with COUNT sessions, a private sshd, inventories for both sides; stop() ends all."""

    def __init__(self, count, args):
        self.count, self.args = count, args
        self.work = tempfile.mkdtemp(prefix="fleet-bench-")
        self.mux_dir = os.path.join(self.work, "mux")
        self.plane = self.sshd = None
        self.ids = []
        os.makedirs(os.path.join(self.work, "plane"))

    def start(self, result):
        self.plane = start_local_plane(os.path.join(self.work, "plane"))
        client = self.plane.client()
        t = time.monotonic()
        self.ids = create_sessions(client, self.count, self.args.create_threads, self.args.mem_floor_mib)
        result["create_all_s"] = round(time.monotonic() - t, 1)
        result["plane_idle"] = self.plane_cost()
        self.sshd = Sshd(self.work)
        hosts = ["h%03d" % i for i in range(self.count)]
        # one ControlPath per alias (each inventory host its own ControlMaster, as distinct hosts would), and the
        # same idle limit as the agent's links: ansible's own ControlPersist default is 60 s, like `persist`
        options = self.sshd.options[:-2]  # without its -i KEY (ansible_ssh_private_key_file), in pairs: -o NAME=VALUE
        pairs = [options[i:i + 2] for i in range(0, len(options), 2)]
        ssh_args = " ".join(" ".join(p) for p in pairs if not p[1].startswith(("ControlPath=", "ControlPersist=")))
        ssh_args += " -o ControlPersist=%ds" % self.args.persist
        for h in hosts:
            os.makedirs(os.path.join(self.work, "ssh-dest", h))
        write(self.path("ssh.ini"), "".join(
            "%s ansible_host=127.0.0.1 ansible_port=%d ansible_user=root ansible_connection=ssh ansible_pipelining=true "
            "ansible_ssh_private_key_file=%s ansible_ssh_args='%s -o ControlPath=%s' dest_dir=%s %s\n"
            % (h, self.sshd.port, self.sshd.key, ssh_args, os.path.join(self.sshd.dir, "cp-" + h),
               os.path.join(self.work, "ssh-dest", h), PYTHON) for h in hosts))
        write(self.path("agent.ini"), "".join(
            "%s ansible_host=%s ansible_connection=microvm.sandbox.agent dest_dir=/workspace %s\n" % (h, sid, PYTHON)
            for h, sid in zip(hosts, self.ids)))
        # the sessions inventory: every session of this plane, with the ini's host vars
        write(self.path("sessions.microvm_sessions.yml"),
              "plugin: microvm.sandbox.sessions\nname_regex: '^fleet-[0-9]+$'\ncompose:\n"
              "  dest_dir: \"'/workspace'\"\n  ansible_python_interpreter: \"'%s'\"\n" % PYTHON.split("=", 1)[1])
        write(self.path("one.ini"), "h000 ansible_host=%s ansible_connection=microvm.sandbox.agent "
              "dest_dir=/workspace %s\n" % (self.ids[0], PYTHON))
        write(self.path("fleet.yml"), playbook_text(mixed=True, count=self.args.tasks).replace("hosts: target", "hosts: all"))
        self.env = ansible_env(self.plane, self.mux_dir, self.args.persist,
                               PATH=BIN + os.pathsep + os.environ.get("PATH", ""))

    def path(self, name):
        return os.path.join(self.work, name)

    def plane_cost(self, procs=None):
        """The plane and its guests: memory (PSS/RSS, summed) and CPU seconds so far."""
        procs = procs or processes()
        pids = tree(procs, self.plane.process.pid)
        return dict(total(pids), cpu_s=round(cpu_seconds(pids), 2))

    def stop_muxes(self):
        stop_muxes(self.mux_dir)
        deadline = time.time() + 20
        while mux_pids(self.mux_dir) and time.time() < deadline:
            time.sleep(0.2)
        for pid in mux_pids(self.mux_dir):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def stop(self):
        if self.sshd is not None:
            for pid in fleet_counts.ssh_masters(processes(), self.sshd.dir):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
            self.sshd.proc.terminate()
            self.sshd.proc.wait(10)
        self.stop_muxes()
        if self.plane is not None:
            delete_sessions(self.plane.client(), self.ids, self.args.create_threads)
            stop_local_plane(self.plane, timeout=300)
        shutil.rmtree(self.work, ignore_errors=True)


def run_side(fleet, mode, forks, interval):
    """One ansible-playbook run of the fleet playbook on side `mode` (agent or ssh) -> its figures."""
    ssh_dir = fleet.sshd.dir
    masters = {}  # ControlPath -> the master pids seen during the run
    short = []    # the MemAvailable that ended the run early, if one did
    lowest = [mem_available_mib()]  # the lowest MemAvailable seen during the run

    def groups(procs):
        available = mem_available_mib()
        lowest[0] = min(lowest[0], available)
        if available < fleet.args.mem_floor_mib and not short:
            short.append(available)  # end the run: its processes go, the bench then tears down
            for pid in playbook_tree(procs, "fleet.yml"):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
        ssh = [pid for pid, (_ppid, comm, cmd) in procs.items() if comm == "ssh" and ssh_dir in cmd]
        for pid, path in fleet_counts.ssh_masters(procs, ssh_dir).items():
            masters.setdefault(path, set()).add(pid)
        playbook = [p for p in playbook_tree(procs, "fleet.yml") if p not in ssh]
        near = mux_pids(fleet.mux_dir) if mode in OURS else ssh  # the controller's processes beside the tree
        return {"near": near, "ansible_playbook_tree": playbook, "controller": near + playbook}

    def near_cpu():
        if mode in OURS:
            return cpu_seconds(mux_pids(fleet.mux_dir))
        return cpu_seconds(fleet_counts.ssh_masters(processes(), ssh_dir))

    logs_before = fleet_counts.mux_log_counts(fleet.mux_dir)
    masters_before = set(fleet_counts.ssh_masters(processes(), ssh_dir))
    plane_before = fleet.plane_cost()
    sshd_before = cpu_seconds(tree(processes(), fleet.sshd.proc.pid))
    cpu_before = children_cpu() + near_cpu()
    resources_before = resources()
    with PeakSampler(groups, interval=interval) as sampler:
        inventory = "sessions.microvm_sessions.yml" if mode == "sessions" else mode + ".ini"
        proc, seconds = timed_run(playbook_argv(inventory, "fleet.yml", "--forks", str(forks)), fleet.env, fleet.work)
        sampler.sample()
    if short:
        raise OutOfMemory("the %s run at %d: %d MiB available, below the floor of %d MiB (--mem-floor-mib): this "
                          "machine does not hold this count beside what else runs on it; try a smaller one"
                          % (mode, fleet.count, short[0], fleet.args.mem_floor_mib))
    procs = processes()
    out = {"seconds": round(seconds, 2), "rc": proc.returncode, "resources_before": resources_before,
           "mem_available_lowest_mib": lowest[0],
           "resources_after": resources(), "peak": sampler.peak,
           "controller_cpu_s": round(children_cpu() + near_cpu() - cpu_before, 1)}
    recap = [line for line in proc.stdout.splitlines() if "ok=" in line and "failed=" in line]
    out["ok"] = proc.returncode == 0 and len(recap) == fleet.count and all(
        "ok=%d " % fleet.args.tasks in line and "unreachable=0" in line and "failed=0" in line for line in recap)
    if mode in OURS:
        logs = fleet_counts.mux_log_counts(fleet.mux_dir)
        for event in fleet_counts.EVENTS:
            out[event] = fleet_counts.spread(fleet_counts.per_key(logs_before[event], logs[event], fleet.ids))
        # every session's link is open now: the muxes' memory for the fleet, before the SSH run lets them idle
        out["muxes_at_end"] = total(mux_pids(fleet.mux_dir))
        plane_after = fleet.plane_cost(procs)
        out["far_side"] = dict(plane_after, what="plane + guests", cpu_s=round(plane_after["cpu_s"] - plane_before["cpu_s"], 1))
    else:
        starts = {path: len(pids - masters_before) for path, pids in masters.items()}
        paths = [os.path.join(ssh_dir, "cp-h%03d" % i) for i in range(fleet.count)]
        out["master_starts"] = fleet_counts.spread({p: starts.get(p, 0) for p in paths})
        out["far_side"] = {"what": "sshd + its sessions (the hosts' side)",
                           "cpu_s": round(cpu_seconds(tree(procs, fleet.sshd.proc.pid)) - sshd_before, 1)}
    if not out["ok"]:
        print("%s run failed:\n%s\n%s" % (mode, proc.stdout[-3000:], proc.stderr[-2000:]))
    return out


def mib_per_session(result):
    """What one session of a finished count cost the machine, plane and controller together: the drop of its
    available memory from before the sessions were created to the lowest seen during a run, per session."""
    lowest = min(run["mem_available_lowest_mib"] for run in result["runs"].values())
    return (result["resources_at_start"]["mem_available_mib"] - lowest) / result["sessions"]


def largest_fit(count, previous, floor_mib):
    """COUNT, or the largest multiple of 10 below it whose fleet this machine's available memory holds above the
    floor, projected from the previous count's cost per session -> (count, why it was lowered or None).

    That cost carries the previous count's fixed share too (the plane, ansible-playbook's forks), so the projection
    errs on the safe side: the machine is shared, and an OOM kill would hit anyone's processes."""
    if previous is None:
        return count, None
    per_session = mib_per_session(previous)
    available = mem_available_mib()
    fits = int((available - floor_mib) / max(per_session, 1.0))
    if fits >= count:
        return count, None
    lowered = max(previous["sessions"], fits // 10 * 10)
    return lowered, ("memory: %d sessions would take about %d MiB (%.1f MiB each, plane and guests and controller, "
                     "measured at %d), %d MiB are available and %d MiB stay free (--mem-floor-mib): %d fit" % (
                         count, count * per_session, per_session, previous["sessions"], available, floor_mib, fits))


def run_count(count, args):
    """The bench at one count -> its result (also written to fleet-COUNT.json)."""
    result = {"sessions": count, "tasks": args.tasks, "forks": args.forks, "persist": args.persist,
              "machine": {"cpus": os.cpu_count()}, "resources_at_start": resources()}
    fleet = Fleet(count, args)
    try:
        fleet.start(result)
        result["resources_after_create"] = resources()
        # the muxes with one session open (a cold start follows: they are stopped before the first fleet run)
        proc, _s = timed_run(playbook_argv("one.ini", "fleet.yml"), fleet.env, fleet.work)
        if proc.returncode != 0:
            raise SystemExit("one-session run failed:\n" + proc.stdout[-3000:] + proc.stderr[-2000:])
        result["muxes_one_session"] = total(mux_pids(fleet.mux_dir))
        runs = {}
        sides = list(OURS) + (["ssh"] if count in args.ssh_counts else [])
        for phase in args.phases:
            for mode in sides:
                if phase == "cold" and mode in OURS:  # each of our sides starts cold: no mux
                    fleet.stop_muxes()
                runs["%s_%s" % (mode, phase)] = run_side(fleet, mode, args.forks, args.sample_interval)
        result["runs"] = runs
        first = runs["agent_" + args.phases[0]]
        result["mux_kib_per_additional_session"] = kib_per_additional_session(
            result["muxes_one_session"], first["muxes_at_end"], count)
    except OutOfMemory as e:
        result["stopped"] = str(e)
        print("stopped at %d sessions: %s" % (count, e))
    finally:
        fleet.stop()
    result["resources_at_end"] = resources()
    print("wrote %s" % benchlib.save_json(os.path.join(args.output_dir, "fleet-%d.json" % count), result))
    return result


def per_session_task(result, run):
    return result["runs"][run]["seconds"] / (result["sessions"] * result["tasks"])


def targets(results, phase):
    """Each target, met or missed, for each of our sides: {name: {"value", "met"}}."""
    out = {}
    small, large = results[0], results[-1]
    for side in OURS:
        run = "%s_%s" % (side, phase)
        if large["sessions"] > small["sessions"] and run in small["runs"] and run in large["runs"]:
            ratio = per_session_task(large, run) / per_session_task(small, run)
            out["%s: linear: wall per session-task at %d over %d (<= %.1f)" % (
                side, large["sessions"], small["sessions"], LINEAR_TARGET)] = {"value": round(ratio, 2),
                                                                               "met": ratio <= LINEAR_TARGET}
    for r in results:
        runs, n = r["runs"], r["sessions"]
        for side in OURS:
            a = runs.get("%s_%s" % (side, phase))
            if a is None:
                continue
            opens, starts = a["link_opens"], a["runner_starts"]
            out["%d %s: one link open and one runner start per session" % (n, side)] = {
                "value": "max %s / %s" % (opens["max"], starts["max"]),
                "met": opens["max"] == opens["min"] == 1 and starts["max"] == starts["min"] == 1}
            if "ssh_" + phase not in runs:
                continue
            s = runs["ssh_" + phase]
            if not (a["ok"] and s["ok"]):
                out["%d %s: against SSH" % (n, side)] = {"value": "a run failed: no comparison", "met": False}
                continue
            wall = a["seconds"] / s["seconds"]
            out["%d %s: wall vs SSH (<= %.1fx)" % (n, side, SSH_WALL_TARGET)] = {"value": round(wall, 3),
                                                                                 "met": wall <= SSH_WALL_TARGET}
            mem = a["peak"]["controller"]["pss_kib"] / s["peak"]["controller"]["pss_kib"]
            out["%d %s: controller PSS vs SSH (<= 1x)" % (n, side)] = {"value": round(mem, 2), "met": mem <= 1.0}
    return out


def rows_for(result, phase):
    runs, n = result["runs"], result["sessions"]
    rows = [("%d sessions: create + READY, all" % n, "%.1f s" % result["create_all_s"])]
    for side in OURS + ("ssh",):
        run = runs.get("%s_%s" % (side, phase))
        if run is None:
            rows.append(("  %s" % side, "not run at this count (--ssh-counts)"))
            continue
        rows.append(("  %s: wall, ok (load before)" % side, "%.1f s, %s (%.1f)" % (
            run["seconds"], run["ok"], run["resources_before"]["load"][0])))
        rows.append(("  %s: wall per session-task" % side, "%.1f ms" % (1000 * per_session_task(result, "%s_%s" % (side, phase)))))
        rows.append(("  %s: controller peak PSS (%s + playbook tree)" % (side, "ssh" if side == "ssh" else "muxes"),
                     "%s (%s + %s)" % (mib(run["peak"]["controller"]["pss_kib"]), mib(run["peak"]["near"]["pss_kib"]),
                                       mib(run["peak"]["ansible_playbook_tree"]["pss_kib"]))))
        rows.append(("  %s: controller CPU" % side, "%.1f s" % run["controller_cpu_s"]))
        far = run["far_side"]
        rows.append(("  %s: far side (%s) CPU" % (side, far["what"]), "%.1f s" % far["cpu_s"]))
        if side == "ssh":
            s = run["master_starts"]
            rows.append(("  ssh: ControlMaster starts per host min/median/max",
                         "%d / %s / %d (%d with more than 1)" % (s["min"], s["median"], s["max"], s["more_than_1"])))
            continue
        for name, label in (("link_opens", "link opens"), ("runner_starts", "warm-runner starts")):
            s = run[name]
            rows.append(("  %s: %s per session min/median/max" % (side, label), "%d / %s / %d (%d with more than 1, "
                         "%d with none)" % (s["min"], s["median"], s["max"], s["more_than_1"], s["none"])))
    far = runs["agent_" + phase]["far_side"]
    rows.append(("  plane + %d guests at the end (PSS / RSS, processes)" % n, "%s / %s, %d" % (
        mib(far["pss_kib"]), mib(far["rss_kib"]), far["processes"])))
    rows.append(("  mux memory per additional session", "%.2f MiB" % (result["mux_kib_per_additional_session"] / 1024.0)))
    return rows


def counts_arg(text):
    return sorted({int(x) for x in text.split(",") if x.strip()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    ap.add_argument("--counts", type=counts_arg, default=[100], help="session counts, comma-separated (default 100)")
    ap.add_argument("--sessions", type=int, help="one count: the same as --counts SESSIONS")
    ap.add_argument("--ssh-counts", type=counts_arg, default=None, help="the counts SSH runs at too (default: all)")
    ap.add_argument("--forks", type=int, default=50)
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--persist", type=int, default=60, help="the links' and ControlMasters' idle limit, seconds")
    ap.add_argument("--phases", default="cold", help="cold (no mux, no ControlMaster yet), warm, or cold,warm")
    ap.add_argument("--create-threads", type=int, default=8)
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between memory samples")
    ap.add_argument("--mem-floor-mib", type=int, default=3072,
                    help="stop (and tear down) when the machine's available memory falls below this (it is shared)")
    ap.add_argument("--no-fit", action="store_true",
                    help="run every count as asked, even one the memory left will not hold (by the previous count's cost)")
    ap.add_argument("--output-dir", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args()
    if args.sessions is not None:
        args.counts = [args.sessions]
    args.phases = [p for p in ("cold", "warm") if p in args.phases.split(",")]
    if not args.phases or not args.counts or min(args.counts) < 1:
        ap.error("--phases needs cold and/or warm, --counts one count or more, each at least 1")
    args.ssh_counts = list(args.counts if args.ssh_counts is None else args.ssh_counts)

    def terminate(_sig, _frame):  # SIGTERM tears down like Ctrl-C: the finally blocks run
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, terminate)

    started = time.time()
    results, summary_notes, stopped = [], [], None
    for wanted in args.counts:
        count, lowered = largest_fit(wanted, results[-1] if results else None, args.mem_floor_mib)
        if lowered and not args.no_fit:
            print("%d sessions lowered to %d: %s" % (wanted, count, lowered))
            summary_notes.append({"wanted": wanted, "ran": count, "why": lowered})
        else:
            count = wanted
        if count in [r["sessions"] for r in results]:
            continue
        if wanted in args.ssh_counts:
            args.ssh_counts.append(count)
        result = run_count(count, args)
        if "stopped" in result:  # a larger count will not fit either
            stopped = {"count": count, "why": result["stopped"]}
            break
        results.append(result)
    summary = {"counts": [r["sessions"] for r in results], "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
               "minutes": round((time.time() - started) / 60, 1), "lowered": summary_notes, "phases": {}}
    if stopped:
        summary["stopped"] = stopped
    if not results:
        print("no count completed; wrote %s" % benchlib.save_json(os.path.join(args.output_dir, "fleet-summary.json"), summary))
        return 1
    for phase in args.phases:
        print("== %s" % phase)
        for r in results:
            benchlib.print_rows(rows_for(r, phase))
        met = targets(results, phase)
        summary["phases"][phase] = met
        benchlib.print_rows([(name, "%s: %s" % ("met" if t["met"] else "MISSED", t["value"])) for name, t in met.items()])
    print("wrote %s" % benchlib.save_json(os.path.join(args.output_dir, "fleet-summary.json"), summary))
    return 0 if "stopped" not in summary and all(run["ok"] for r in results for run in r["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
