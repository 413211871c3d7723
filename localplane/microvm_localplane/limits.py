"""What a guest may use, by its session's size slug: memory, processes, CPU, disk, /tmp.

The platform's slugs (the size catalog, contract.SIZES: `mars-2vcpu-4gb`...)
get the vCPUs and memory the catalog lists for them; the catalog lists no
disk, pids or /tmp, so those are this plane's decisions, scaled with the
vCPUs. `small`, `standard` and `large` are the guest runtime's own sizes for
its tests (REST refuses them: they are not in the catalog). An unknown slug
gets the default size's limits. Memory, pids and CPU go to runc's
linux.resources (cgroup v1 or v2, runc translates); disk bounds the session's
writable state (disk.py).
"""
from dataclasses import dataclass

from . import contract

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class GuestLimits:
    memory: int          # bytes, RAM (+ tmpfs such as /tmp); no swap beyond it
    pids: int            # processes and threads
    cpus: float          # CPU time share, in CPUs
    disk: int            # bytes: /workspace and the root filesystem's changes together
    tmp: int             # bytes of /tmp (tmpfs, counted in memory)

    def oci_resources(self):
        period = 100000
        return {
            "memory": {"limit": self.memory, "swap": self.memory},
            "pids": {"limit": self.pids},
            "cpu": {"shares": max(2, int(1024 * self.cpus)), "quota": int(period * self.cpus), "period": period},
            "devices": [{"allow": False, "access": "rwm"}],
        }


SIZES = {
    "small": GuestLimits(memory=512 * MiB, pids=512, cpus=0.5, disk=2 * GiB, tmp=128 * MiB),
    "standard": GuestLimits(memory=2 * GiB, pids=1024, cpus=1.0, disk=8 * GiB, tmp=512 * MiB),
    "large": GuestLimits(memory=4 * GiB, pids=4096, cpus=2.0, disk=20 * GiB, tmp=1 * GiB),
}


def catalog_limits(size: dict) -> GuestLimits:
    """A catalog size's limits: its vCPUs and memory as listed; pids, disk and /tmp by vCPU (Decision)."""
    vcpus = size["vcpus"]
    return GuestLimits(memory=size["memory_mb"] * MiB, pids=1024 * vcpus, cpus=float(vcpus), disk=4 * vcpus * GiB,
                       tmp=256 * vcpus * MiB)


SIZES.update({size["slug"]: catalog_limits(size) for size in contract.SIZES})
DEFAULT = contract.DEFAULT_SIZE


def for_size(slug: str) -> GuestLimits:
    return SIZES.get(slug or DEFAULT, SIZES[DEFAULT])
