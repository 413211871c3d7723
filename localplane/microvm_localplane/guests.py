"""Guests of the local control plane: one isolated bubblewrap guest per session.

Each guest has its own mount, PID, UTS, IPC and network namespaces, a root
filesystem from its template with a per-session writable upper dir, its own
/workspace (persistent) and /tmp (tmpfs). PID 1 is guest_init, which runs the
gRPC agent on guest port 8443 and hands connected guest sockets to the host
(see guest_init.py). Every guest process is in a per-session freezer and
memory cgroup (freezer.py), which is how pause, memory accounting and stop
reach all of them. Guests are started in their own session and outlive the
control plane, so a restarted control plane can adopt them.

State per session: <state_dir>/sessions/<id>/ (see rootfs.SessionLayout).
A checkpoint is a directory with `workspace/` and `rootfs/<layer>/upper/`.

Interface additions (beyond the brief's interface, nothing changed):
- Guest.hostname, Guest.sandbox_id are plain attributes.
- GuestManager.code: the host code paths bound into guests (hostpaths.CodePaths).
- Env MICROVM_LOCALPLANE_WARM=0 turns off the warm helpers (launcher.py,
  zygote.py): guests then start through a shell script and each guest's PID 1
  starts its own agent (slower boot, more memory). Each helper falls back to
  that path on its own when it fails.
"""
import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass

from . import launcher as launcher_mod
from . import netns, portdial
from . import rootfs as rootfs_mod
from .errors import DialError, GuestError
from .freezer import GuestCgroup
from .hostpaths import code_paths
from .portdial import dial_bridge, listen_bridge
from .rootfs import RootfsError, SessionLayout
from .statecopy import copy_state, replace_state
from .warm import Launched, WarmProcess, exe_name, proc_start_time

__all__ = ["DialError", "Guest", "GuestError", "GuestManager", "RootfsSpec"]

AGENT_PORT = 8443
BOOT_TIMEOUT = 60.0        # generous: a loaded 2-core machine; a healthy boot takes well under a second
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,62})$")


@dataclass
class RootfsSpec:
    kind: str
    path: str | None = None


class Guest:
    def __init__(self, manager, layout, session_id, sandbox_id, hostname, pid, pid_start, launched=None):
        self._manager = manager
        self._layout = layout
        self._cgroup = manager._cgroup(session_id)
        self._launched = launched
        self.session_id = session_id
        self.sandbox_id = sandbox_id
        self.hostname = hostname
        self.pid = pid
        self._pid_start = pid_start

    async def dial(self, port):
        """TCP connection to 127.0.0.1:port inside the guest; DialError on refusal."""
        sock = await dial_bridge(self._layout.host, port)
        try:
            return await asyncio.open_connection(sock=sock)
        except Exception:
            sock.close()
            raise

    def freeze(self):
        self._cgroup.freeze()

    def thaw(self):
        self._cgroup.thaw()

    @property
    def frozen(self):
        return self._cgroup.state() != "THAWED"

    def alive(self):
        if self._launched is not None:
            self._launched.running()  # reaps the shell launcher if it is our child
        return self.pid > 0 and proc_start_time(self.pid) == self._pid_start

    def memory_bytes(self):
        return self._cgroup.memory_bytes()

    def __repr__(self):
        return "<Guest %s sandbox=%s pid=%d>" % (self.session_id, self.sandbox_id, self.pid)


def _refuse_code_under_guest_tmp(code):
    """Every guest mounts a fresh /tmp; code bound from under the host's /tmp would show there."""
    under = [p for p in code.read_only_binds() if p == "/tmp" or p.startswith("/tmp/")]
    if under:
        raise GuestError(
            "the local control plane binds its Python and code into every guest at the same paths, but %s "
            "lies under /tmp, where each guest has its own empty /tmp (a template must leave /tmp empty). "
            "Move the checkout and its virtualenv out of /tmp (for example to /var/tmp or your home)." % ", ".join(under))


class GuestManager:
    def __init__(self, state_dir):
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(os.path.join(self.state_dir, "sessions"), exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self.code = code_paths()
        _refuse_code_under_guest_tmp(self.code)
        # cgroups are machine-wide: scope them by state dir so two managers never collide.
        self._scope = hashlib.sha256(self.state_dir.encode()).hexdigest()[:12]
        self._guests = {}
        self._locks = {}
        self._zygote = self._launcher = None
        if os.environ.get("MICROVM_LOCALPLANE_WARM", "1") != "0":
            self._zygote = WarmProcess(self.code, "microvm_localplane.zygote", os.path.join(self.state_dir, "zygote.log"))
            self._launcher = WarmProcess(self.code, "microvm_localplane.launcher",
                                         os.path.join(self.state_dir, "launcher.log"))
            # Warm them now (the zygote's imports take ~0.3 s) so that the first boot is fast too.
            threading.Thread(target=self._warm_helpers, daemon=True).start()

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

    def _warm_helpers(self):
        for helper in (self._launcher, self._zygote):
            try:
                helper.warm()
            except Exception:
                pass  # boot() retries, and falls back to the shell launch and the guest's own agent

    # ------------------------------------------------------------ boot

    async def boot(self, session_id, sandbox_id, rootfs, env, egress, hostname):
        """Start the guest; returns when its agent answers on guest port 8443."""
        layout = self._layout(session_id)
        async with self._lock(session_id):
            current = self._guests.get(session_id)
            if current is not None and current.alive():
                raise GuestError("session %s already has a running guest" % session_id)
            return await self._boot(layout, session_id, sandbox_id, rootfs, env, egress, hostname)

    async def _boot(self, layout, session_id, sandbox_id, rootfs, env, egress, hostname):
        if not isinstance(hostname, str) or not HOSTNAME_RE.match(hostname):
            raise GuestError("invalid hostname: %r" % (hostname,))
        rootfs = rootfs if isinstance(rootfs, RootfsSpec) else RootfsSpec(**rootfs)
        missing = [p for p in self.code.read_only_binds() if not os.path.exists(p)]
        if missing:
            raise GuestError("cannot boot guests: missing %s (the plane's Python or its package moved; reinstall it)"
                             % ", ".join(missing))
        try:
            netns.parse_egress(egress)
        except netns.EgressError as e:
            raise GuestError(str(e))
        cgroup = self._cgroup(session_id)
        if cgroup.exists():  # a crash may have left processes or a cgroup behind
            await asyncio.to_thread(self._clean_leftovers, layout, cgroup)
        try:
            mounts = rootfs_mod.overlays(self.state_dir, layout, rootfs, self.code)
            layers = [m[0] for m in mounts]
            layout.create(layers)
            rootfs_mod.write_identity(layout, mounts, hostname)
            # The session's env reaches the agent's command baseline through the guest's own run dir; never logged.
            rootfs_mod.write_session_env(layout, {str(k): str(v) for k, v in (env or {}).items()})
            cgroup.create()
            own_userland = rootfs.kind == "host"
            python = self.code.python_argv(own_userland)
            guest_argv = python + ["-I", "-S", os.path.join(self.code.package_dir, "guest_init.py"),
                                   "--run-dir", rootfs_mod.GUEST_RUN_DIR]
            if self._zygote is not None:
                guest_argv.append("--external-agent")
            guest_argv += ["--bridge-fd", launcher_mod.BRIDGE_FD_PLACEHOLDER]
            guest_argv += ["--"] + python + ["-m", "microvm_localplane.agent"]
            overlay = rootfs_mod.overlay_mounts(layout, mounts)
            bwrap = rootfs_mod.bwrap_argv(layout, self.code, hostname, guest_argv, host_libs=not own_userland)
        except (RootfsError, OSError) as e:
            raise GuestError("cannot prepare guest %s: %s" % (session_id, e))
        launched = await self._launch(layout, cgroup, overlay, bwrap)
        try:
            init_pid = await self._wait_exec(layout, launched)
            # The agent and the network are set up side by side: both only need the namespaces.
            steps = [self._setup_network(layout, init_pid, egress)]
            if self._zygote is not None:
                steps.append(self._place_agent(layout, init_pid))
            await asyncio.gather(*steps)
            pid, pid_start = await self._wait_ready(layout, launched)
        except BaseException:
            await asyncio.to_thread(self._kill, layout, cgroup, launched)
            raise
        meta = {"session_id": session_id, "sandbox_id": sandbox_id, "hostname": hostname, "pid": pid,
                "pid_start": pid_start, "rootfs": asdict(rootfs), "egress": egress, "booted_at": time.time()}
        layout.write_meta(meta)
        guest = Guest(self, layout, session_id, sandbox_id, hostname, pid, pid_start, launched)
        self._guests[session_id] = guest
        return guest

    async def _launch(self, layout, cgroup, overlay, bwrap):
        """Start the guest: through the warm launcher (one exec), else the shell path."""
        launch_env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONPATH": self.code.pythonpath(),
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        if self._launcher is not None:
            bwrap_path = shutil.which("bwrap", path=launch_env["PATH"]) or "/usr/bin/bwrap"
            request = {"argv": [bwrap_path] + bwrap[1:], "env": launch_env, "cgroup_procs": cgroup.procs_files(),
                       "mounts": overlay, "log": layout.log_file, "info": layout.info_file,
                       "bridge": os.path.join(layout.host, layout.bridge_name)}
            try:
                answer = await asyncio.to_thread(self._launcher.request, request)
            except Exception as e:
                answer = {"ok": False, "error": str(e)}
            if answer.get("ok"):
                return Launched(pid=int(answer["pid"]))
            _log(layout, "launcher failed (%s); starting the guest the slow way" % answer.get("error"))
        try:
            bridge = listen_bridge(layout)
        except OSError as e:
            raise GuestError("cannot prepare guest: %s" % e)
        try:
            argv = [str(bridge.fileno()) if a == launcher_mod.BRIDGE_FD_PLACEHOLDER else a for a in bwrap]
            script = rootfs_mod.launch_script(layout, cgroup.procs_files(), overlay, argv)
            with open(layout.log_file, "ab") as log:
                popen = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=launch_env,
                                         start_new_session=True, close_fds=True, pass_fds=(bridge.fileno(),))
        finally:
            bridge.close()  # the guest's PID 1 holds it now
        return Launched(popen=popen)

    async def _wait_exec(self, layout, launched):
        """-> host pid of the guest's PID 1 once bwrap has built the guest."""
        deadline = time.monotonic() + BOOT_TIMEOUT
        init_pid = None
        while True:
            if not launched.running():
                raise GuestError("guest exited during boot: %s" % _log_tail(layout))
            if time.monotonic() > deadline:
                raise GuestError("guest did not start within %.0f s: %s" % (BOOT_TIMEOUT, _log_tail(layout)))
            if init_pid is None:
                init_pid = _read_child_pid(layout)
            # bwrap execs PID 1 only after the mounts, pivot_root and capabilities are done:
            # once /proc/<pid>/exe is no longer bwrap, the namespaces are ready to enter.
            if init_pid is not None and exe_name(init_pid) not in ("bwrap", None):
                return init_pid
            await asyncio.sleep(0.002)

    async def _place_agent(self, layout, init_pid):
        """Fork the warm agent into the guest; on failure the guest's PID 1 starts its own."""
        try:
            answer = await asyncio.to_thread(self._zygote.request, {"init_pid": init_pid})
        except Exception as e:
            answer = {"ok": False, "error": str(e)}
        if not answer.get("ok"):
            _log(layout, "zygote could not place the agent (%s); the guest starts its own" % answer.get("error"))
            # the run dir is writable by the guest: never follow what may be a planted symlink
            with contextlib.suppress(OSError):
                os.close(os.open(os.path.join(layout.run, "agent.fallback"),
                                 os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))

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

    async def _wait_ready(self, layout, launched):
        deadline = time.monotonic() + BOOT_TIMEOUT
        delay = 0.002
        while True:
            if not launched.running():
                raise GuestError("guest exited during boot: %s" % _log_tail(layout))
            try:
                sock = await dial_bridge(layout.host, AGENT_PORT, timeout=portdial.DIAL_TIMEOUT)
                sock.close()
                break
            except DialError:
                if time.monotonic() > deadline:
                    raise GuestError("guest agent did not answer within %.0f s: %s" % (BOOT_TIMEOUT, _log_tail(layout)))
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.005)
        pid = _read_child_pid(layout)
        start = proc_start_time(pid) if pid else None
        if start is None:
            raise GuestError("guest init exited during boot: %s" % _log_tail(layout))
        return pid, start

    # ------------------------------------------------------------ adopt

    async def adopt(self, session_id, sandbox_id, rootfs, env, egress, hostname):
        """Reattach to a guest that outlived the control plane, else boot again from its state."""
        layout = self._layout(session_id)
        async with self._lock(session_id):
            current = self._guests.get(session_id)
            if current is not None and current.alive():
                return current
            meta = layout.read_meta()
            if meta and meta.get("pid"):
                guest = Guest(self, layout, session_id, meta.get("sandbox_id", sandbox_id), meta.get("hostname", hostname),
                              int(meta["pid"]), meta.get("pid_start"))
                if guest.alive() and (guest.frozen or await self._answers(layout)):
                    if guest.sandbox_id != sandbox_id:
                        guest.sandbox_id = sandbox_id
                        layout.write_meta(dict(meta, sandbox_id=sandbox_id))
                    self._guests[session_id] = guest
                    return guest
            return await self._boot(layout, session_id, sandbox_id, rootfs, env, egress, hostname)

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
            guest = self._guests.pop(session_id, None)
            await asyncio.to_thread(self._kill, layout, self._cgroup(session_id), guest._launched if guest else None)

    def _kill(self, layout, cgroup, launched):
        # The guest's PID 1 first: the kernel then kills its whole PID namespace and bwrap
        # reaps it, so no guest process is left as a zombie of the host's init.
        meta = layout.read_meta() or {}
        init_pid = _read_child_pid(layout) or meta.get("pid")
        if init_pid and proc_start_time(init_pid) is not None and (
                launched is not None or proc_start_time(init_pid) == meta.get("pid_start")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(init_pid, signal.SIGKILL)
            cgroup.thaw()  # a frozen task only dies once thawed
            deadline = time.monotonic() + 5
            while proc_start_time(init_pid) is not None and time.monotonic() < deadline:
                time.sleep(0.002)
        cgroup.kill_all()
        net_file = os.path.join(layout.host, "net.json")
        try:
            with open(net_file) as f:
                netns.teardown(json.load(f))
            os.unlink(net_file)
        except (OSError, ValueError):
            pass
        if launched is not None:
            launched.kill()
        cgroup.remove()
        for name in ("agent.pid", "agent.fallback"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(layout.run, name))
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(layout.host, layout.bridge_name))

    def _clean_leftovers(self, layout, cgroup):
        """A crash may leave processes or a cgroup behind; a boot starts from a clean slate."""
        if cgroup.exists():
            self._kill(layout, cgroup, None)

    async def destroy(self, session_id):
        layout = self._layout(session_id)
        await self.stop(session_id)
        async with self._lock(session_id):
            await asyncio.to_thread(shutil.rmtree, layout.root, True)
        self._locks.pop(session_id, None)

    # ------------------------------------------------------------ checkpoints

    async def checkpoint(self, session_id, dest_dir):
        """Consistent copy of workspace + root changes (the guest is frozen while copying); -> size_bytes."""
        layout = self._layout(session_id)
        if not layout.exists():
            raise GuestError("no state for session %s" % session_id)
        async with self._lock(session_id):
            cgroup = self._cgroup(session_id)
            froze = False
            if cgroup.exists() and cgroup.pids() and cgroup.state() == "THAWED":
                await asyncio.to_thread(cgroup.freeze)
                froze = True
            try:
                await copy_state(layout, dest_dir)
            finally:
                if froze:
                    cgroup.thaw()
        return await asyncio.to_thread(rootfs_mod.tree_size, dest_dir)

    async def restore(self, session_id, src_dir):
        """Replace the (stopped) guest's writable state with a checkpoint copy, exactly."""
        layout = self._layout(session_id)
        if not os.path.isdir(os.path.join(src_dir, "workspace")):
            raise GuestError("not a checkpoint directory: %s" % src_dir)
        async with self._lock(session_id):
            guest = self._guests.get(session_id)
            if (guest is not None and guest.alive()) or self._cgroup(session_id).pids():
                raise GuestError("session %s is running; stop it before a restore" % session_id)
            await replace_state(src_dir, layout)

    async def clone_state(self, src_session_id, dst_session_id, src_dir=None):
        """Give dst the writable state of src (its current state, or the checkpoint copy src_dir)."""
        dst = self._layout(dst_session_id)
        if self._cgroup(dst_session_id).pids():
            raise GuestError("session %s is running; cannot clone into it" % dst_session_id)
        if src_dir is None:
            staging = os.path.join(self.state_dir, "sessions", ".clone-%s" % dst_session_id)
            await asyncio.to_thread(shutil.rmtree, staging, True)
            try:
                await self.checkpoint(src_session_id, staging)
                async with self._lock(dst_session_id):
                    await replace_state(staging, dst)
            finally:
                await asyncio.to_thread(shutil.rmtree, staging, True)
        else:
            async with self._lock(dst_session_id):
                await replace_state(src_dir, dst)

    # ------------------------------------------------------------ shutdown

    async def shutdown(self, stop_guests):
        """The control plane is exiting; stop_guests=False leaves guests running for adopt()."""
        if stop_guests:
            for session_id in list(self._guests):
                await self.stop(session_id)
        self._guests.clear()
        for helper in (self._zygote, self._launcher):
            if helper is not None:
                await asyncio.to_thread(helper.stop)


def _log(layout, msg):
    with contextlib.suppress(OSError), open(layout.log_file, "a") as log:
        log.write("localplane: %s\n" % msg)


def _read_child_pid(layout):
    """The host pid of the guest's PID 1, from bwrap's --info-fd file (None until written)."""
    try:
        with open(layout.info_file) as f:
            return int(json.load(f)["child-pid"])
    except (OSError, ValueError, KeyError):
        return None


def _log_tail(layout, limit=2000):
    try:
        with open(layout.log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace").strip() or "(no output)"
    except OSError:
        return "(no log)"
