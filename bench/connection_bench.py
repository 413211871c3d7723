"""Benchmark of the microvm.sandbox.agent connection, side by side in one run (not a timed test).

1. A 30-task playbook (20 `command`, 10 `copy`) through
   - `connection: microvm.sandbox.agent` against a local-plane sandbox,
   - `connection: local`,
   - `connection: ssh` to a private sshd on 127.0.0.1 with ControlPersist and pipelining,
   each warmed up once (mux / ControlMaster started) and then timed REPEAT times, interleaved.
2. A 256 MiB file copied in and out REPEAT times, interleaved (median): the plugin's put_file/fetch_file path (the session's mux)
   against scp to localhost over the same warm ControlMaster.

Prints a table with ratios and writes bench/results/connection.json.
Usage: PYTHONPATH=.local/collections:localplane .venv/bin/python bench/connection_bench.py [--repeat 3] [--size-mib 256]
"""
import argparse
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import COLLECTIONS, ROOT, ansible_env, playbook_text, run_playbook, write

from microvm_localplane.testing import start_local_plane, stop_local_plane

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils import mux_protocol as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils.mux_client import MuxClient


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Sshd:
    """A private sshd on a loopback port, with its own host key and a generated client key."""

    def __init__(self, tmp):
        self.dir = os.path.join(tmp, "ssh")
        os.makedirs(self.dir, mode=0o700)
        self.port = free_port()
        self.key = os.path.join(self.dir, "id_ed25519")
        host_key = os.path.join(self.dir, "host_ed25519")
        for path in (self.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
        auth = os.path.join(self.dir, "authorized_keys")
        shutil.copy(self.key + ".pub", auth)
        os.chmod(auth, 0o600)
        config = os.path.join(self.dir, "sshd_config")
        with open(config, "w") as f:
            f.write("\n".join([
                "Port %d" % self.port, "ListenAddress 127.0.0.1", "HostKey %s" % host_key,
                "AuthorizedKeysFile %s" % auth, "PidFile %s" % os.path.join(self.dir, "sshd.pid"),
                "PermitRootLogin prohibit-password", "PasswordAuthentication no", "UsePAM no", "StrictModes no",
                "Subsystem sftp internal-sftp", "LogLevel ERROR", ""]))
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        self.proc = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", config],
                                     stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "sshd.log"), "w"))
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        self.control_path = os.path.join(self.dir, "cp-%C")
        self.options = ["-o", "ControlMaster=auto", "-o", "ControlPersist=120s", "-o", "ControlPath=" + self.control_path,
                        "-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR",
                        "-o", "IdentitiesOnly=yes", "-i", self.key]

    def inventory_vars(self):
        """Inventory variables for `connection: ssh` to this sshd with ControlPersist and pipelining."""
        return ("ansible_host=127.0.0.1 ansible_port=%d ansible_user=root ansible_connection=ssh ansible_pipelining=true "
                "ansible_ssh_private_key_file=%s ansible_ssh_args='%s'" % (self.port, self.key, " ".join(self.options[:-2])))

    def stop(self):
        subprocess.run(["ssh", "-O", "exit", "-p", str(self.port)] + self.options + ["root@127.0.0.1"],
                       capture_output=True, check=False)
        self.proc.terminate()
        self.proc.wait(10)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--output", default=os.path.join(ROOT, "bench", "results", "connection.json"))
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="connbench-")
    plane = sshd = None
    try:
        os.makedirs(os.path.join(tmp, "plane"))
        plane = start_local_plane(os.path.join(tmp, "plane"))
        client = plane.client()
        session = client.wait_session(client.create_session({"name": "connbench", "agent": "none"})["session_id"],
                                      timeout=120)
        sshd = Sshd(tmp)
        local_dir = os.path.join(tmp, "local-dest")
        ssh_dir = os.path.join(tmp, "ssh-dest")
        os.makedirs(local_dir)
        os.makedirs(ssh_dir)
        mux_dir = os.path.join(tmp, "mux")
        env = ansible_env(plane, mux_dir, 300, PYTHONPATH=COLLECTIONS)
        write(os.path.join(tmp, "playbook.yml"), playbook_text(mixed=True))
        inventories = {
            "agent": write(os.path.join(tmp, "agent.ini"),
                           "target ansible_host=%s ansible_connection=microvm.sandbox.agent "
                           "ansible_python_interpreter=/usr/bin/python3 dest_dir=/workspace\n" % session["name"]),
            "local": write(os.path.join(tmp, "local.ini"),
                           "target ansible_connection=local ansible_python_interpreter=/usr/bin/python3 "
                           "dest_dir=%s\n" % local_dir),
            "ssh": write(os.path.join(tmp, "ssh.ini"), "target %s ansible_python_interpreter=/usr/bin/python3 dest_dir=%s\n"
                         % (sshd.inventory_vars(), ssh_dir)),
        }
        for mode in inventories:  # warm-up: the agent's mux and ssh's ControlMaster come up here
            run_playbook(tmp, "playbook.yml", inventories[mode], env)
        times = {mode: [] for mode in inventories}
        for i in range(args.repeat):
            order = list(inventories)[i % 3:] + list(inventories)[:i % 3]  # interleave against drift
            for mode in order:
                times[mode].append(run_playbook(tmp, "playbook.yml", inventories[mode], env))
        per_task = {mode: statistics.median(t) / 30 for mode, t in times.items()}

        # 256 MiB in and out: the plugin's transfer path vs scp over the warm ControlMaster
        big = os.path.join(tmp, "big.bin")
        with open(big, "wb") as f:
            for _dummy in range(args.size_mib):
                f.write(os.urandom(1 << 20))
        spawn = {"api_url": plane.url, "prefix": profile.DEFAULT_PREFIX, "session": session["name"],
                 "agent_port": profile.AGENT_PORT, "connect_timeout": 60, "persist": 300,
                 "scratch_dir": profile.SCRATCH_DIR, "validate_certs": True}
        mux = MuxClient(mux_dir, mp.mux_key(plane.url, profile.DEFAULT_PREFIX, session["name"], profile.AGENT_PORT),
                        spawn, plane.token).connect()
        scp = ["scp", "-q", "-P", str(sshd.port)] + sshd.options
        copies = {
            "agent_in": lambda: mux.put(big, "/workspace/big.bin"),
            "agent_out": lambda: mux.fetch("/workspace/big.bin", os.path.join(tmp, "big.agent")),
            "scp_in": lambda: subprocess.run(scp + [big, "root@127.0.0.1:%s/big.bin" % ssh_dir], check=True),
            "scp_out": lambda: subprocess.run(scp + ["root@127.0.0.1:%s/big.bin" % ssh_dir, os.path.join(tmp, "big.scp")],
                                              check=True),
        }
        copy_runs = {name: [] for name in copies}
        for _dummy in range(args.repeat):  # interleaved, like the playbooks; the median counts
            for name, copy in copies.items():
                start = time.perf_counter()
                copy()
                copy_runs[name].append(round(time.perf_counter() - start, 3))
        mux.close()
        transfer = {name: statistics.median(runs) for name, runs in copy_runs.items()}
        for path in ("big.agent", "big.scp"):
            if os.path.getsize(os.path.join(tmp, path)) != args.size_mib << 20:
                raise RuntimeError("%s has the wrong size" % path)

        mib = float(args.size_mib)
        result = {
            "tasks": 30, "repeat": args.repeat, "runs_seconds": times,
            "per_task_seconds": per_task,
            "ratio_to_local": {m: per_task[m] / per_task["local"] for m in per_task},
            "copy_mib": args.size_mib,
            "copy_seconds": transfer,
            "copy_runs_seconds": copy_runs,
            "copy_mib_per_second": {k: mib / v for k, v in transfer.items()},
            "copy_ratio_agent_to_scp": {"in": transfer["scp_in"] / transfer["agent_in"],
                                        "out": transfer["scp_out"] / transfer["agent_out"]},
            "targets": {"per_task_max_ratio_to_local": 1.15, "copy_min_ratio_to_scp": 1.0},
            "machine": {"cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        print("30-task playbook (20 command, 10 copy), median of %d runs after a warm-up:" % args.repeat)
        print("  %-8s %10s %10s %12s" % ("mode", "run s", "per task", "vs local"))
        for mode in ("agent", "local", "ssh"):
            print("  %-8s %10.2f %10.3f %11.2fx" % (
                mode, statistics.median(times[mode]), per_task[mode], result["ratio_to_local"][mode]))
        print("%d MiB file (higher MiB/s is better; ratio > 1 means the agent is faster than scp):" % args.size_mib)
        for direction in ("in", "out"):
            print("  %-4s agent %7.1f MiB/s   scp %7.1f MiB/s   ratio %.2f" % (
                direction, result["copy_mib_per_second"]["agent_" + direction],
                result["copy_mib_per_second"]["scp_" + direction], result["copy_ratio_agent_to_scp"][direction]))
        print("wrote %s" % benchlib.save_json(args.output, result))
    finally:
        if sshd:
            sshd.stop()
        benchlib.stop_muxes(os.path.join(tmp, "mux"))
        if plane:
            stop_local_plane(plane)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
