"""`sweep`: remove what planes that are no longer running left on the host (dev machines, killed test runs).

A plane stopped with `down` (or SIGTERM) stops its guests and unmounts everything. A plane killed with
SIGKILL (a killed test run, a crashed CI job) leaves its guests running and their disks, overlays and
cgroups in place, for a restarted plane of the same state dir to adopt. When the state dir is gone (a test's
temporary dir), nothing will ever adopt them: `sweep` stops them and removes what they hold.

Every piece of a plane's host state is keyed by its scope, the hash of its guests dir (GuestManager, the
cgroups microvm/<scope>/<session>, MOUNT_ROOT/<scope>, agentfs' MOUNT_ROOT/<scope>), or lies in its state
dir (the loop-mounted disks). A scope is live while a `microvm_localplane serve` process of that state dir
runs; everything else is swept. By default a scope whose state dir still holds its session records is kept
(a plane started there again adopts its guests); `--stopped-too` sweeps those as well, as `down` would have.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import re
import signal
import subprocess
import time

from . import agentfs, rootfs
from .freezer import CGROUP_ROOT
from .hostpaths import scope_of

MNT_DETACH = 2
KILL_WAIT = 30  # seconds the killed guests get to exit (a loaded host can take a while) before their cgroups go
SCOPE = re.compile(r"^[0-9a-f]{12}$")
SESSION_MOUNT = re.compile(r"^(?P<guests>/.+/guests)/sessions/[0-9a-f-]{36}/(disk|workspace|rootfs|run)$")
LOOP_IMAGE = re.compile(r"\((?P<image>/.+/guests)/sessions/[0-9a-f-]{36}/disk\.img(?: \(deleted\))?\)$")
RUN_ROOTS = (rootfs.MOUNT_ROOT, agentfs.MOUNT_ROOT)


def adoptable(guests_dir: str) -> bool:
    """Whether a plane started on this state dir again would adopt its guests: its session records are there.

    (A removed temporary state dir can leave its guests dir behind, held by the disks mounted in it.)
    """
    return os.path.isdir(os.path.join(os.path.dirname(guests_dir), "sessions"))


def live_guest_dirs() -> set[str]:
    """The guests dirs of the planes running now (`python -m microvm_localplane serve --state-dir X`)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                argv = f.read().decode("utf-8", "replace").split("\0")
            if "microvm_localplane" not in argv or "serve" not in argv:
                continue
            state = next((a.split("=", 1)[1] for a in argv if a.startswith("--state-dir=")), None)
            if state is None and "--state-dir" in argv[:-1]:
                state = argv[argv.index("--state-dir") + 1]
            if state is None:
                continue
            cwd = os.readlink("/proc/%s/cwd" % pid)
            found.add(os.path.join(os.path.normpath(os.path.join(cwd, state)), "guests"))
    return found


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4].encode().decode("unicode_escape") for line in f]


def _unmount(path: str) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.umount2(path.encode(), MNT_DETACH) == 0


def _cgroup_dirs(scope: str) -> list[str]:
    """Every cgroup dir of a scope, in every controller, deepest first."""
    tops = glob.glob(os.path.join(CGROUP_ROOT, "*", "microvm", scope)) + glob.glob(os.path.join(CGROUP_ROOT, "microvm", scope))
    return [root for top in tops for root, _dirs, _files in os.walk(top, topdown=False)]


def _pids(scopes: set[str]) -> list[int]:
    pids = []
    for scope in scopes:
        for cg in _cgroup_dirs(scope):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(cg, "cgroup.procs")) as f:
                pids += [int(line) for line in f if line.strip()]
    return pids


def plan(stopped_too: bool = False) -> dict:
    """What a sweep would remove: {"scopes", "pids", "mounts", "loops"}; nothing is touched."""
    live = {scope_of(d) for d in live_guest_dirs()}

    def dead(guests_dir: str) -> bool:
        return scope_of(guests_dir) not in live and (stopped_too or not adoptable(guests_dir))

    scopes = set()
    for root in RUN_ROOTS:
        with contextlib.suppress(OSError):
            scopes.update(os.listdir(root))
    for cg in glob.glob(os.path.join(CGROUP_ROOT, "*", "microvm", "*")) + glob.glob(os.path.join(CGROUP_ROOT, "microvm", "*")):
        if os.path.isdir(cg):
            scopes.add(os.path.basename(cg))
    scopes = {s for s in scopes if SCOPE.match(s) and s not in live}
    mounts = []
    for point in _mount_points():
        m = SESSION_MOUNT.match(point)
        if m and dead(m.group("guests")):
            mounts.append(point)
        elif m and scope_of(m.group("guests")) in scopes:
            # a stopped plane whose state dir is still there: a plane started there again adopts its guests
            scopes.discard(scope_of(m.group("guests")))
    for point in _mount_points():
        if any(point.startswith(os.path.join(root, s) + "/") for root in RUN_ROOTS for s in scopes):
            mounts.append(point)
    loops = []
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout
    for line in out.splitlines():
        m = LOOP_IMAGE.search(line)
        if m and dead(m.group("image")):
            loops.append(line.split(":", 1)[0])
    return {"scopes": sorted(scopes), "pids": sorted(set(_pids(scopes))),
            "mounts": sorted(set(mounts), key=lambda p: (-p.count("/"), p)), "loops": sorted(loops)}


def _remove_plain_tree(top: str) -> None:
    """A dir of /run with nothing mounted in it: its files and links are unlinked (never followed), its dirs removed."""
    for dirpath, subdirs, files in os.walk(top, topdown=False):
        for name in files + subdirs:
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(top)


def sweep(stopped_too: bool = False, dry_run: bool = False) -> dict:
    """Stop the guests of planes no longer running and remove their mounts, loop devices, cgroups and dirs."""
    todo = plan(stopped_too)
    if dry_run:
        return todo
    for pid in todo["pids"]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT
    for scope in todo["scopes"]:
        for cg in _cgroup_dirs(scope):
            while True:
                try:
                    os.rmdir(cg)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)  # its processes are still dying
    for point in todo["mounts"]:
        _unmount(point)
    for loop in todo["loops"]:
        subprocess.run(["losetup", "-d", loop], capture_output=True, check=False)
    left = set(_mount_points())
    for root in RUN_ROOTS:
        for scope in todo["scopes"]:
            top = os.path.join(root, scope)
            if not any(p == top or p.startswith(top + "/") for p in left):  # never walk into anything mounted
                _remove_plain_tree(top)
    return todo
