"""The stage the playbook benches share: a local plane with one ready session, a private sshd, per-mode
destination dirs, the ansible-playbook environment, and inventories for each peer; torn down by stop()."""
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time

from benchlib import COLLECTIONS, ansible_env, children_cpu, cpu_seconds, processes, tree, write

from microvm_plane_testing import mux_pids, start_local_plane, stop_local_plane, stop_muxes

PYTHON = "ansible_python_interpreter=/usr/bin/python3"


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
                "Subsystem sftp internal-sftp", "LogLevel ERROR",
                # A fleet run opens 50 connections at once (forks 50, one ControlMaster per host): sshd's default
                # MaxStartups (10:30:100) would drop most of them, a failure of the peer's setup, not of SSH.
                "MaxStartups 500", "MaxSessions 500", ""]))
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
        # what every client of this sshd passes, then (options) the playbooks' ControlMaster started on demand
        self.base_options = ["-o", "UserKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=no", "-o", "LogLevel=ERROR",
                             "-o", "IdentitiesOnly=yes", "-i", self.key]
        self.options = ["-o", "ControlMaster=auto", "-o", "ControlPersist=120s",
                        "-o", "ControlPath=" + self.control_path] + self.base_options

    def inventory_vars(self):
        """Inventory variables for `connection: ssh` to this sshd with ControlPersist and pipelining."""
        return ("ansible_host=127.0.0.1 ansible_port=%d ansible_user=root ansible_connection=ssh ansible_pipelining=true "
                "ansible_ssh_private_key_file=%s ansible_ssh_args='%s'" % (self.port, self.key, " ".join(self.options[:-2])))

    def stop(self):
        subprocess.run(["ssh", "-O", "exit", "-p", str(self.port)] + self.options + ["root@127.0.0.1"],
                       capture_output=True, check=False)
        self.proc.terminate()
        self.proc.wait(10)


class ControlMaster:
    """An ssh ControlMaster to `sshd` that is the bench's own child, so none of its CPU time goes uncounted.

    It is started in the foreground (`ssh -M -N`, ControlPersist=no): it never forks away and never lapses on
    its own. cpu_seconds() reads its utime + stime from /proc while it runs; once it has ended, the rusage of
    the reaped child (os.wait4, done here and nowhere else). Clients use it with client_options(): with
    ControlMaster=no they never become a master themselves; used() says whether this master is the one serving
    the ControlPath (`ssh -O check`), asked before and after each copy.
    """

    def __init__(self, sshd: Sshd, path: str) -> None:
        self.sshd = sshd
        self.path = path
        self.log = open(os.path.join(sshd.dir, "controlmaster.log"), "w")
        self.proc = subprocess.Popen(
            ["ssh", "-M", "-N", "-p", str(sshd.port), "-o", "ControlMaster=yes", "-o", "ControlPersist=no",
             "-o", "ControlPath=" + path] + sshd.base_options + ["root@127.0.0.1"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log)
        self.rusage_seconds: float | None = None  # set when it has ended and been reaped
        deadline = time.time() + 20
        while not self.used():
            self.cpu_seconds()  # reaps it if it ended
            if self.rusage_seconds is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("the bench's ssh ControlMaster did not come up; see %s" % self.log.name)
            time.sleep(0.1)

    def client_options(self) -> list[str]:
        """ssh / scp options that go through this master (and never start one)."""
        return ["-o", "ControlMaster=no", "-o", "ControlPath=" + self.path] + self.sshd.base_options

    def used(self) -> bool:
        """True when this master (its pid) answers on the ControlPath."""
        check = subprocess.run(["ssh", "-O", "check", "-p", str(self.sshd.port)] + self.client_options() + ["root@127.0.0.1"],
                               capture_output=True, text=True, check=False)
        return check.returncode == 0 and "pid=%d)" % self.proc.pid in check.stderr

    def cpu_seconds(self) -> float:
        """CPU seconds it has used so far: from /proc while it runs, from its rusage once ended (then reaped)."""
        if self.rusage_seconds is None:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid == 0:
                return cpu_seconds([self.proc.pid])
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.rusage_seconds = usage.ru_utime + usage.ru_stime
        return self.rusage_seconds

    def stop(self) -> None:
        if self.rusage_seconds is None:
            self.proc.terminate()
            deadline = time.time() + 10
            while self.cpu_seconds() is not None and self.rusage_seconds is None:
                if time.time() > deadline:
                    self.proc.kill()
                time.sleep(0.05)
        self.log.close()


class Stage:
    """Everything a bench needs to run the same playbook through the agent, local and SSH."""

    def __init__(self, name):
        self.tmp = tempfile.mkdtemp(prefix="%s-" % name)
        self.plane = self.sshd = None
        self.mux_dir = os.path.join(self.tmp, "mux")
        self.mux_dirs = [self.mux_dir]  # every mux dir a bench ran muxes in (see mux_env): counted and stopped
        try:
            os.makedirs(os.path.join(self.tmp, "plane"))
            self.plane = start_local_plane(os.path.join(self.tmp, "plane"))
            client = self.plane.client()
            self.session = client.wait_session(client.create_session({"name": name, "agent": "custom"})["session_id"],
                                               timeout=120)
            self.sshd = Sshd(self.tmp)
            self.local_dir = os.path.join(self.tmp, "local-dest")
            self.ssh_dir = os.path.join(self.tmp, "ssh-dest")
            os.makedirs(self.local_dir)
            os.makedirs(self.ssh_dir)
            self.env = ansible_env(self.plane, self.mux_dir, 300, PYTHONPATH=COLLECTIONS)
        except BaseException:
            self.stop()
            raise

    def cpu(self):
        """CPU seconds used so far by each side of a playbook run: {side: seconds}; subtract two to get one run's.

        controller: the ansible-playbook runs (with their workers, and Mitogen's processes, all reaped by them)
            and the agent connection's mux;
        runner: the warm runners in the guest, with the module forks they reaped;
        platform: the local plane (REST, port-forward) and the rest of its guests (the agent), standing in for
            the platform: never the controller's.
        """
        procs = processes()
        plane = self.plane.process.pid
        guests = tree(procs, plane)
        runners = [p for root in guests if "microvm-warm-runner" in procs[root][2] for p in tree(procs, root)]
        return {"controller": children_cpu() + cpu_seconds([p for d in self.mux_dirs for p in mux_pids(d)]),
                "runner": cpu_seconds(set(runners)),
                "platform": cpu_seconds(set(guests) - set(runners))}

    def mux_env(self, name, **extra):
        """The ansible-playbook environment with a mux dir of its own (`name`) and `extra` variables, which its
        muxes inherit (e.g. MICROVM_MUX_SWITCH_INTERVAL): counted in cpu(), stopped by stop()."""
        mux_dir = os.path.join(self.tmp, "mux-" + name)
        self.mux_dirs.append(mux_dir)
        return dict(self.env, MICROVM_MUX_DIR=mux_dir, **extra)

    def path(self, name):
        return os.path.join(self.tmp, name)

    def inventory(self, mode, **extra):
        """An inventory file with host `target` for mode agent, local or ssh; extra become host variables."""
        line = {
            "agent": "ansible_host=%s ansible_connection=microvm.sandbox.agent dest_dir=/workspace" % self.session["name"],
            "local": "ansible_connection=local dest_dir=%s" % self.local_dir,
            "ssh": "%s dest_dir=%s" % (self.sshd.inventory_vars(), self.ssh_dir),
        }[mode]
        words = [line, PYTHON] + ["%s=%s" % kv for kv in sorted(extra.items())]
        name = "-".join([mode] + ["%s-%s" % kv for kv in sorted(extra.items())]) + ".ini"
        return write(self.path(name), "target %s\n" % " ".join(words))

    def sessions_inventory(self, **extra):
        """The session as the sessions inventory plugin makes it (in group `target`): the documented way to target
        sessions, which also loads the agent connection before ansible-playbook forks its workers."""
        compose = {"dest_dir": "'/workspace'", "ansible_python_interpreter": "'/usr/bin/python3'"}
        compose.update({key: "'%s'" % value for key, value in extra.items()})
        name = "-".join(["sessions"] + ["%s-%s" % kv for kv in sorted(extra.items())]) + ".microvm_sessions.yml"
        text = "plugin: microvm.sandbox.sessions\nname_regex: '^%s$'\ngroups:\n  target: 'true'\ncompose:\n%s" % (
            re.escape(self.session["name"]), "".join("  %s: \"%s\"\n" % kv for kv in sorted(compose.items())))
        return write(self.path(name), text)

    def stop(self):
        if self.sshd is not None:
            self.sshd.stop()
        for mux_dir in self.mux_dirs:
            stop_muxes(mux_dir)
        if self.plane is not None:
            stop_local_plane(self.plane)
        shutil.rmtree(self.tmp, ignore_errors=True)
