"""Copies of a session's writable state: checkpoint, restore, clone.

A copy is `workspace/` plus `rootfs/<layer>/upper/`, made with `cp -a` so that
overlay whiteouts, xattrs, links and modes survive exactly.

Owners: a session's state belongs to its own host id range (idmap.py); a
checkpoint copy holds canonical ids (0 = the guest's root), so that it can be
restored into, or forked to, a session with any range.
"""
import asyncio
import os
import shutil

from .errors import GuestError
from .idmap import GUEST_IDS, IdRange

CANONICAL = IdRange(0, 0)


async def _run(*argv):
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _out, err = await proc.communicate()
    if proc.returncode != 0:
        raise GuestError("%s failed: %s" % (argv[0], err.decode(errors="replace").strip()[-500:]))


def shift_ids(root, old: IdRange, new: IdRange):
    """Re-own every file under root from range old to range new (ids outside old stay as they are)."""
    if old == new or not os.path.lexists(root):
        return

    def shift(path):
        st = os.lstat(path)
        uid = st.st_uid - old.uid + new.uid if old.uid <= st.st_uid < old.uid + GUEST_IDS else -1
        gid = st.st_gid - old.gid + new.gid if old.gid <= st.st_gid < old.gid + GUEST_IDS else -1
        if uid != -1 or gid != -1:
            mode = st.st_mode
            os.lchown(path, uid, gid)
            if mode & 0o6000 and not os.path.islink(path):
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
    await asyncio.to_thread(shift_ids, dest_dir, ids, CANONICAL)


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
