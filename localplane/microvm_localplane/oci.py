"""The OCI runtime config (config.json) of one guest, generated per boot for runc.

What every guest gets (see docs/localplane-guests.md for why):
- namespaces: user (ids 0..65535 -> the guest's own host range), pid, mount,
  uts, ipc, network, cgroup;
- capabilities: the usual container default set without CAP_NET_RAW and
  CAP_MKNOD, in bounding/effective/permitted/inheritable for the guest's root;
  no_new_privs off so that sudo and su work inside;
- /proc/sys, /proc/sysrq-trigger, /proc/irq, /proc/bus, /proc/fs read-only;
  /proc/asound, /proc/kcore, /proc/keys, /proc/timer_list, /proc/latency_stats,
  /proc/sched_debug, /proc/scsi, /proc/acpi, /sys/firmware,
  /sys/devices/virtual/powercap and the like masked; /sys read-only;
- the seccomp profile of seccomp.py;
- linux.resources from the guest's size (memory, pids, CPU).
"""
from .seccomp import profile as seccomp_profile

CAPABILITIES = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
                "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_AUDIT_WRITE",
                "CAP_SETFCAP")
READONLY_PATHS = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
MASKED_PATHS = ("/proc/asound", "/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/timer_stats", "/proc/latency_stats",
                "/proc/sched_debug", "/proc/scsi", "/proc/acpi", "/proc/interrupts", "/sys/firmware",
                "/sys/devices/virtual/powercap", "/sys/kernel/debug", "/sys/kernel/security")
NAMESPACES = ("pid", "network", "ipc", "uts", "mount", "cgroup", "user")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _bind(src, dst, read_only):
    opts = ["rbind", "nosuid", "nodev"] + (["ro"] if read_only else ["rw"])
    return {"destination": dst, "type": "bind", "source": src, "options": opts}


def config(*, rootfs, hostname, args, env, ids, binds, limits, cgroups_path, tmp_size, masked=()):
    """binds: [(host path, guest path, read_only)]; limits: a GuestLimits; ids: an idmap.IdRange;
    masked: guest paths to hide besides MASKED_PATHS."""
    uid_map, gid_map = ids.oci_mappings()
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "nodev", "mode=1777", "size=%d" % tmp_size]},
    ]
    mounts += [_bind(src, dst, ro) for src, dst, ro in binds]
    caps = list(CAPABILITIES)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(args),
            "env": ["%s=%s" % kv for kv in sorted(env.items())],
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps, "inheritable": caps},
            "noNewPrivileges": False,
            "oomScoreAdj": 500,  # the kernel picks a guest before the plane when the host runs short
        },
        "root": {"path": rootfs, "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": {
            "uidMappings": [uid_map],
            "gidMappings": [gid_map],
            "namespaces": [{"type": t} for t in NAMESPACES],
            "maskedPaths": list(MASKED_PATHS) + list(masked),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": seccomp_profile(),
            "resources": limits.oci_resources(),
            "cgroupsPath": cgroups_path,
            "rootfsPropagation": "private",
        },
    }
