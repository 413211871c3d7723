"""Copies of a session's writable state: checkpoint, restore, clone.

A copy is `workspace/` plus `rootfs/<layer>/upper/`, made with `cp -a` so that
overlay whiteouts, xattrs, links and modes survive exactly.
"""
import asyncio
import os
import shutil

from .errors import GuestError


async def _run(*argv):
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _out, err = await proc.communicate()
    if proc.returncode != 0:
        raise GuestError("%s failed: %s" % (argv[0], err.decode(errors="replace").strip()[-500:]))


async def copy_state(layout, dest_dir):
    """workspace/ and rootfs/<layer>/upper/ -> dest_dir (cp -a keeps overlay whiteouts and xattrs)."""
    os.makedirs(dest_dir, exist_ok=True)
    if os.listdir(dest_dir):
        raise GuestError("checkpoint destination is not empty: %s" % dest_dir)
    await _run("cp", "-a", "--reflink=auto", layout.workspace, os.path.join(dest_dir, "workspace"))
    for layer in layout.layers():
        os.makedirs(os.path.join(dest_dir, "rootfs", layer))
        await _run("cp", "-a", "--reflink=auto", layout.upper(layer), os.path.join(dest_dir, "rootfs", layer, "upper"))


async def replace_state(src_dir, layout):
    os.makedirs(layout.root, mode=0o700, exist_ok=True)
    for path in (layout.workspace, layout.rootfs):
        await asyncio.to_thread(shutil.rmtree, path, True)
    await _run("cp", "-a", "--reflink=auto", os.path.join(src_dir, "workspace"), layout.workspace)
    src_rootfs = os.path.join(src_dir, "rootfs")
    if os.path.isdir(src_rootfs):
        for layer in sorted(os.listdir(src_rootfs)):
            os.makedirs(os.path.join(layout.rootfs, layer))
            await _run("cp", "-a", "--reflink=auto", os.path.join(src_rootfs, layer, "upper"), layout.upper(layer))
