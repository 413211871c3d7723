"""Host ids of guests: one subordinate id range per session, and idmapped mounts.

Every guest runs in its own user namespace whose ids 0..65535 map to a range of
host ids no other guest uses at the same time (a "slot" of the plane user's
/etc/subuid and /etc/subgid entry). No guest id is a privileged host id.

Template lower layers stay on disk in *canonical* ids (guest id == stored id,
as debootstrap and umoci leave them) and are shared by every guest of the
template: each guest sees them through idmapped mounts (mount_setattr
MOUNT_ATTR_IDMAP) that shift canonical ids into its own range, so they are
never copied or chowned per guest. What a guest writes (its upper dir and
workspace) is stored in its own range's ids: the overlay's copy-up and new
files need a writable layer that is not idmapped (overlayfs creates its work
files as the mounter, host root, which an idmapped upper cannot represent).
Checkpoints hold canonical ids; a restore or fork shifts them into the target
session's range (statecopy.shift_ids), as does a boot in a new range.

Slots are machine-wide (several planes may run): claimed under a lock by a file
in SLOT_DIR naming the session's state dir, kept while that session exists
(running or stopped), so its files keep their owners; a session whose dir is
gone frees its slot.
"""
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import pwd
import subprocess
import time
from dataclasses import dataclass

GUEST_IDS = 65536                      # ids 0..65535 inside every guest
SUBID_START = 1_000_000_000            # what setup writes to /etc/subuid and /etc/subgid if the user has no entry
SUBID_SLOTS = 16384
SLOT_DIR = "/run/microvm-localplane/idslots"

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = 0o2000000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_IDMAP = 0x00100000
SYS_OPEN_TREE, SYS_MOVE_MOUNT, SYS_MOUNT_SETATTR = 428, 429, 442
MNT_DETACH = 2

libc = ctypes.CDLL(None, use_errno=True)


class IdmapError(Exception):
    pass


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(rc, what):
    if rc < 0:
        err = ctypes.get_errno()
        raise IdmapError("%s: %s" % (what, os.strerror(err)))
    return rc


@dataclass(frozen=True)
class IdRange:
    uid: int      # first host uid (guest uid 0)
    gid: int      # first host gid (guest gid 0)
    count: int = GUEST_IDS

    def oci_mappings(self):
        return ({"containerID": 0, "hostID": self.uid, "size": self.count},
                {"containerID": 0, "hostID": self.gid, "size": self.count})


def _subid_entry(path, user):
    """(start, count) of user's entry in /etc/subuid-style file, or None."""
    try:
        with open(path) as f:
            for line in f:
                parts = line.strip().split(":")
                if len(parts) == 3 and parts[0] in (user, str(os.getuid())):
                    return int(parts[1]), int(parts[2])
    except (OSError, ValueError):
        pass
    return None


def plane_ranges():
    """-> (uid start, gid start, slots) from the plane user's subordinate id entries."""
    user = pwd.getpwuid(os.getuid()).pw_name
    uid = _subid_entry("/etc/subuid", user)
    gid = _subid_entry("/etc/subgid", user)
    if uid is None or gid is None:
        raise IdmapError(
            "no subordinate ids for user %s in /etc/subuid and /etc/subgid: every guest needs its own range of "
            "unprivileged host ids. Run `make system-deps` (it adds %s:%d:%d to both files) or add an entry yourself."
            % (user, user, SUBID_START, GUEST_IDS * SUBID_SLOTS))
    slots = min(uid[1], gid[1]) // GUEST_IDS
    if slots < 1 or uid[0] < GUEST_IDS or gid[0] < GUEST_IDS:
        raise IdmapError("the subordinate id entries of %s (/etc/subuid %s, /etc/subgid %s) must start at or above "
                         "%d and hold at least %d ids" % (user, uid, gid, GUEST_IDS, GUEST_IDS))
    return uid[0], gid[0], slots


def _claimed_by(path):
    """The session dir that holds this slot, or None when free (its session was destroyed)."""
    try:
        with open(path) as f:
            owner = json.load(f).get("owner")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return path  # unreadable: treat as taken, never share ids
    return owner if owner and os.path.isdir(owner) else None


def claim_slot(owner, preferred=None):
    """A slot for the session whose state dir is owner (kept until that dir is gone) -> (slot, IdRange).

    The session's previous slot (preferred) is taken again when free, so its
    files keep their owners; otherwise the caller shifts them (statecopy.shift_ids).
    """
    uid0, gid0, slots = plane_ranges()
    os.makedirs(SLOT_DIR, mode=0o700, exist_ok=True)
    with open(os.path.join(SLOT_DIR, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        order = ([preferred] if preferred is not None and 0 <= preferred < slots else []) + list(range(slots))
        for slot in order:
            path = os.path.join(SLOT_DIR, str(slot))
            holder = _claimed_by(path)
            if holder is not None and holder != owner:
                continue
            if holder is None:
                _write_claim(path, {"owner": owner, "at": time.time()})
            return slot, IdRange(uid0 + slot * GUEST_IDS, gid0 + slot * GUEST_IDS)
    raise IdmapError("all %d guest id ranges are taken by sessions: delete some" % slots)


def release_slot(slot, owner):
    path = os.path.join(SLOT_DIR, str(slot))
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        if json.load(f).get("owner") == owner:
            os.unlink(path)


def _write_claim(path, claim):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(claim, f)
    os.replace(tmp, path)


def userns_fd(ids: IdRange):
    """An fd of a fresh user namespace mapping 0..count-1 to ids (what idmapped mounts are made with).

    The namespace's holder is a short-lived `unshare` process (never a fork of this multi-threaded one).
    """
    holder = subprocess.Popen(["unshare", "--user", "--", "sleep", "60"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    try:
        own = os.stat("/proc/self/ns/user").st_ino
        deadline = time.monotonic() + 10
        while os.stat("/proc/%d/ns/user" % holder.pid).st_ino == own:
            if holder.poll() is not None or time.monotonic() > deadline:
                raise IdmapError("could not create a user namespace (unshare --user)")
            time.sleep(0.0005)
        with open("/proc/%d/uid_map" % holder.pid, "w") as f:
            f.write("0 %d %d\n" % (ids.uid, ids.count))
        with open("/proc/%d/gid_map" % holder.pid, "w") as f:
            f.write("0 %d %d\n" % (ids.gid, ids.count))
        return os.open("/proc/%d/ns/user" % holder.pid, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        holder.kill()
        holder.wait()


def idmapped_bind(src, dst, ns_fd):
    """Bind src at dst with canonical ids shifted by the user namespace ns_fd (not recursive)."""
    tree = _check(libc.syscall(SYS_OPEN_TREE, AT_FDCWD, src.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC),
                  "open_tree %s" % src)
    try:
        attr = MountAttr(MOUNT_ATTR_IDMAP, 0, 0, ns_fd)
        _check(libc.syscall(SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)),
               "idmap %s" % src)
        _check(libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, dst.encode(), MOVE_MOUNT_F_EMPTY_PATH),
               "move_mount %s" % dst)
    finally:
        os.close(tree)


def unmount(path):
    """Lazy unmount; nothing mounted there is fine."""
    if libc.umount2(path.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise IdmapError("umount %s: %s" % (path, os.strerror(err)))
