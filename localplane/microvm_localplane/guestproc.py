"""What a guest reads about its own size: /proc/meminfo and /proc/cpuinfo from its limits, not the host's.

A microVM's kernel reports the memory and vCPUs of its size. A runc guest shares
the host's kernel, whose /proc/meminfo and /proc/cpuinfo describe the host
(ansible_memtotal_mb was the host's 24 GB). lxcfs fixes this with a FUSE
filesystem; this does it without FUSE, so the guest gets no FUSE device and no
file served by a host process at read time:

- /proc/cpuinfo is written once per boot: the host's first processor block,
  repeated for as many vCPUs as the size has (renumbered, one core each).
- /proc/meminfo has MemTotal = the size's memory limit (SwapTotal 0: the limit
  allows no swap), and MemFree / MemAvailable / Cached / Shmem computed from the
  guest's own memory cgroup, rewritten in place about once a second by the
  plane (`Refresher`). Between two refreshes the numbers are up to a second
  old: a static file would be wrong for good, a per-read answer needs FUSE.

The files live in the session's host-only directory (the guest can neither
write nor replace them) and are bound read-only over the guest's /proc entries
(runc allows exactly these /proc destinations, for lxcfs). The plane writes
them through an fd it opened itself with O_NOFOLLOW, never through a path the
guest controls. Every line has a fixed width, so an in-place rewrite never
leaves a reader a truncated file.
"""
from __future__ import annotations

import contextlib
import os
import threading

from .freezer import GuestCgroup

KiB = 1024
REFRESH_SECONDS = 1.0
DIR_NAME = "proc"            # on the session's own disk (SessionLayout.disk; its mountinfo root names no host path)
WIDTH = 12                   # digits of every kB figure (fixed: in-place rewrites keep the length)
MEMINFO_KEYS = ("MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "SwapCached", "Active", "Inactive",
                "Shmem", "SwapTotal", "SwapFree")
HOST_CPUINFO = "/proc/cpuinfo"


def vcpus(limits) -> int:
    """The vCPUs a size gives (at least one): its CPU share rounded up."""
    return max(1, int(-(-limits.cpus // 1)))


def cpuinfo(limits, host_text: str) -> str:
    """/proc/cpuinfo for the size: the host's first processor block, once per vCPU, renumbered."""
    block = host_text.split("\n\n", 1)[0].strip("\n")
    count = vcpus(limits)
    blocks = []
    for n in range(count):
        lines = []
        for line in block.split("\n"):
            key = line.split(":", 1)[0].strip()
            value = {"processor": n, "core id": n, "apicid": n, "initial apicid": n, "physical id": 0,
                     "siblings": count, "cpu cores": count}.get(key)
            lines.append(line if value is None else "%s: %s" % (line.split(":", 1)[0], value))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n\n"


def _cgroup_memory(cgroup: GuestCgroup) -> dict:
    """usage, file (page cache, tmpfs included), shmem (tmpfs), active/inactive file in bytes (0 when unknown)."""
    stat = {}
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(cgroup.path("memory"), "memory.stat")) as f:
            stat = {k: int(v) for k, v in (line.split() for line in f if len(line.split()) == 2)}
    usage = cgroup.memory_bytes()
    if cgroup.v2:
        file, shmem = stat.get("file", 0), stat.get("shmem", 0)
        active, inactive = stat.get("active_file", 0) + stat.get("active_anon", 0), \
            stat.get("inactive_file", 0) + stat.get("inactive_anon", 0)
    else:  # v1: usage counts the page cache; total_* include nested groups
        file, shmem = stat.get("total_cache", stat.get("cache", 0)), stat.get("total_shmem", stat.get("shmem", 0))
        active = stat.get("total_active_file", 0) + stat.get("total_active_anon", 0)
        inactive = stat.get("total_inactive_file", 0) + stat.get("total_inactive_anon", 0)
    return {"usage": usage, "file": file, "shmem": shmem, "active": active, "inactive": inactive}


def meminfo(limits, mem: dict) -> str:
    """/proc/meminfo of a guest with this limit and this cgroup usage; fixed width (see WIDTH)."""
    total = limits.memory
    used = min(max(mem.get("usage", 0), 0), total)
    reclaimable = max(0, mem.get("file", 0) - mem.get("shmem", 0))  # tmpfs pages stay: they are the guest's files
    values = {
        "MemTotal": total, "MemFree": total - used, "MemAvailable": min(total, total - used + reclaimable),
        "Buffers": 0, "Cached": min(mem.get("file", 0), used), "SwapCached": 0,
        "Active": min(mem.get("active", 0), used), "Inactive": min(mem.get("inactive", 0), used),
        "Shmem": min(mem.get("shmem", 0), used), "SwapTotal": 0, "SwapFree": 0,
    }
    return "".join("%-16s%*d kB\n" % (key + ":", WIDTH, values[key] // KiB) for key in MEMINFO_KEYS)


def _write_new(dir_fd: int, name: str, text: str) -> None:
    """A fresh 0444 file `name` in the host-only dir (anything there before is removed, never followed)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode("ascii", "replace"))
    finally:
        os.close(fd)


def prepare(host_dir: str, limits) -> list:
    """Write the session's files for this boot; -> [(host path, guest path, read_only)] binds for oci.config."""
    proc_dir = os.path.join(host_dir, DIR_NAME)
    os.makedirs(proc_dir, mode=0o755, exist_ok=True)
    try:
        with open(HOST_CPUINFO) as f:
            host_cpuinfo = f.read()
    except OSError:
        host_cpuinfo = "processor\t: 0\n"
    dir_fd = os.open(proc_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _write_new(dir_fd, "cpuinfo", cpuinfo(limits, host_cpuinfo))
        _write_new(dir_fd, "meminfo", meminfo(limits, {}))
    finally:
        os.close(dir_fd)
    return [(os.path.join(proc_dir, "cpuinfo"), "/proc/cpuinfo", True),
            (os.path.join(proc_dir, "meminfo"), "/proc/meminfo", True)]


def refresh(host_dir: str, limits, cgroup: GuestCgroup) -> None:
    """Rewrite the session's meminfo in place from its cgroup (same length, so readers never see it cut)."""
    text = meminfo(limits, _cgroup_memory(cgroup)).encode("ascii")
    try:
        fd = os.open(os.path.join(host_dir, DIR_NAME, "meminfo"), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # not booted with it (an adopted guest of an older plane), or being torn down
    try:
        os.pwrite(fd, text, 0)
    finally:
        os.close(fd)


class Refresher:
    """One plane thread that refreshes every running guest's meminfo about once a second.

    `guests()` returns [(host dir, limits, cgroup)] of the guests to refresh; frozen guests are included
    (their usage does not move, and the write costs a few microseconds).
    """

    def __init__(self, guests, interval: float = REFRESH_SECONDS) -> None:
        self._guests = guests
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="guestproc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                entries = list(self._guests())
            except RuntimeError:  # the dict changed while it was copied: next round
                continue
            for host_dir, limits, cgroup in entries:
                with contextlib.suppress(OSError, ValueError):
                    refresh(host_dir, limits, cgroup)

    def stop(self) -> None:
        self._stop.set()
