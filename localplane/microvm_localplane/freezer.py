"""Per-guest cgroups (v1): the freezer holds every process of a guest, the memory cgroup counts it.

One group per session under <hierarchy>/microvm/<scope>/<session_id>, where
scope is derived from the manager's state dir so that two control planes on
one machine (tests, other engineers) never share a group.
"""
import errno
import os
import signal
import time

CGROUP_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("freezer", "memory")


class CgroupError(Exception):
    pass


class GuestCgroup:
    def __init__(self, scope, session_id):
        self.rel = os.path.join("microvm", scope, session_id)

    def path(self, controller):
        return os.path.join(CGROUP_ROOT, controller, self.rel)

    def procs_files(self):
        """cgroup.procs of every controller: a launcher writes its pid there before it forks."""
        return [os.path.join(self.path(c), "cgroup.procs") for c in CONTROLLERS]

    def create(self):
        for c in CONTROLLERS:
            os.makedirs(self.path(c), exist_ok=True)

    def exists(self):
        return os.path.isdir(self.path("freezer"))

    def pids(self):
        try:
            with open(os.path.join(self.path("freezer"), "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def state(self):
        try:
            with open(os.path.join(self.path("freezer"), "freezer.state")) as f:
                return f.read().strip()
        except FileNotFoundError:
            return "THAWED"

    def _set_state(self, value):
        with open(os.path.join(self.path("freezer"), "freezer.state"), "w") as f:
            f.write(value)

    def freeze(self, timeout=10.0):
        """Freeze every task; returns once the kernel reports FROZEN."""
        deadline = time.monotonic() + timeout
        while True:
            self._set_state("FROZEN")
            if self.state() == "FROZEN":
                return
            if time.monotonic() > deadline:
                raise CgroupError("the guest did not freeze within %.0f s (state %s)" % (timeout, self.state()))
            time.sleep(0.002)

    def thaw(self):
        self._set_state("THAWED")

    def memory_bytes(self):
        try:
            with open(os.path.join(self.path("memory"), "memory.usage_in_bytes")) as f:
                return int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return 0

    def kill_all(self, timeout=10.0):
        """SIGKILL every task, frozen first so nothing can fork away in between; waits until empty."""
        if not self.exists():
            return
        deadline = time.monotonic() + timeout
        while self.pids():
            self.freeze()
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.thaw()
            t_end = time.monotonic() + 1.0
            while self.pids() and time.monotonic() < t_end:
                time.sleep(0.002)
            if time.monotonic() > deadline:
                raise CgroupError("processes survived SIGKILL: %s" % self.pids())

    def remove(self):
        for c in CONTROLLERS:
            for attempt in range(200):
                try:
                    os.rmdir(self.path(c))
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    # EBUSY: exiting tasks are still being detached.
                    if e.errno != errno.EBUSY or attempt == 199:
                        raise
                    time.sleep(0.005)
            try:
                os.rmdir(os.path.dirname(self.path(c)))  # the scope, once its last guest is gone
            except OSError:
                pass  # other guests of this control plane, or already gone
