# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The per-session multiplexer: one tunnel WebSocket and one gRPC channel shared by every task.

Started detached by the connection plugin on first use (see mux_client.py),
one per (api_url, prefix, session, agent port, local user). It reads its
configuration, API token included, as one JSON line on stdin (never argv,
never a file), answers one JSON line on stdout ({"ok": true} or an error),
then serves workers on `<dir>/mux.sock` (0600, in a 0700 dir) with the framed
protocol of mux_protocol.py. It does the put/fetch file I/O itself (the
worker sends local paths), stages transfers of guest paths outside the
transfer root through the run's scratch dir, creates each run's TMPDIR
before first use and removes it once the run's ansible-playbook process is
gone. It exits after `persist` idle seconds, soon after its session is
deleted, on SIGTERM, or on a "shutdown" request (meta: reset_connection).

Run as: python -m ansible_collections.microvm.sandbox.plugins.plugin_utils.mux
"""

import json
import logging
import os
import posixpath
import re
import shlex
import signal
import socket
import sys
import threading
import time
import uuid

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, WaitTimeout
from ansible_collections.microvm.sandbox.plugins.plugin_utils import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils import mux_protocol as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils import tunnel as tunnel_mod
from ansible_collections.microvm.sandbox.plugins.plugin_utils.tunnel import Tunnel
from ansible_collections.microvm.sandbox.plugins.plugin_utils import warm

grpc = ac.grpc


def missing_requirements():
    """A clear message when the mux's Python requirements are not installed, else None."""
    missing = []
    if ac.GRPC_IMPORT_ERROR is not None or not ac.pb.HAS_AGENT_STUB_DEPS:
        missing.append("grpcio and protobuf")
    if tunnel_mod.WEBSOCKETS_IMPORT_ERROR is not None:
        missing.append("websockets")
    if not missing:
        return None
    return ("the microvm.sandbox.agent connection needs %s on the controller's Python (%s): "
            "pip install grpcio protobuf websockets" % (" and ".join(missing), sys.executable))


log = logging.getLogger("microvm.mux")

WATCH_INTERVAL = 1.0          # idle and run-liveness checks
SESSION_CHECK_INTERVAL = 10.0  # REST check that the session still exists
DEADLINE_GRACE = 30.0          # client deadline beyond the agent's own command timeout
STALE_RUN_MINUTES = 24 * 60    # run dirs of other controllers are swept after a day
TASK_TMP = re.compile(r"^ansible-tmp-[0-9.]+-(\d+)-\d+$")  # ansible-core's name: time, worker pid, random


class Unreachable(Exception):
    """The guest agent cannot be reached (yet); nothing was started."""

    kind = mp.ERR_UNREACHABLE


class SessionGone(Unreachable):
    """The session is deleted, failed or unknown."""

    kind = mp.ERR_GONE


class GuestCommandFailed(Exception):
    """A helper command the mux runs in the guest (staging, mkdir) failed."""

    def __init__(self, message, kind=mp.ERR_FAILED):
        super().__init__(message)
        self.kind = kind


def pid_start_time(pid):
    """The start time (clock ticks since boot) of a local process, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    # the command name may contain spaces and parentheses: split after the last ')'
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def run_alive(pid, start):
    current = pid_start_time(pid)
    return current is not None and (not start or str(current) == str(start))


class Mux:
    def __init__(self, cfg):
        self.cfg = cfg
        self.dir = cfg["dir"]
        self.session = cfg["session"]
        self.connect_timeout = float(cfg.get("connect_timeout") or 60)
        self.persist = float(cfg.get("persist") or 60)
        self.scratch_dir = cfg.get("scratch_dir") or profile.SCRATCH_DIR
        self.api = ApiClient(cfg["api_url"], cfg["token"], prefix=cfg.get("prefix") or profile.DEFAULT_PREFIX,
                             timeout=min(self.connect_timeout, 30.0), retries=3,
                             validate_certs=cfg.get("validate_certs", True))
        self.session_id = None
        self.label = self.session
        self.tunnel = None
        self.agent = None
        self.state = None
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.ready_lock = threading.Lock()
        self.open_connections = 0
        self.last_activity = time.monotonic()
        self.runs = {}             # run id -> {"pid", "start", "dir"}
        self.run_locks = {}
        self.listener = None
        self.warm = None
        self.socket_path = os.path.join(self.dir, mp.SOCKET_NAME)

    # -- start-up ----------------------------------------------------------------
    def resolve(self):
        """Session name or id -> id; a destroyed or unknown session is a clear error."""
        try:
            found = self.api.find_session(self.session)
        except ApiError as e:
            raise Unreachable("cannot look up session %s: %s" % (self.session, e))
        if not found:
            raise SessionGone("session %s does not exist (no live session has this id or name)" % self.session)
        self.session_id = found.get("session_id") or self.session
        name = found.get("name")
        self.label = "%s (%s)" % (name, self.session_id) if name and name != self.session_id else self.session_id
        status = profile.short_status(found.get("status"))
        if status in profile.GONE:
            raise SessionGone(self._gone_message(found))
        return found

    def _gone_message(self, session):
        status = profile.short_status(session.get("status"))
        msg = "session %s is %s" % (self.label, status)
        if session.get("error_message"):
            msg += ": %s" % session["error_message"]
        return msg + "; it cannot run tasks any more"

    def start(self):
        self.resolve()
        self.tunnel = Tunnel(self.cfg["api_url"], self.cfg.get("prefix") or profile.DEFAULT_PREFIX, self.session_id,
                             self.cfg["token"], port=int(self.cfg.get("agent_port") or profile.AGENT_PORT),
                             label=self.label, connect_timeout=self.connect_timeout,
                             validate_certs=self.cfg.get("validate_certs", True), socket_dir=self.dir)
        self.tunnel.start()
        # A lost stream drops its connection: the agent client then dials through a fresh channel (_dial).
        self.agent = ac.AgentClient(self._dial(), self.label, self.scratch_dir, redial=self._dial)
        self.warm = warm.WarmRunners(self.agent, self.label)
        self.ensure_ready()
        self.listen()

    @property
    def channel(self):
        return self.agent.channel if self.agent is not None else None

    def _dial(self):
        """A gRPC channel through the tunnel; its connectivity feeds self.state while it is the agent's."""
        channel = ac.open_channel("unix:" + self.tunnel.socket_path)
        self.state = None

        def on_state(state):
            if self.agent is None or self.agent.channel is channel:
                self.state = state
        channel.subscribe(on_state, try_to_connect=False)
        return channel

    def listen(self):
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600
        try:
            self.listener.bind(self.socket_path)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        self.listener.listen(64)
        self.listener.settimeout(WATCH_INTERVAL)
        with open(os.path.join(self.dir, mp.PID_NAME), "w") as f:
            f.write(str(os.getpid()))

    # -- reaching the agent --------------------------------------------------------
    def ensure_ready(self):
        """Wait until the gRPC channel is connected; wake a paused session; fail clearly otherwise."""
        if self.state == grpc.ChannelConnectivity.READY:
            return
        with self.ready_lock:
            since = time.monotonic()
            deadline = since + self.connect_timeout
            checked = 0.0
            while True:
                future = grpc.channel_ready_future(self.channel)
                try:
                    future.result(timeout=0.5)
                    return
                except grpc.FutureTimeoutError:
                    future.cancel()
                errors = self.tunnel.errors_since(since)
                now = time.monotonic()
                if errors and errors[-1].fatal:
                    self.check_session()  # a deleted session is reported as such
                    raise Unreachable(str(errors[-1]))
                if errors and now - checked > 2.0:
                    checked = now
                    self.wake_if_paused()
                if now >= deadline:
                    last = (": last error: %s" % errors[-1]) if errors else ""
                    raise Unreachable("could not connect to the guest agent of session %s within %ss "
                                      "(option connect_timeout)%s" % (self.label, int(self.connect_timeout), last))

    def check_session(self):
        """Raise SessionGone when the session is deleted, failed or unknown; return it otherwise."""
        try:
            session = self.api.get_session(self.session_id)
        except ApiError as e:
            if e.gone:
                raise SessionGone("session %s no longer exists (HTTP %d): it was deleted" % (self.label, e.status))
            raise Unreachable("cannot check session %s: %s" % (self.label, e))
        if profile.short_status(session.get("status")) in profile.GONE:
            raise SessionGone(self._gone_message(session))
        return session

    def wake_if_paused(self):
        session = self.check_session()
        status = profile.short_status(session.get("status"))
        try:
            if status == "PAUSED":
                log.info("session %s is paused: resuming it", self.label)
                try:
                    self.api.resume_session(self.session_id)
                except ApiError as e:
                    if e.status != 409:  # someone else resumed it meanwhile
                        raise
            if status in ("PAUSED", "PROVISIONING"):
                self.api.wait_session(self.session_id, timeout=self.connect_timeout)
        except (ApiError, WaitTimeout) as e:
            raise Unreachable("session %s is %s and could not be made ready: %s" % (self.label, status, e))

    def lost_message(self, error):
        """Explain a lost command with what the tunnel and the REST API know."""
        msg = str(error)
        try:
            self.check_session()
        except Unreachable as e:
            return e.kind, "%s; %s" % (msg, e)
        recent = self.tunnel.errors_since(time.monotonic() - 60)
        if recent:
            msg += "; tunnel: %s" % recent[-1]
        return mp.ERR_LOST, msg

    # -- runs and their TMPDIR --------------------------------------------------------
    def guest(self, script, *args):
        """Run a small sh script in the guest (the mux's own helpers); raise on failure."""
        self.ensure_ready()
        result = self.agent.exec(["/bin/sh", "-c", script, "sh"] + list(args), deadline=self.connect_timeout + 60)
        if result.exit_code != 0:
            err = result.stderr.decode("utf-8", "replace").strip()
            kind = mp.ERR_FAILED
            if "No such file" in err:
                kind = mp.ERR_NOT_FOUND
            elif "Permission denied" in err:
                kind = mp.ERR_DENIED
            raise GuestCommandFailed(err or "exit code %d" % result.exit_code, kind)
        return result

    def ensure_run(self, run):
        """Create the run's TMPDIR (sticky and world-writable like /tmp, for become users) once per run."""
        if not run or not run.get("id"):
            return None
        run_id = run["id"]
        if run_id in self.runs:
            return self.runs[run_id]["dir"]
        with self.lock:
            rlock = self.run_locks.setdefault(run_id, threading.Lock())
        with rlock:
            if run_id not in self.runs:
                run_dir = profile.check_scratch_dir(run["dir"], what="run TMPDIR")
                self.guest('mkdir -p -- "$1" && chmod 1777 -- "$1"', run_dir)
                self.runs[run_id] = {"pid": run.get("pid"), "start": run.get("start"), "dir": run_dir}
                log.info("run %s: TMPDIR %s created", run_id, run_dir)
        return self.runs[run_id]["dir"]

    def reap_runs(self):
        """Remove the TMPDIR of every run whose ansible-playbook process is gone.

        Never wakes a paused session for this: its run dirs are left to a later mux's sweep.
        """
        ended = [(run_id, run) for run_id, run in list(self.runs.items())
                 if not (run.get("pid") and run_alive(run["pid"], run.get("start")))]
        if not ended:
            return
        if self.state != grpc.ChannelConnectivity.READY:
            try:
                usable = profile.short_status(self.check_session().get("status")) in profile.USABLE
            except Unreachable:
                usable = False
            if not usable:
                for run_id, run in ended:
                    log.info("run %s ended while the session is not usable: %s is left to a later sweep",
                             run_id, run["dir"])
                    self.runs.pop(run_id, None)
                return
        for run_id, run in ended:
            try:
                self.guest('rm -rf -- "$1"', run["dir"])
                log.info("run %s ended: removed %s", run_id, run["dir"])
            except Exception as e:  # the session may be gone; nothing left to clean then
                log.warning("run %s ended: could not remove %s: %s", run_id, run["dir"], e)
            self.runs.pop(run_id, None)
        self.sweep_abandoned_task_dirs()

    def sweep_abandoned_task_dirs(self):
        """rmdir the empty ansible-tmp-* dirs of the shared remote_tmp whose controller worker is gone.

        A task that ends UNREACHABLE never removes its own. The dir name carries the worker's pid; rmdir
        removes empty directories only, so a dir another task is filling right now is never lost.
        """
        tmp = posixpath.join(self.scratch_dir, "ansible-tmp")
        try:
            listing = self.guest('cd -- "$1" 2>/dev/null || exit 0; find . -mindepth 1 -maxdepth 1 -type d -empty '
                                 '-name "ansible-tmp-*"', tmp).stdout.decode("utf-8", "replace")
        except Exception as e:
            log.warning("sweep: cannot list %s: %s", tmp, e)
            return
        abandoned = []
        for line in listing.split("\n"):
            m = TASK_TMP.match(line[2:] if line.startswith("./") else line)
            if m and not run_alive(int(m.group(1)), None):
                abandoned.append(posixpath.join(tmp, m.group(0)))
        if abandoned:
            try:
                self.guest('rmdir -- "$@" 2>/dev/null; true', *abandoned)
                log.info("sweep: removed %d empty task dir(s) of gone workers in %s", len(abandoned), tmp)
            except Exception as e:
                log.warning("sweep: cannot remove task dirs in %s: %s", tmp, e)

    def sweep_stale_runs(self, host_tag):
        """Remove run dirs left by crashed runs of this controller, and very old ones of any controller."""
        try:
            listing = self.guest('cd -- "$1" 2>/dev/null && ls -1A || true', self.scratch_dir).stdout
        except Exception as e:
            log.warning("sweep: cannot list %s: %s", self.scratch_dir, e)
            return
        stale = []
        for name in listing.decode("utf-8", "replace").split("\n"):
            if not name.startswith("run.") or "/" in name:
                continue
            parts = name[4:].split("-")
            if len(parts) == 3 and parts[0] == host_tag and parts[1].isdigit():
                if not run_alive(int(parts[1]), parts[2]):
                    stale.append(posixpath.join(self.scratch_dir, name))
        script = 'find "$1" -mindepth 1 -maxdepth 1 -type d -name "run.*" -mmin +%d -exec rm -rf -- {} + 2>/dev/null; ' \
                 'shift; [ $# -eq 0 ] || rm -rf -- "$@"' % STALE_RUN_MINUTES
        try:
            self.guest(script, self.scratch_dir, *stale)
            if stale:
                log.info("sweep: removed %s", ", ".join(stale))
        except Exception as e:
            log.warning("sweep failed: %s", e)
        self.sweep_abandoned_task_dirs()

    # -- serving workers ---------------------------------------------------------------
    def serve_forever(self):
        threading.Thread(target=self.watch, name="watch", daemon=True).start()
        while not self.stopping.is_set():
            try:
                conn = self.listener.accept()[0]
            except socket.timeout:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            with self.lock:
                self.open_connections += 1
                self.last_activity = time.monotonic()
            threading.Thread(target=self.handle, args=(conn,), name="worker", daemon=True).start()

    def watch(self):
        next_session_check = time.monotonic() + SESSION_CHECK_INTERVAL
        while not self.stopping.wait(WATCH_INTERVAL):
            now = time.monotonic()
            with self.lock:
                idle = self.open_connections == 0 and now - self.last_activity >= self.persist
                busy = self.open_connections > 0
            if idle:
                log.info("idle for %ss: exiting", int(self.persist))
                self.stop()
                return
            if not busy:
                self.reap_runs()
            if now >= next_session_check:
                next_session_check = now + SESSION_CHECK_INTERVAL
                try:
                    self.check_session()
                except SessionGone as e:
                    log.info("%s: exiting", e)
                    self.stop(clean=False)
                    return
                except Unreachable as e:
                    log.warning("%s", e)

    def stop(self, clean=True):
        if self.stopping.is_set():
            return
        if clean:
            self.reap_runs()
        self.stopping.set()
        if self.warm is not None:
            self.warm.stop()
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        try:
            self.listener.close()
        except OSError:
            pass

    def handle(self, conn):
        try:
            while not self.stopping.is_set():
                frame = mp.recv_frame(conn)
                if frame is None:
                    return
                kind, req = frame
                if kind != mp.REQUEST:
                    mp.send_frame(conn, mp.ERROR, {"kind": mp.ERR_PROTOCOL, "message": "expected a request, got frame %d" % kind})
                    return
                with self.lock:
                    self.last_activity = time.monotonic()
                mp.send_frame(conn, mp.ACK)
                if not self.dispatch(conn, req):
                    return
        except (OSError, mp.ProtocolError) as e:
            log.debug("worker connection ended: %s", e)
        finally:
            conn.close()
            with self.lock:
                self.open_connections -= 1
                self.last_activity = time.monotonic()

    def dispatch(self, conn, req):
        """Serve one request; False ends the connection."""
        op = req.get("op")
        try:
            if op == "exec":
                self.op_exec(conn, req)
            elif op == "warm":
                self.op_warm(conn, req)
            elif op == "put":
                mp.send_frame(conn, mp.RESULT, self.op_put(req))
            elif op == "fetch":
                mp.send_frame(conn, mp.RESULT, self.op_fetch(req))
            elif op == "put_archive":
                mp.send_frame(conn, mp.RESULT, self.op_put_archive(req))
            elif op == "hello":
                mp.send_frame(conn, mp.RESULT, {"pid": os.getpid(), "session_id": self.session_id, "label": self.label,
                                                "version": mp.PROTOCOL_VERSION})
            elif op == "shutdown":
                mp.send_frame(conn, mp.RESULT, {"pid": os.getpid()})
                log.info("shutdown requested (reset_connection)")
                self.stop()
                return False
            else:
                mp.send_frame(conn, mp.ERROR, {"kind": mp.ERR_PROTOCOL, "message": "unknown op %r" % op})
        except (Unreachable, GuestCommandFailed, profile.TransferPathError, ac.AgentError, OSError) as e:
            mp.send_frame(conn, mp.ERROR, self.error_frame(e))
        return True

    def error_frame(self, e):
        """An exception as the payload of an ERROR frame; a gone session also stops the mux."""
        if isinstance(e, Unreachable):
            if isinstance(e, SessionGone):
                threading.Thread(target=self.stop, kwargs={"clean": False}, daemon=True).start()
            return {"kind": e.kind, "message": str(e)}
        if isinstance(e, GuestCommandFailed):
            return {"kind": e.kind, "message": str(e)}
        if isinstance(e, profile.TransferPathError):
            return {"kind": mp.ERR_PATH, "message": str(e)}
        if isinstance(e, ac.RemoteNotFound):
            return {"kind": mp.ERR_NOT_FOUND, "message": str(e)}
        if isinstance(e, ac.TransferDenied):
            return {"kind": mp.ERR_DENIED, "message": str(e)}
        if isinstance(e, (ac.CommandLost, ac.AgentUnavailable)):
            kind, message = self.lost_message(e)
            if kind == mp.ERR_GONE:
                threading.Thread(target=self.stop, kwargs={"clean": False}, daemon=True).start()
            return {"kind": kind, "message": message}
        return {"kind": mp.ERR_FAILED, "message": str(e)}

    # -- exec ---------------------------------------------------------------------------
    def op_exec(self, conn, req):
        timeout = int(req.get("timeout") or 0)
        try:
            self.ensure_ready()
            self.ensure_run(req.get("run"))
            call, feed = self.agent.exec_stream(req["argv"], env=req.get("env"), workdir=req.get("workdir") or "",
                                                timeout=timeout, deadline=(timeout + DEADLINE_GRACE) if timeout else None)
        except (Unreachable, GuestCommandFailed, profile.TransferPathError, ac.AgentError) as e:
            # answer first (the worker may hold stdin back), then drain its stdin up to STDIN_EOF
            # so that the next request on this connection is read as a request
            mp.send_frame(conn, mp.ERROR, self.error_frame(e))
            self._drain_stdin(conn)
            return
        done = threading.Event()
        reader = threading.Thread(target=self._pump_stdin, args=(conn, call, feed, done), name="stdin", daemon=True)
        reader.start()
        # the worker may hold stdin back (a become password prompt), so the final frame goes out
        # before waiting for its STDIN_EOF
        final = (mp.ERROR, {"kind": mp.ERR_LOST, "message": "the command on session %s ended without a status" % self.label})
        try:
            for kind, data in self.agent.iter_exec(call, feed):
                if kind == "stdout":
                    mp.send_frame(conn, mp.STDOUT, data)
                elif kind == "stderr":
                    mp.send_frame(conn, mp.STDERR, data)
                else:
                    final = (mp.EXIT, {"rc": data.exit_code, "timed_out": data.timed_out,
                                       "duration_ms": data.duration_ms, "hitl_rejected": data.hitl_rejected})
        except OSError:
            call.cancel()  # the worker went away (task timeout, ^C): stop the command
            raise
        except ac.AgentError as e:
            final = (mp.ERROR, self.error_frame(e))
        done.set()
        mp.send_frame(conn, *final)
        reader.join()

    def op_warm(self, conn, req):
        """Run a pipelined module payload in the session's warm runner (see warm.py).

        Before any output, a request the runner cannot take is answered with an ERR_WARM error,
        and the worker runs it cold; once started, a lost runner fails the task (never re-run).
        """
        payload = bytearray()
        while True:
            frame = mp.recv_frame(conn)
            if frame is None:
                return
            if frame[0] == mp.STDIN_EOF:
                break
            if frame[0] != mp.STDIN:
                raise mp.ProtocolError("expected stdin, got frame %d" % frame[0])
            payload += frame[1]
        try:
            self.ensure_ready()
            self.ensure_run(req.get("run"))
            runner = self.warm.get(req["interpreter"])
            rid, events = runner.submit(req.get("env") or {}, bytes(payload))
        except warm.Refused as e:
            mp.send_frame(conn, mp.ERROR, {"kind": mp.ERR_WARM, "message": str(e)})
            return
        except (Unreachable, GuestCommandFailed, profile.TransferPathError, ac.AgentError) as e:
            mp.send_frame(conn, mp.ERROR, self.error_frame(e))
            return
        done = threading.Event()

        def watch_hangup():
            # the worker sends nothing until it has the EXIT: readable before that means it went away
            try:
                if not conn.recv(1, socket.MSG_PEEK) and not done.is_set():
                    runner.kill(rid)
            except OSError:
                if not done.is_set():
                    runner.kill(rid)

        threading.Thread(target=watch_hangup, name="warm-hangup", daemon=True).start()
        started = False
        try:
            while True:
                kind, data = events.get()
                if kind == "started":
                    started = True
                elif kind in ("stdout", "stderr"):
                    mp.send_frame(conn, mp.STDOUT if kind == "stdout" else mp.STDERR, data)
                elif kind == "exit":
                    done.set()
                    mp.send_frame(conn, mp.EXIT, {"rc": data, "timed_out": False, "warm": True})
                    return
                elif kind == "refuse" or not started:
                    done.set()
                    mp.send_frame(conn, mp.ERROR, {"kind": mp.ERR_WARM, "message": data})
                    return
                else:
                    done.set()
                    message = "the warm module runner on session %s died during the task (%s); the task is not re-run" \
                        % (self.label, data)
                    kind, explained = self.lost_message(message)
                    if kind != mp.ERR_LOST:  # the session itself is gone or unreachable: say so, like a lost command
                        mp.send_frame(conn, mp.ERROR, {"kind": kind, "message": explained})
                    else:
                        mp.send_frame(conn, mp.ERROR, {"kind": mp.ERR_FAILED, "message": message})
                    return
        except OSError:
            runner.kill(rid)
            raise

    def _drain_stdin(self, conn):
        while True:
            frame = mp.recv_frame(conn)
            if frame is None or frame[0] == mp.STDIN_EOF:
                return
            if frame[0] != mp.STDIN:
                raise mp.ProtocolError("expected stdin, got frame %d" % frame[0])

    def _pump_stdin(self, conn, call, feed, done):
        """Forward stdin frames until STDIN_EOF, then watch for the worker hanging up mid-command."""
        try:
            while True:
                frame = mp.recv_frame(conn)
                if frame is None:
                    call.cancel()
                    return
                kind, data = frame
                if kind == mp.STDIN_EOF:
                    break
                if kind != mp.STDIN:
                    call.cancel()
                    return
                feed.put(data)
            feed.put(None)
            # The worker sends nothing more until it has the EXIT, so readable-before-done means it
            # went away (a task timeout, ^C): stop the command in the guest. Peek, never consume:
            # after the EXIT these bytes are the worker's next request.
            if not conn.recv(1, socket.MSG_PEEK) and not done.is_set():
                call.cancel()
        except (OSError, mp.ProtocolError):
            if not done.is_set():
                call.cancel()
        finally:
            feed.put(None)

    # -- put / fetch -----------------------------------------------------------------------
    @staticmethod
    def guest_path(path):
        """Relative guest paths are relative to the default workdir; '~' is the platform's home."""
        if path == "~" or path.startswith("~/"):
            path = profile.HOME_DIR + path[1:]
        if not path.startswith("/"):
            path = posixpath.join(profile.DEFAULT_WORKDIR, path)
        return posixpath.normpath(path)

    def _stage_name(self, run_dir, remote):
        return posixpath.join(run_dir, ".stage.%s.%s" % (uuid.uuid4().hex[:12], posixpath.basename(remote)[:60]))

    def op_put(self, req):
        local, remote = req["local"], self.guest_path(req["remote"])
        if not os.path.isfile(local):
            raise ac.RemoteNotFound("local file %s to upload does not exist" % local)
        self.ensure_ready()
        if profile.is_within(remote):
            try:
                return {"bytes": self.agent.upload(local, remote), "staged": False}
            except ac.TransferDenied:
                pass  # a symlink inside the workspace pointing outside it: stage instead
        run_dir = self.ensure_run(req.get("run"))
        if not run_dir:
            raise GuestCommandFailed("cannot stage %s: no run scratch dir" % remote)
        stage = self._stage_name(run_dir, remote)
        written = self.agent.upload(local, stage)
        # copy next to the destination, then rename: atomic on the guest even across filesystems
        self.guest('trap \'rm -f -- "$1"\' EXIT; d=$(dirname -- "$2"); t="$d/.microvm.$$.$(basename -- "$2")"; '
                   'cp -- "$1" "$t" && mv -f -- "$t" "$2" || { rc=$?; rm -f -- "$t"; exit $rc; }', stage, remote)
        return {"bytes": written, "staged": True}

    def op_put_archive(self, req):
        """Extract a local tar into a guest directory through Upload(is_archive); never staged.

        The agent checks every member before writing, so a refused archive leaves the target as it was.
        """
        local, remote = req["local"], self.guest_path(req["remote"])
        if not os.path.isfile(local):
            raise ac.RemoteNotFound("local archive %s to upload does not exist" % local)
        self.ensure_ready()
        return {"bytes": self.agent.upload(local, remote, is_archive=True), "staged": False}

    def op_fetch(self, req):
        remote, local = self.guest_path(req["remote"]), req["local"]
        self.ensure_ready()
        if profile.is_within(remote):
            try:
                return {"bytes": self.agent.download(remote, local), "staged": False}
            except ac.TransferDenied:
                pass
        run_dir = self.ensure_run(req.get("run"))
        if not run_dir:
            raise GuestCommandFailed("cannot stage %s: no run scratch dir" % remote)
        stage = self._stage_name(run_dir, remote)
        try:
            self.guest('cp -- "$1" "$2"', remote, stage)
        except GuestCommandFailed as e:
            if e.kind == mp.ERR_NOT_FOUND:
                raise ac.RemoteNotFound("cannot fetch %s from session %s: no such file" % (remote, self.label))
            raise GuestCommandFailed("cannot stage %s from session %s through %s: %s" % (remote, self.label, run_dir, e),
                                     e.kind)
        try:
            return {"bytes": self.agent.download(stage, local), "staged": True}
        finally:
            try:
                self.guest('rm -f -- "$1"', stage)
            except Exception as e:
                log.warning("could not remove staged copy %s: %s", stage, e)


def main():
    cfg = json.loads(sys.stdin.readline())
    sys.stdin.close()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s mux[%(process)d] %(levelname)s %(message)s")
    problem = missing_requirements()
    if problem:
        sys.stdout.write(json.dumps({"ok": False, "kind": mp.ERR_UNREACHABLE, "message": problem}) + "\n")
        return 1
    mux = Mux(cfg)
    signal.signal(signal.SIGTERM, lambda *_signal_args: threading.Thread(target=mux.stop, daemon=True).start())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        mux.start()
    except Unreachable as e:
        reply = {"ok": False, "kind": e.kind, "message": str(e)}
    except profile.TransferPathError as e:
        reply = {"ok": False, "kind": mp.ERR_PATH, "message": str(e)}
    except Exception as e:  # anything else must still reach the worker as a message
        log.exception("start-up failed")
        reply = {"ok": False, "kind": mp.ERR_UNREACHABLE, "message": "the connection multiplexer failed to start: %s" % e}
    else:
        reply = {"ok": True, "pid": os.getpid(), "session_id": mux.session_id, "label": mux.label}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    if not reply["ok"]:
        log.info("not started: %s", reply["message"])
        if mux.tunnel:
            mux.tunnel.stop()
        return 1
    log.info("serving session %s on %s", mux.label, shlex.quote(mux.socket_path))
    if cfg.get("host_tag"):
        threading.Thread(target=mux.sweep_stale_runs, args=(cfg["host_tag"],), daemon=True).start()
    try:
        mux.serve_forever()
    finally:
        mux.stop(clean=False)
        if mux.agent is not None:
            mux.agent.close()
        mux.tunnel.stop()
        try:
            os.unlink(os.path.join(mux.dir, mp.PID_NAME))
        except OSError:
            pass
        log.info("exited")
    return 0


if __name__ == "__main__":
    sys.exit(main())
