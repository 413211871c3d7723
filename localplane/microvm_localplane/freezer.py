"""A guest's cgroup as runc manages it: read its freezer state, memory, CPU and processes (v1 or v2).

runc creates the cgroup at the config's cgroupsPath (/microvm/<scope>/<session>)
and applies the limits; pause and resume go through runc (guests.py). The
scope is derived from the manager's state dir so that two control planes on
one machine never share a group.
"""
import os

CGROUP_ROOT = "/sys/fs/cgroup"


def unified():
    return os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers"))


class GuestCgroup:
    def __init__(self, scope, session_id):
        self.rel = os.path.join("microvm", scope, session_id)
        self.v2 = unified()

    @property
    def runc_path(self):
        return "/" + self.rel

    def path(self, controller):
        return os.path.join(CGROUP_ROOT, self.rel) if self.v2 else os.path.join(CGROUP_ROOT, controller, self.rel)

    def exists(self):
        return os.path.isdir(self.path("pids"))

    def pids(self):
        try:
            with open(os.path.join(self.path("pids"), "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def state(self):
        """"FROZEN" or "THAWED" (FREEZING counts as frozen)."""
        try:
            if self.v2:
                with open(os.path.join(self.path(""), "cgroup.freeze")) as f:
                    return "FROZEN" if f.read().strip() == "1" else "THAWED"
            with open(os.path.join(self.path("freezer"), "freezer.state")) as f:
                return "THAWED" if f.read().strip() == "THAWED" else "FROZEN"
        except FileNotFoundError:
            return "THAWED"

    def memory_bytes(self):
        name = "memory.current" if self.v2 else "memory.usage_in_bytes"
        try:
            with open(os.path.join(self.path("memory"), name)) as f:
                return int(f.read().strip())
        except (FileNotFoundError, ValueError):
            return 0

    def cpu(self):
        """-> (CPU time used in seconds, periods in which the CPU quota throttled it) since the group began."""
        stat = {}
        try:
            with open(os.path.join(self.path("cpu"), "cpu.stat")) as f:
                stat = dict((k, int(v)) for k, v in (line.split() for line in f if len(line.split()) == 2))
            if self.v2:
                return stat.get("usage_usec", 0) / 1e6, stat.get("nr_throttled", 0)
            with open(os.path.join(self.path("cpuacct"), "cpuacct.usage")) as f:
                return int(f.read().strip()) / 1e9, stat.get("nr_throttled", 0)
        except (FileNotFoundError, ValueError):
            return 0.0, stat.get("nr_throttled", 0)
