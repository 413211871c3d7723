"""A session's disk: one sparse ext4 image holding its /workspace and its root filesystem's changes.

The image (<session>/disk.img, its size from the session's size) is
loop-mounted at <session>/disk, and its `workspace`, `rootfs` and `run` dirs
are bound at the session's usual paths (SessionLayout.workspace, .rootfs,
.run: everything a guest can write to outside memory), so
everything else reads and writes them as before. A guest that fills it gets
ENOSPC inside; the host's file system, the plane and other guests are not
touched. The mounts stay while the session exists (running or stopped) and
are made again after a host reboot (ensure()); destroy() removes them.

A new image is a sparse copy of a blank one made once per size with
mkfs.ext4 (a few MB actually written), so a new session pays a copy, not a mkfs.

Images are sparse, so the host's space is promised, not taken: admit() refuses
a new session (create, each child of a fork) whose whole disk the file system
of the state dir cannot hold now with the plane's reserve left over. Sessions
together may still promise more than the host has (50 `standard` sessions
promise 400 GiB); what they have written is what they take.
"""
import contextlib
import fcntl
import os
import shutil
import subprocess

from . import idmap


DEFAULT_RESERVE = 1 << 30      # bytes of the state dir's file system a new session's disk must leave free
GiB = float(1 << 30)


class DiskError(Exception):
    pass


class DiskCapacityError(DiskError):
    """The host cannot hold a new session's disk."""


def admit(state_dir, disks, reserve):
    """Refuse new disks (a list of sizes in bytes) unless the file system of state_dir has room for all of them
    whole, with `reserve` bytes left over; DiskCapacityError says what is missing."""
    st = os.statvfs(state_dir)
    free = st.f_bavail * st.f_frsize
    need = sum(disks)
    if free - reserve < need:
        what = "a %.1f GiB disk" % (need / GiB) if len(disks) == 1 else "%d disks of %.1f GiB in all" % (
            len(disks), need / GiB)
        raise DiskCapacityError(
            "not enough disk space for %s: the state dir's file system (%s) has %.1f GiB free, and the plane keeps "
            "%.1f GiB of it in reserve (up/serve --disk-reserve); free space there or delete sessions"
            % (what, state_dir, free / GiB, reserve / GiB))


def _run(argv):
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DiskError("%s failed: %s" % (argv[0], (proc.stderr or proc.stdout).strip()[-300:]))


def _mounted(path):
    return os.path.ismount(path)


def _blank(state_dir, size):
    """A blank ext4 image of size bytes, made once per state dir."""
    path = os.path.join(state_dir, "disks", "blank-%d.img" % size)
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent boots (threads or planes) make it once
        if os.path.isfile(path):
            return path
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.truncate(size)
        # no reserved blocks (the guest owns all of it); lazy init keeps the image sparse
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1", tmp])
        os.replace(tmp, path)
    return path


def ensure(state_dir, layout, size, ids):
    """Mount the session's disk (making it first if it has none) and bind its dirs in place."""
    if all(_mounted(p) for p in (layout.disk, layout.workspace, layout.rootfs, layout.run)):
        return
    release(layout)
    os.makedirs(layout.disk, exist_ok=True)
    fresh = not os.path.exists(layout.disk_image)
    if fresh:
        tmp = layout.disk_image + ".tmp"
        _run(["cp", "--sparse=always", _blank(state_dir, size), tmp])
        os.replace(tmp, layout.disk_image)
    _run(["mount", "-o", "loop,nosuid,nodev", layout.disk_image, layout.disk])
    try:
        for name, target in (("workspace", layout.workspace), ("rootfs", layout.rootfs), ("run", layout.run)):
            inner = os.path.join(layout.disk, name)
            if not os.path.isdir(inner):
                os.mkdir(inner, 0o700 if name == "rootfs" else 0o755)
                if name != "rootfs":  # the guest's own: /workspace and /run/localplane
                    os.chown(inner, ids.uid, ids.gid)
                _adopt_plain_dir(target, inner)
            os.makedirs(target, exist_ok=True)
            _run(["mount", "--bind", inner, target])
    except BaseException:
        release(layout)
        raise


def _adopt_plain_dir(plain, inner):
    """A session made before disks existed keeps its files: move them into the disk once."""
    if os.path.isdir(plain) and not os.path.ismount(plain) and os.listdir(plain):
        _run(["cp", "-a", plain + "/.", inner])
        shutil.rmtree(plain)


def release(layout):
    """Unmount the session's dirs and disk (idempotent); the image stays."""
    for path in (layout.workspace, layout.rootfs, layout.run, layout.disk):
        with contextlib.suppress(idmap.IdmapError):
            for _stacked in range(8):
                if not os.path.ismount(path):
                    break
                idmap.unmount(path)
