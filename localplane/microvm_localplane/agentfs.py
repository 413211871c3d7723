"""The agent's runtime as guests see it: read-only overlays that keep host paths out of a guest's mountinfo.

A bind mount shows, in /proc/<pid>/mountinfo, its source's path within its file system: binding the plane's
stdlib (say /root/.pyenv/versions/3.11.7/lib/python3.11), its checkout and its state dir told every guest where
they are on the host. So each source directory is first mounted on the host as a read-only overlay of its own (a
new file system whose root is that directory; its options name relative paths only, `lowerdir=s:e`, given from a
directory holding the link `s` to the source and an empty dir `e`: overlayfs wants two lower layers when it has no
upper one), and guests bind from those overlays: their mountinfo shows `/`, or a file's name below it.

One overlay per source directory and plane (state dir), under MOUNT_ROOT (a tmpfs, never the state dir, so a
crashed plane's overlays cannot get in the way of removing its state dir), mounted when a guest first needs it and
unmounted at shutdown; a plane starting on the same state dir first unmounts what a crashed one left (the checkout
may have changed since). Nothing under them can be written (no upper layer).
"""
import hashlib
import os
import subprocess
import threading

from . import idmap
from .hostpaths import scope_of

MOUNT_ROOT = "/run/microvm-localplane/agentfs"

SOURCE_LINK, EMPTY_DIR, MOUNT_DIR = "s", "e", "m"


class AgentFsError(Exception):
    pass


class AgentFs:
    def __init__(self, state_dir: str) -> None:
        self.root = os.path.join(MOUNT_ROOT, scope_of(state_dir))
        self._mounted: dict = {}          # source dir -> its overlay's mount point
        self._binds: dict = {}            # the binds asked for -> the binds from the overlays (every boot asks)
        self._lock = threading.Lock()      # boots prepare their binds in threads
        self._closed = False
        self._sweep()

    def _sweep(self) -> None:
        """Unmount what a plane on this state dir left mounted (it crashed, or was killed)."""
        try:
            with open("/proc/self/mounts") as f:
                points = [line.split()[1] for line in f]
        except OSError:
            return
        for point in points:
            if point.startswith(self.root + "/"):
                idmap.unmount(point)

    def binds(self, binds: list) -> list:
        """[(host path, guest path)] -> the same binds, each from a read-only overlay of its source's directory."""
        key = tuple(binds)
        cached = self._binds.get(key)
        if cached is not None:
            return cached
        out = []
        for host, guest in binds:
            if os.path.isdir(host):
                out.append((self._overlay(host), guest))
            else:  # a file: bound from the overlay of its directory
                out.append((os.path.join(self._overlay(os.path.dirname(host)), os.path.basename(host)), guest))
        self._binds[key] = out
        return out

    def _overlay(self, source: str) -> str:
        source = os.path.realpath(source)
        with self._lock:
            if self._closed:  # the plane is shutting down (a mount made now would outlive it)
                raise AgentFsError("the plane is shutting down: no new guest")
            mount = self._mounted.get(source)
            if mount is None:
                mount = self._mount(source)
                self._mounted[source] = mount
            return mount

    def _mount(self, source: str) -> str:
        base = os.path.join(self.root, hashlib.sha256(source.encode()).hexdigest()[:16])
        mount = os.path.join(base, MOUNT_DIR)
        idmap.unmount(mount)  # a crashed plane's overlay: its source may have changed since
        for d in (MOUNT_ROOT, self.root, base, os.path.join(base, EMPTY_DIR), mount):
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o755)  # runc binds from inside the guest's user namespace: it must traverse
        link = os.path.join(base, SOURCE_LINK)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(source, link)
        # Relative names, given from base: what the overlay's options show in a guest's mountinfo.
        proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                               "ro,lowerdir=%s:%s" % (SOURCE_LINK, EMPTY_DIR), mount],
                              cwd=base, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise AgentFsError("cannot mount the agent's runtime %s read-only for guests: %s"
                               % (source, proc.stderr.strip()))
        return mount

    def close(self) -> None:
        """Unmount every overlay (lazily: running guests keep their own binds of them)."""
        with self._lock:
            self._closed = True
            mounts, self._mounted, self._binds = list(self._mounted.values()), {}, {}
        for mount in mounts:
            idmap.unmount(mount)
