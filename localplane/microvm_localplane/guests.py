"""Guests of the local control plane: one runc container per session, in its own user namespace.

Each guest has its own user (ids 0..65535 -> a host range no other session
uses, idmap.py), PID, mount, UTS, IPC, network and cgroup namespaces, the OCI
default hardening (oci.py, seccomp.py), limits by its size (limits.py), a
root filesystem of its own from its template (never the host's) with a
per-session writable upper dir, its own /workspace (persistent) and /tmp
(tmpfs). PID 1 is guest_init; it starts the
gRPC agent on guest port 8443 and hands connected guest sockets to the host
(see guest_init.py); both run on the plane's Python runtime, bound read-only
at a private path (hostpaths.py). runc runs detached with its state under
<state_dir>/runc, so guests outlive the control plane and a restarted one
adopts them; pause and resume are runc's (its cgroup freezer).

State per session: <state_dir>/sessions/<id>/ (see rootfs.SessionLayout).
A checkpoint is a directory with `workspace/` and `rootfs/<layer>/upper/`
(canonical ids, see statecopy.py).

Interface additions (beyond the brief's interface):
- Guest.hostname, Guest.sandbox_id are plain attributes.
- GuestManager.code: the host code paths bound into guests (hostpaths.CodePaths).
- boot()/adopt() take size= (the session's size slug; limits.py).
"""
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

from . import baseimage, disk, guestproc, idmap, netns, oci, portdial
from . import limits as limits_mod
from . import rootfs as rootfs_mod
from .agentfs import AgentFs, AgentFsError
from .errors import DialError, GuestError
from .freezer import GuestCgroup
from .hostpaths import AGENT_LIB, HostPathsError, code_paths, scope_of
from .portdial import dial_bridge, listen_bridge
from .rootfs import RootfsError, SessionLayout
from .statecopy import copy_state, replace_state, shift_ids

__all__ = ["DialError", "Guest", "GuestError", "GuestManager", "RootfsSpec"]

AGENT_PORT = 8443
BOOT_TIMEOUT = 60.0        # generous: a loaded 2-core machine; a healthy boot takes well under a second
# Guests whose agents start at once: each start-up is ~0.3 s of CPU (imports), so 50 at once on 2 cores
# all crawl together and finish together (or miss BOOT_TIMEOUT); a few at a time finish one after another,
# the total is the same, and each one's BOOT_TIMEOUT counts from its own start.
BOOT_CONCURRENCY = 2 * (os.cpu_count() or 1)
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,62})$")
_logger = logging.getLogger("microvm_localplane.guests")


def _base_progress(stage, elapsed):
    """A base rootfs built on demand: its stages in the plane's log (a session's warnings name the current one)."""
    _logger.info(baseimage.progress_line(stage, elapsed))


RUNC = "runc"
BRIDGE_FD = 3              # runc --preserve-fds 1 hands fd 3 to the guest's PID 1
LAUNCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper():
    """`runc run --detach` leaves the guest's PID 1 an orphan: make it ours (not the host init's, which
    may never reap it), so that a stopped guest leaves no zombie. Guests of an earlier plane belong to
    the host's init."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap(pid):
    """Collect pid's exit status if it is our child (a guest PID 1 we adopted as subreaper)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


@dataclass
class RootfsSpec:
    kind: str
    path: str | None = None

    def __post_init__(self):
        if self.kind == "host":  # records saved before the base template had its own rootfs
            self.kind = "base"


def proc_start_time(pid):
    """Start time of pid (clock ticks since boot), None if it is gone or a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


class Guest:
    def __init__(self, manager, layout, session_id, sandbox_id, hostname, pid, pid_start):
        self._manager = manager
        self._layout = layout
        self._cgroup = manager._cgroup(session_id)
        self.session_id = session_id
        self.sandbox_id = sandbox_id
        self.hostname = hostname
        self.pid = pid
        self._pid_start = pid_start
        self.limits = None  # its size's limits, when this plane booted or adopted it (guestproc refreshes them)

    async def dial(self, port):
        """TCP connection to 127.0.0.1:port inside the guest; DialError on refusal."""
        sock = await dial_bridge(self._layout.host, port)
        try:
            return await asyncio.open_connection(sock=sock)
        except Exception:
            sock.close()
            raise

    def freeze(self):
        self._manager._pause(self.session_id)

    def thaw(self):
        self._manager._runc("resume", self.session_id, check=False)

    @property
    def frozen(self):
        return self._cgroup.state() != "THAWED"

    def alive(self):
        if self.pid > 0:
            _reap(self.pid)
        return self.pid > 0 and proc_start_time(self.pid) == self._pid_start

    def memory_bytes(self):
        return self._cgroup.memory_bytes()

    def __repr__(self):
        return "<Guest %s sandbox=%s pid=%d>" % (self.session_id, self.sandbox_id, self.pid)


class GuestManager:
    def __init__(self, state_dir):
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(os.path.join(self.state_dir, "sessions"), exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.runc_root = os.path.join(self.state_dir, "runc")
        self.disk_reserve = disk.DEFAULT_RESERVE   # what new sessions' disks must leave free (admit())
        try:
            self.code = code_paths()
        except HostPathsError as e:
            raise GuestError("guests cannot run the agent: %s" % e) from e
        # cgroups are machine-wide: scope them by state dir so two managers never collide.
        self._scope = scope_of(self.state_dir)
        self._guests = {}
        self._locks = {}
        self._hostlib = None
        self._agentfs = AgentFs(self.state_dir)
        self._starting = asyncio.Semaphore(BOOT_CONCURRENCY)
        # ldd over the agent's runtime takes seconds on a busy machine, and so does byte-compiling the agent's
        # modules: do both now, not in the first boot
        self._hostlib_ready = threading.Thread(target=self._find_hostlib, daemon=True)
        self._hostlib_ready.start()
        _become_subreaper()
        self._proc_views = guestproc.Refresher(lambda: [(g._layout.disk, g.limits, g._cgroup)
                                                        for g in list(self._guests.values()) if g.limits])

    def _find_hostlib(self):
        self.code.compile_package()
        with contextlib.suppress(OSError, subprocess.SubprocessError, AgentFsError):
            self._hostlib = self.code.hostlib(self.state_dir)
            self._agentfs.binds(self.code.binds(self._hostlib))  # mounted now, not in the first boot

    # ------------------------------------------------------------ helpers

    def _layout(self, session_id):
        if not isinstance(session_id, str) or not SESSION_ID_RE.match(session_id):
            raise GuestError("invalid session id: %r" % (session_id,))
        return SessionLayout(self.state_dir, session_id)

    def _cgroup(self, session_id):
        return GuestCgroup(self._scope, session_id)

    def _lock(self, session_id):
        return self._locks.setdefault(session_id, asyncio.Lock())

    def get(self, session_id):
        return self._guests.get(session_id)

    def admit(self, sizes):
        """Refuse new sessions of these size slugs (disk.DiskCapacityError) whose disks the host cannot hold."""
        disk.admit(self.state_dir, [limits_mod.for_size(size).disk for size in sizes], self.disk_reserve)

    def _runc(self, *args, check=True):
        proc = subprocess.run([RUNC, "--root", self.runc_root, *args], capture_output=True, text=True, check=False,
                              env={"PATH": LAUNCH_PATH})
        if check and proc.returncode != 0:
            raise GuestError("runc %s failed: %s" % (args[0], (proc.stderr or proc.stdout).strip()[-500:]))
        return proc

    def _pause(self, session_id, attempts=10):
        """runc pause; retried: the v1 freezer gives up while a task is busy in the kernel (FREEZING)."""
        for attempt in range(attempts):
            proc = self._runc("pause", session_id, check=False)
            if proc.returncode == 0:
                return
            state = self._state(session_id)
            if state is not None and state.get("status") == "paused":
                return
            if attempt == attempts - 1 or state is None or state.get("status") != "running":
                raise GuestError("cannot pause guest %s: %s" % (session_id, (proc.stderr or proc.stdout).strip()[-300:]))
            time.sleep(0.05 * (attempt + 1))

    def _state(self, session_id):
        """runc's view of the guest: {"status", "pid", ...} or None when there is no container."""
        proc = self._runc("state", session_id, check=False)
        if proc.returncode != 0:
            return None
        try:
            return json.loads(proc.stdout)
        except ValueError:
            return None

    def _ids(self, layout, size=None):
        """The session's host id range (kept across boots), with its disk mounted; re-owns its files if
        the range had to change."""
        recorded = None
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError), open(layout.ids_file) as f:
            rec = json.load(f)
            recorded = (int(rec["slot"]), idmap.IdRange(int(rec["uid"]), int(rec["gid"])))
        try:
            slot, ids = idmap.claim_slot(layout.root, recorded[0] if recorded else None)
            disk.ensure(self.state_dir, layout, limits_mod.for_size(size).disk, ids)
        except (idmap.IdmapError, disk.DiskError) as e:
            raise GuestError("session %s: %s" % (layout.session_id, e)) from e
        if recorded and recorded[1] != ids:
            shift_ids(layout.workspace, recorded[1], ids)
            for layer in layout.layers():
                shift_ids(layout.upper(layer), recorded[1], ids)
            shift_ids(layout.run, recorded[1], ids)
        if not recorded or recorded[0] != slot or recorded[1] != ids:
            os.makedirs(layout.host, mode=0o700, exist_ok=True)
            with open(layout.ids_file, "w") as f:
                json.dump({"slot": slot, "uid": ids.uid, "gid": ids.gid}, f)
        return ids

    # ------------------------------------------------------------ boot

    async def boot(self, session_id, sandbox_id, rootfs, env, egress, hostname, size=None):
        """Start the guest; returns when its agent answers on guest port 8443."""
        layout = self._layout(session_id)
        async with self._lock(session_id):
            current = self._guests.get(session_id)
            if current is not None and current.alive():
                raise GuestError("session %s already has a running guest" % session_id)
            return await self._boot(layout, session_id, sandbox_id, rootfs, env, egress, hostname, size)

    def _prepare(self, layout, rootfs, env, hostname, size, egress=None):
        """Everything before runc starts: ids, dirs, mounts, config. -> (limits, ids)."""
        if not shutil.which(RUNC, path=LAUNCH_PATH):
            raise GuestError("guests need runc: apt-get install runc uidmap (or `make system-deps`)")
        base_dir = (baseimage.ensure(self.state_dir, log=_logger.info, progress=_base_progress)
                    if rootfs.kind == "base" else None)
        os.makedirs(layout.root, mode=0o700, exist_ok=True)
        ids = self._ids(layout, size)
        lowers = rootfs_mod.lower_dirs(self.state_dir, rootfs, self.code, base_dir)
        # The agent always runs on the plane's own Python runtime (bound read-only at a private path):
        # its archive safety needs tarfile's extraction filters, which a template's Python may lack
        # (bookworm's 3.11.2 has none), and a template may have no Python at all.
        self._hostlib_ready.join()
        if self._hostlib is None or not os.path.isdir(self._hostlib):
            self._hostlib = self.code.hostlib(self.state_dir)
        hostlib = self._hostlib
        layout.create(["root"], ids)
        rootfs_mod.write_identity(layout, lowers, hostname, ids, netns.guest_resolvers(egress))
        # The session's env reaches the agent's command baseline through the guest's own run dir; never logged.
        rootfs_mod.write_session_env(layout, {str(k): str(v) for k, v in (env or {}).items()}, ids)
        limits = limits_mod.for_size(size)
        rootfs_mod.mount_root(layout, lowers, ids)
        python = self.code.python_argv()
        # -S: the agent needs nothing of site (its packages are on PYTHONPATH); the runtime's site-packages
        # .pth hooks would run in every guest and cost tens of ms of its boot.
        args = python + ["-I", "-S", AGENT_LIB + "/microvm_localplane/guest_init.py", "--run-dir", rootfs_mod.GUEST_RUN_DIR,
                         "--bridge-fd", str(BRIDGE_FD), "--"] + python + ["-S", "-m", "microvm_localplane.agent"]
        proc_env = {"PATH": LAUNCH_PATH, "LANG": "C.UTF-8", "HOME": "/root"}
        proc_env.update(self.code.env())
        binds = [(layout.workspace, rootfs_mod.WORKSPACE, False), (layout.run, rootfs_mod.GUEST_RUN_DIR, False)]
        try:  # from read-only overlays, so the guest's mountinfo shows no host path (agentfs.py)
            binds += [(h, g, True) for h, g in self._agentfs.binds(self.code.binds(hostlib))]
        except (AgentFsError, OSError) as e:
            raise GuestError(str(e)) from e
        binds += guestproc.prepare(layout.disk, limits)  # from the session's disk: mountinfo shows /proc/<name>
        config = oci.config(rootfs=layout.merged, hostname=hostname, args=args, env=proc_env, ids=ids, binds=binds,
                            limits=limits, cgroups_path=self._cgroup(layout.session_id).runc_path,
                            tmp_size=limits.tmp, masked=self.code.masked_paths())
        with open(os.path.join(layout.bundle, "config.json"), "w") as f:
            json.dump(config, f)
        return limits, ids

    async def _boot(self, layout, session_id, sandbox_id, rootfs, env, egress, hostname, size=None):
        if not isinstance(hostname, str) or not HOSTNAME_RE.match(hostname):
            raise GuestError("invalid hostname: %r" % (hostname,))
        rootfs = rootfs if isinstance(rootfs, RootfsSpec) else RootfsSpec(**rootfs)
        try:
            netns.parse_egress(egress)
        except netns.EgressError as e:
            raise GuestError(str(e)) from e
        await asyncio.to_thread(self._kill, layout)   # a crash may have left a container or mounts behind
        try:
            _limits, ids = await asyncio.to_thread(self._prepare, layout, rootfs, env, hostname, size, egress)
        except (RootfsError, OSError, idmap.IdmapError, baseimage.BaseImageError, disk.DiskError) as e:
            await asyncio.to_thread(rootfs_mod.unmount_root, layout)
            raise GuestError("cannot prepare guest %s: %s" % (session_id, e)) from e
        try:
            async with self._starting:
                init_pid = await asyncio.to_thread(self._start, layout, session_id, ids)
                pid_start = proc_start_time(init_pid)
                # The network is set up while the agent starts: both only need the namespaces.
                await asyncio.gather(self._setup_network(layout, init_pid, egress), self._wait_ready(layout, init_pid))
            if proc_start_time(init_pid) != pid_start or pid_start is None:
                raise GuestError("guest init exited during boot: %s" % _log_tail(layout))
        except BaseException:
            await asyncio.to_thread(self._kill, layout)
            raise
        meta = {"session_id": session_id, "sandbox_id": sandbox_id, "hostname": hostname, "pid": init_pid,
                "pid_start": pid_start, "rootfs": asdict(rootfs), "egress": egress, "size": size,
                "booted_at": time.time()}
        layout.write_meta(meta)
        guest = Guest(self, layout, session_id, sandbox_id, hostname, init_pid, pid_start)
        guest.limits = _limits
        self._guests[session_id] = guest
        return guest

    def _start(self, layout, session_id, ids):
        """runc run --detach with the bridge socket as the guest's fd 3; -> host pid of its PID 1."""
        try:
            bridge = listen_bridge(layout)
        except OSError as e:
            raise GuestError("cannot prepare guest: %s" % e) from e
        try:
            console = _open_console(layout, ids)
        except OSError as e:
            bridge.close()
            raise GuestError("cannot prepare guest: its console: %s" % e) from e
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            argv = [shutil.which(RUNC, path=LAUNCH_PATH), "--root", self.runc_root, "run", "--detach",
                    "--pid-file", layout.pid_file, "--bundle", layout.bundle, "--preserve-fds", "1", session_id]
            # runc's own errors and PID 1's output (inherited by the agent) go to the console on the guest's disk
            actions = [(os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, console, 1),
                       (os.POSIX_SPAWN_DUP2, console, 2), (os.POSIX_SPAWN_DUP2, bridge.fileno(), BRIDGE_FD)]
            pid = os.posix_spawn(argv[0], argv, {"PATH": LAUNCH_PATH}, file_actions=actions, setsid=True)
            _pid, status = os.waitpid(pid, 0)
        finally:
            bridge.close()  # the guest's PID 1 holds it now
            os.close(console)
            os.close(null)
        if os.waitstatus_to_exitcode(status) != 0:
            raise GuestError("guest did not start: %s" % _log_tail(layout))
        try:
            with open(layout.pid_file) as f:
                return int(f.read().strip())
        except (OSError, ValueError) as e:
            raise GuestError("guest did not start (no pid): %s" % _log_tail(layout)) from e

    async def _setup_network(self, layout, init_pid, egress):
        """eth0 and the egress policy; a guest whose network fails keeps loopback only (never more open)."""
        net_file = os.path.join(layout.host, "net.json")
        try:
            record = await asyncio.to_thread(netns.setup, init_pid, egress, lambda msg: _log(layout, msg))
        except (netns.EgressError, OSError) as e:
            _log(layout, "no network for this guest: %s" % e)
            return
        with open(net_file, "w") as f:
            json.dump(record, f)

    async def _wait_ready(self, layout, init_pid):
        deadline = time.monotonic() + BOOT_TIMEOUT
        delay = 0.002
        while True:
            if proc_start_time(init_pid) is None:
                raise GuestError("guest exited during boot: %s" % _log_tail(layout))
            try:
                sock = await dial_bridge(layout.host, AGENT_PORT, timeout=portdial.DIAL_TIMEOUT)
                sock.close()
                return
            except DialError as e:
                if time.monotonic() > deadline:
                    raise GuestError("guest agent did not answer within %.0f s: %s" % (BOOT_TIMEOUT, _log_tail(layout))) from e
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.01)

    # ------------------------------------------------------------ adopt

    async def adopt(self, session_id, sandbox_id, rootfs, env, egress, hostname, size=None):
        """Reattach to a guest that outlived the control plane, else boot again from its state."""
        layout = self._layout(session_id)
        async with self._lock(session_id):
            current = self._guests.get(session_id)
            if current is not None and current.alive():
                return current
            meta = layout.read_meta()
            state = await asyncio.to_thread(self._state, session_id)
            if meta and state and state.get("status") in ("running", "paused") and int(state.get("pid") or 0) == \
                    int(meta.get("pid") or -1):
                guest = Guest(self, layout, session_id, meta.get("sandbox_id", sandbox_id), meta.get("hostname", hostname),
                              int(meta["pid"]), meta.get("pid_start"))
                guest.limits = limits_mod.for_size(meta.get("size", size))
                if guest.alive() and (guest.frozen or await self._answers(layout)):
                    if guest.sandbox_id != sandbox_id:
                        guest.sandbox_id = sandbox_id
                        layout.write_meta(dict(meta, sandbox_id=sandbox_id))
                    self._guests[session_id] = guest
                    await asyncio.to_thread(self._reattach_network, layout)
                    return guest
            return await self._boot(layout, session_id, sandbox_id, rootfs, env, egress, hostname, size)

    def _reattach_network(self, layout):
        """A reattached guest's DNS (an allowlist) is this process's responder now; its policy is unchanged."""
        try:
            with open(os.path.join(layout.host, "net.json")) as f:
                netns.reattach(json.load(f))
        except FileNotFoundError:
            pass  # no network (it failed at boot): nothing to answer
        except (OSError, ValueError, netns.EgressError) as e:
            _log(layout, "egress DNS not reattached: %s" % e)

    async def _answers(self, layout):
        for _attempt in range(3):
            try:
                (await dial_bridge(layout.host, AGENT_PORT)).close()
                return True
            except DialError:
                await asyncio.sleep(0.2)
        return False

    # ------------------------------------------------------------ stop / destroy

    async def stop(self, session_id):
        """Kill every guest process; the persistent state stays."""
        layout = self._layout(session_id)
        async with self._lock(session_id):
            self._guests.pop(session_id, None)
            await asyncio.to_thread(self._kill, layout)

    def _kill(self, layout):
        """The container (every process: its PID namespace dies with PID 1), its network and mounts."""
        if os.path.isdir(os.path.join(self.runc_root, layout.session_id)):
            pids = self._cgroup(layout.session_id).pids()
            self._runc("delete", "--force", layout.session_id, check=False)
            # runc returns once they are killed; wait until the kernel has reaped them too
            deadline = time.monotonic() + 10
            while any(proc_start_time(p) is not None for p in pids) and time.monotonic() < deadline:
                time.sleep(0.002)
            for p in pids:
                _reap(p)  # ours (we are their subreaper) leave no zombie; an earlier plane's go to the host's init
        net_file = os.path.join(layout.host, "net.json")
        try:
            with open(net_file) as f:
                netns.teardown(json.load(f))
            os.unlink(net_file)
        except (OSError, ValueError):
            pass
        rootfs_mod.unmount_root(layout)
        for name in ("agent.pid", "agent.fallback"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(layout.run, name))
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(layout.host, layout.bridge_name))

    async def destroy(self, session_id):
        layout = self._layout(session_id)
        await self.stop(session_id)
        async with self._lock(session_id):
            await asyncio.to_thread(disk.release, layout)
            await asyncio.to_thread(shutil.rmtree, layout.root, True)
        self._locks.pop(session_id, None)

    # ------------------------------------------------------------ checkpoints

    def _running(self, session_id):
        state = self._state(session_id)
        return state is not None and state.get("status") in ("running", "paused", "created")

    async def checkpoint(self, session_id, dest_dir):
        """Consistent copy of workspace + root changes (the guest is frozen while copying); -> size_bytes."""
        layout = self._layout(session_id)
        if not layout.exists():
            raise GuestError("no state for session %s" % session_id)
        async with self._lock(session_id):
            ids = await asyncio.to_thread(self._ids, layout)
            state = await asyncio.to_thread(self._state, session_id)
            froze = False
            if state is not None and state.get("status") == "running":
                await asyncio.to_thread(self._pause, session_id)
                froze = True
            try:
                await copy_state(layout, dest_dir, ids)
            finally:
                if froze:
                    await asyncio.to_thread(self._runc, "resume", session_id, check=False)
        return await asyncio.to_thread(rootfs_mod.tree_size, dest_dir)

    async def restore(self, session_id, src_dir):
        """Replace the (stopped) guest's writable state with a checkpoint copy, exactly."""
        layout = self._layout(session_id)
        if not os.path.isdir(os.path.join(src_dir, "workspace")):
            raise GuestError("not a checkpoint directory: %s" % src_dir)
        async with self._lock(session_id):
            guest = self._guests.get(session_id)
            if (guest is not None and guest.alive()) or await asyncio.to_thread(self._running, session_id):
                raise GuestError("session %s is running; stop it before a restore" % session_id)
            ids = await asyncio.to_thread(self._ids, layout)
            await replace_state(src_dir, layout, ids)

    async def clone_state(self, src_session_id, dst_session_id, src_dir=None):
        """Give dst the writable state of src (its current state, or the checkpoint copy src_dir)."""
        dst = self._layout(dst_session_id)
        if await asyncio.to_thread(self._running, dst_session_id):
            raise GuestError("session %s is running; cannot clone into it" % dst_session_id)
        os.makedirs(dst.root, mode=0o700, exist_ok=True)
        if src_dir is None:
            staging = os.path.join(self.state_dir, "sessions", ".clone-%s" % dst_session_id)
            await asyncio.to_thread(shutil.rmtree, staging, True)
            try:
                await self.checkpoint(src_session_id, staging)
                async with self._lock(dst_session_id):
                    await replace_state(staging, dst, await asyncio.to_thread(self._ids, dst))
            finally:
                await asyncio.to_thread(shutil.rmtree, staging, True)
        else:
            async with self._lock(dst_session_id):
                await replace_state(src_dir, dst, await asyncio.to_thread(self._ids, dst))

    # ------------------------------------------------------------ shutdown

    async def shutdown(self, stop_guests):
        """The control plane is exiting; stop_guests=False leaves guests running for adopt()."""
        if stop_guests:
            for session_id in list(self._guests):
                await self.stop(session_id)
            # nothing of this plane runs any more: no session's disk stays mounted (boot mounts it again)
            for session_id in os.listdir(os.path.join(self.state_dir, "sessions")):
                if SESSION_ID_RE.match(session_id) and not await asyncio.to_thread(self._running, session_id):
                    await asyncio.to_thread(disk.release, self._layout(session_id))
            remove_empty_mount_dirs(os.path.dirname(self._layout("x").mount_dir))
        self._guests.clear()
        await asyncio.to_thread(self._agentfs.close)


def remove_empty_mount_dirs(scope_dir: str) -> None:
    """This plane's dir under /run (MOUNT_ROOT/<scope>), when empty: nothing of it stays behind after `down`.

    A guest still mounted keeps it (rmdir refuses a non-empty dir). MOUNT_ROOT itself is shared by every plane
    of the host, and another plane may be making its own dir in it right now: it stays.
    """
    with contextlib.suppress(OSError):
        os.rmdir(scope_dir)


PLANE_LOG_MAX = 1 << 20     # the plane's notes about one guest: a few lines a boot; emptied past this
CONSOLE_TAIL = 2000         # bytes of the guest's console an error message shows


def _log(layout, msg):
    with contextlib.suppress(OSError):
        with contextlib.suppress(FileNotFoundError):
            if os.stat(layout.log_file).st_size > PLANE_LOG_MAX:
                os.truncate(layout.log_file, 0)
        with open(layout.log_file, "a") as log:
            log.write("localplane: %s\n" % msg)


def _open_console(layout, ids):
    """A fresh console for this boot: a file in the guest's run dir, so on the guest's own disk, owned by its root.

    PID 1's stdout and stderr (and so the agent's) are the guest's: guest root can always get hold of them
    (pidfd_getfd, ptrace), so they must never be a host file it could fill past its disk. The guest wrote in
    the run dir while it ran (it is stopped now): the name is removed first and the file made anew, never
    following what it left there.
    """
    run_fd = os.open(layout.run, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.unlink(layout.console_name, dir_fd=run_fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(os.path.join(layout.run, layout.console_name))  # rmtree never follows links
        fd = os.open(layout.console_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND
                     | os.O_CLOEXEC, 0o600, dir_fd=run_fd)
        os.fchown(fd, ids.uid, ids.gid)
        return fd
    finally:
        os.close(run_fd)


def _shown(text):
    """Guest-written text made safe to quote in a message: printable characters only, on one line."""
    clean = "".join(c if c.isprintable() else "\n" if c in "\r\n" else "?" for c in text)
    return " | ".join(line.strip() for line in clean.split("\n") if line.strip())


def _log_tail(layout, limit=CONSOLE_TAIL):
    """The end of the guest's console (runc's errors, PID 1's and the agent's output), for an error message.

    It is the guest's own text: read without following a link it planted or blocking on a FIFO, at most
    `limit` bytes, sanitized, and labelled as the guest's.
    """
    try:
        run_fd = os.open(layout.run, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fd = os.open(layout.console_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=run_fd)
        finally:
            os.close(run_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return "guest console: (not a file)"
            data = os.pread(fd, limit, max(0, st.st_size - limit))
        finally:
            os.close(fd)
    except OSError:
        return "guest console: (none)"
    return "guest console: %s" % (_shown(data.decode("utf-8", "replace")) or "(no output)")
