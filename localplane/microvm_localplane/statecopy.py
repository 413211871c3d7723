"""Copies of a session's writable state: checkpoint, restore, clone.

A copy is `workspace/` plus `rootfs/<layer>/upper/`, made with `cp -a` so that
overlay whiteouts, xattrs, links and modes survive exactly.

Owners: a session's state belongs to its own host id range (idmap.py); a
checkpoint copy holds canonical ids (0 = the guest's root), so that it can be
restored into, or forked to, a session with any range.

Set-id bits: canonical ids are the host's own (0 is host root), so a guest's
`chmod 4755` copy of a shell would be a set-uid-root program on the host. A
checkpoint copy therefore holds no set-id bit: they are stripped before its
files are re-owned, and recorded in SETID_MANIFEST beside them; a restore or
fork puts them back once the files belong to the session's range again (the
guest's state stays exact).
"""
import asyncio
import json
import os
import shutil
import stat

from .errors import GuestError
from .idmap import GUEST_IDS, IdRange

CANONICAL = IdRange(0, 0)
SETID_MANIFEST = "setid-modes.json"   # in a checkpoint copy: {relative path: mode} of its set-id files
SETID_BITS = stat.S_ISUID | stat.S_ISGID


async def _run(*argv):
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _out, err = await proc.communicate()
    if proc.returncode != 0:
        raise GuestError("%s failed: %s" % (argv[0], err.decode(errors="replace").strip()[-500:]))


def shift_ids(root, old: IdRange, new: IdRange, setid: "dict | None" = None):
    """Re-own every file under root from range old to range new (ids outside old stay as they are).

    With `setid` (a dict), every regular file's set-id bits are stripped before it is re-owned, and recorded there
    ({path: mode}): for a copy in canonical ids, which are the host's own.
    """
    if (old == new and setid is None) or not os.path.lexists(root):
        return

    def shift(path):
        st = os.lstat(path)
        mode = st.st_mode
        if setid is not None and stat.S_ISREG(mode) and mode & SETID_BITS:
            setid[path] = stat.S_IMODE(mode)
            mode &= ~SETID_BITS
            os.chmod(path, stat.S_IMODE(mode))  # before the chown: never a set-id file owned by host root
        uid = st.st_uid - old.uid + new.uid if old.uid <= st.st_uid < old.uid + GUEST_IDS else -1
        gid = st.st_gid - old.gid + new.gid if old.gid <= st.st_gid < old.gid + GUEST_IDS else -1
        if uid != -1 or gid != -1:
            os.lchown(path, uid, gid)
            if mode & 0o6000 and not stat.S_ISLNK(mode):
                os.chmod(path, mode & 0o7777)  # chown clears setuid/setgid: keep the file as it was

    shift(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            shift(os.path.join(dirpath, name))


async def copy_state(layout, dest_dir, ids: IdRange):
    """workspace/ and rootfs/<layer>/upper/ -> dest_dir in canonical ids (cp -a keeps whiteouts and xattrs)."""
    os.makedirs(dest_dir, exist_ok=True)
    if os.listdir(dest_dir):
        raise GuestError("checkpoint destination is not empty: %s" % dest_dir)
    await _run("cp", "-a", "--reflink=auto", layout.workspace, os.path.join(dest_dir, "workspace"))
    for layer in layout.layers():
        os.makedirs(os.path.join(dest_dir, "rootfs", layer))
        await _run("cp", "-a", "--reflink=auto", layout.upper(layer), os.path.join(dest_dir, "rootfs", layer, "upper"))
    setid: dict = {}
    await asyncio.to_thread(shift_ids, dest_dir, ids, CANONICAL, setid)
    with open(os.path.join(dest_dir, SETID_MANIFEST), "w") as f:
        json.dump({os.path.relpath(path, dest_dir): mode for path, mode in setid.items()}, f)


def restore_setid(src_dir, layout):
    """Put back the set-id bits a checkpoint copy recorded (SETID_MANIFEST), on the session's files (its own ids).

    Each file is opened without following a link and must still be a regular file; a copy without a manifest
    (made before set-id bits were stripped) has its bits in place already.
    """
    try:
        with open(os.path.join(src_dir, SETID_MANIFEST)) as f:
            modes = json.load(f)
    except FileNotFoundError:
        return
    for rel, mode in modes.items():
        parts = rel.split(os.sep)
        if parts[0] == "workspace":
            path = os.path.join(layout.workspace, *parts[1:])
        elif parts[0] == "rootfs" and len(parts) > 3 and parts[2] == "upper":
            path = os.path.join(layout.upper(parts[1]), *parts[3:])
        else:
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, mode & 0o7777)
        finally:
            os.close(fd)


def _clear(path):
    """Empty path, keeping the dir itself (it may be a mount point: the session's disk)."""
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


async def replace_state(src_dir, layout, ids: IdRange):
    """The session's writable state := the canonical copy src_dir, owned by the session's range ids."""
    os.makedirs(layout.root, mode=0o700, exist_ok=True)
    for path in (layout.workspace, layout.rootfs):
        await asyncio.to_thread(_clear, path)
    await _run("cp", "-a", "--reflink=auto", os.path.join(src_dir, "workspace") + "/.", layout.workspace)
    src_rootfs = os.path.join(src_dir, "rootfs")
    if os.path.isdir(src_rootfs):
        for layer in sorted(os.listdir(src_rootfs)):
            os.makedirs(os.path.join(layout.rootfs, layer))
            await _run("cp", "-a", "--reflink=auto", os.path.join(src_rootfs, layer, "upper"), layout.upper(layer))
    await asyncio.to_thread(shift_ids, layout.workspace, CANONICAL, ids)
    for layer in layout.layers():
        await asyncio.to_thread(shift_ids, layout.upper(layer), CANONICAL, ids)
    await asyncio.to_thread(restore_setid, src_dir, layout)
