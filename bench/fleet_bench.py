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
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import (BIN, ROOT, PeakSampler, ansible_env, kib_per_additional_session, mib, playbook_argv, playbook_text,
                      playbook_tree, processes, timed_run, total, tree, write)

from stage import PYTHON, Sshd

from microvm_plane_testing import mux_pids, start_local_plane, stop_local_plane, stop_muxes

TASKS = 10


def fleet_groups(mux_dir, ssh_dir):
    """The processes sampled during a run: the muxes, ssh's (masters and per-task clients), ansible-playbook's tree."""
    def groups(procs):
        ssh = [pid for pid, (_ppid, comm, cmd) in procs.items() if comm == "ssh" and ssh_dir in cmd]
        return {"muxes": mux_pids(mux_dir), "ssh": ssh,
                "ansible_playbook_tree": [p for p in playbook_tree(procs, "fleet.yml") if p not in ssh]}
    return groups


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
                with PeakSampler(fleet_groups(mux_dir, sshd.dir)) as sampler:
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
        result["mux_kib_per_additional_session"] = kib_per_additional_session(
            result["muxes_one_session"], result["muxes_all_sessions"], args.sessions)
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
