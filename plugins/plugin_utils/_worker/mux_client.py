# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The worker's side of the multiplexer: find or start the user's shared mux, attach to a session, talk.

Stdlib only (see _shared/frames.py): this runs in every task's worker process.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import (
    DEFAULT_MAX_OUTPUT, DEFAULT_POOL_SIZE, PROCESS_DIR_NAME, PROTOCOL_DIGEST, LinkConfig, ProcessConfig, process_dir)

MUX_MODULE = "ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.server"
PYTHON_START_GRACE = 20.0  # python + grpc start-up on a loaded machine, on top of connect_timeout
OLD_MUX_DIR_SECONDS = 7 * 24 * 3600  # dirs of muxes long gone (their logs) are removed after a week

T = TypeVar("T")
# (rc, stdout, stderr, the EXIT payload) of one command
ExecReply = tuple[int, bytes, bytes, dict[str, Any]]
# interact(stdout so far, stderr so far): None (wait), bytes (send them), True (release stdin); see exec()
Interact = Callable[[bytearray, bytearray], "bytes | bool | None"]


def collections_root() -> str:
    """The directory holding `ansible_collections/`, so the mux can import this collection."""
    parts = os.path.abspath(mp.__file__).split(os.sep)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == "ansible_collections":
            return os.sep.join(parts[:i]) or os.sep
    raise RuntimeError("cannot locate the ansible_collections directory from %s" % mp.__file__)


def host_tag() -> str:
    """A short tag of this controller, so a mux only sweeps run dirs of its own controller."""
    try:
        with open("/etc/machine-id") as f:
            machine = f.read().strip()
    except OSError:
        machine = ""
    return hashlib.sha256(("%s/%s" % (socket.gethostname(), machine)).encode("utf-8")).hexdigest()[:8]


def run_identity(playbook_pid: int | str | None = None) -> tuple[str, int, str]:
    """(run id, pid, start): shared by all tasks of one ansible-playbook run."""
    pid = int(playbook_pid) if playbook_pid else os.getppid()
    start = str(mp.process_start_time(pid) or 0)
    return "%s-%d-%s" % (host_tag(), pid, start), pid, start


def _is_our_mux(pid: int) -> bool:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return MUX_MODULE.encode() in f.read()
    except OSError:
        return False


class InteractTimeout(Exception):
    """Stdin was held back (a become prompt) longer than the caller allowed; carries the output so far."""

    def __init__(self, stdout: bytes, stderr: bytes) -> None:
        super().__init__("no answer within the time allowed")
        self.stdout = stdout
        self.stderr = stderr


class MuxClient:
    """One connection to the mux serving the session of `cfg`, started on demand and attached to that session."""

    def __init__(self, base_dir: str, cfg: LinkConfig, pool_size: int = DEFAULT_POOL_SIZE,
                 log: Callable[[str], None] | None = None, max_output: int = DEFAULT_MAX_OUTPUT, run: str = "") -> None:
        self.cfg = cfg  # a LinkConfig: cfg.session is the platform session's id or name
        self.run = run  # the run's id (run_identity): the mux tells each run which road `auto` chose, once
        self.max_output = max_output  # bytes of one command's stdout + stderr held in memory; 0 = no limit
        self.key = cfg.key
        self.base_dir = base_dir
        self.slot = mp.pool_slot(self.key, pool_size)
        self.dir = process_dir(base_dir, self.slot)  # named by the protocol: never a mux of another version
        self.socket_path = os.path.join(self.dir, mp.SOCKET_NAME)
        self.connect_timeout = float(cfg.connect_timeout)
        self._log = log or (lambda msg: None)
        self.sock: socket.socket | None = None
        # the mux's answer to attach: pid, session_id, label, generation, road, road_note (auto's choice, once a run)
        self.attached: dict[str, Any] | None = None
        self.started = False  # True when this client started the mux

    def __repr__(self) -> str:
        return "MuxClient(%r, %r)" % (self.socket_path, self.cfg)

    # -- connecting --------------------------------------------------------------
    def connect(self) -> MuxClient:
        """Connect (starting the mux if none runs) and attach to the session: UNREACHABLE errors if it cannot be."""
        if self.sock is not None:
            return self
        self._open_socket()
        try:
            self._attach()
        except mp.NotAccepted:  # that mux was exiting: the next one takes it
            self.close()
            self._open_socket()
            try:
                self._attach()
            except mp.NotAccepted:
                self.close()
                # from None: NotAccepted is a retry signal this message states; ansible-core would append its cause
                raise errors.Unreachable("the connection multiplexer closed the connection twice "
                                         "before taking a request; see %s" % os.path.join(self.dir, mp.LOG_NAME)) from None
        return self

    def _socket(self) -> socket.socket:
        """The socket just opened or connected; NotAccepted when it was closed meanwhile (nothing sent on it)."""
        if self.sock is None:
            raise mp.NotAccepted()
        return self.sock

    def _attach(self) -> dict[str, Any]:
        sock = self._socket()
        request = {"op": "attach", "session": self.cfg.to_wire(), "run": self.run}
        hop_file = hops.target()
        if hop_file:
            request["hop"], sent = hops.new_id(), hops.now()
        try:
            mp.send_frame(sock, mp.REQUEST, request)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise mp.NotAccepted() from e
        for kind, payload in self._frames(sock):
            if kind == mp.RESULT:
                if hop_file:
                    hops.record(hop_file, "worker", hop=request["hop"], op="attach", req=sent, sent=sent, exit=hops.now())
                self.attached = payload
                return payload
            self.close()
            if kind == mp.ERROR:
                raise errors.from_frame(payload)
            raise errors.ProtocolMismatch("unexpected frame %d from the mux" % kind)
        raise mp.ProtocolError("the mux's reply ended")  # never: _frames() ends by raising

    def _open_socket(self) -> None:
        mp.private_dir(self.base_dir)
        mp.private_dir(self.dir)
        try:
            self.sock = mp.connect_in(self.dir, timeout=5)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        with open(os.path.join(self.dir, mp.LOCK_NAME), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one starter per mux; the others find its socket
            try:
                self.sock = mp.connect_in(self.dir, timeout=5)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                self._clear_stale()
            self._spawn()
            self.sock = mp.connect_in(self.dir, timeout=5)
            self.started = True

    def _clear_stale(self) -> None:
        """A dead or wedged mux left its socket or pid file: remove them (and it)."""
        pid_file = os.path.join(self.dir, mp.PID_NAME)
        try:
            with open(pid_file) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and _is_our_mux(pid):
            self._log("killing unresponsive mux pid %d" % pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for path in (self.socket_path, os.path.join(self.dir, mp.PID_NAME)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _sweep_old_dirs(self) -> None:
        """Remove the private dirs of muxes that are gone and whose log has not moved for a week."""
        now = time.time()
        for name in os.listdir(self.base_dir):
            path = os.path.join(self.base_dir, name)
            if path == self.dir or os.path.exists(os.path.join(path, mp.SOCKET_NAME)):
                continue
            try:
                if now - os.stat(path).st_mtime > OLD_MUX_DIR_SECONDS:
                    shutil.rmtree(path)
            except OSError:
                pass

    def _spawn(self) -> None:
        self._sweep_old_dirs()
        env = dict(os.environ)
        root = collections_root()
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # a long-lived process with a thread per request: few malloc arenas keep its memory from
        # growing with every concurrent transfer (glibc makes up to 8 per core otherwise)
        env.setdefault("MALLOC_ARENA_MAX", "2")
        for name in profile.API_TOKEN_ENVS:
            env.pop(name, None)  # the token travels in attach requests only
        log_path = os.path.join(self.dir, mp.LOG_NAME)
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            proc = subprocess.Popen([sys.executable, "-m", MUX_MODULE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=log_fd, cwd=self.dir, env=env, close_fds=True, start_new_session=True)
        finally:
            os.close(log_fd)
        config = ProcessConfig(dir=self.dir, slot=self.slot).to_wire()
        self._log("starting the shared mux in %s" % self.dir)
        try:
            if proc.stdin is not None:
                proc.stdin.write((json.dumps(config) + "\n").encode("utf-8"))
                proc.stdin.close()
        except BrokenPipeError:
            pass
        reply = self._read_reply(proc, log_path)
        if not reply.get("ok"):
            raise errors.from_frame({"kind": reply.get("kind") or errors.ERR_UNREACHABLE,
                                     "message": reply.get("message") or "the mux failed to start"})
        self._log("mux pid %s serves %s" % (reply.get("pid"), self.dir))
        # the mux outlives this worker; it is reparented to init when we exit
        proc.returncode = 0

    def _read_reply(self, proc: subprocess.Popen[bytes], log_path: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.connect_timeout + PYTHON_START_GRACE
        buf = b""
        stdout = proc.stdout
        if stdout is None:
            raise errors.Unreachable("the connection multiplexer was started without a pipe; see %s" % log_path)
        while b"\n" not in buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                proc.kill()
                raise errors.Unreachable("the connection multiplexer did not start within %ds (see %s)"
                                         % (int(self.connect_timeout + PYTHON_START_GRACE), log_path))
            readable = select.select([stdout], [], [], remaining)[0]
            if not readable:
                continue
            chunk = os.read(stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
        stdout.close()
        try:
            return json.loads(buf.split(b"\n", 1)[0].decode("utf-8"))
        except ValueError:
            proc.wait(5)
            # from None: the JSON parser's words on the mux's first line are noise (its log says why it stopped),
            # and ansible-core would append them to the task's message
            raise errors.Unreachable("the connection multiplexer exited (code %s) without starting; see %s"
                                     % (proc.returncode, log_path)) from None

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
                self.attached = None

    # -- requests ------------------------------------------------------------------
    def _frames(self, sock: socket.socket) -> Iterator[tuple[int, Any]]:
        """Frames of one reply, after its ACK; NotAccepted when the mux hung up before the ACK."""
        try:
            frame = mp.recv_frame(sock)
        except (ConnectionResetError, mp.ProtocolError):
            frame = None
        if frame is None:
            raise mp.NotAccepted()
        if frame[0] != mp.ACK:
            raise errors.ProtocolMismatch("expected an acknowledgement from the mux, got frame %d" % frame[0])
        while True:
            frame = mp.recv_frame(sock)
            if frame is None:
                raise errors.CommandLost("the connection multiplexer of session %s hung up during the request: "
                                         "it may have partly run and is not re-run; see %s"
                                         % (self.cfg.session, os.path.join(self.dir, mp.LOG_NAME)))
            yield frame

    def _retrying(self, attempt: Callable[[], T]) -> T:
        """Run attempt() once more on a fresh mux if the first one was never accepted."""
        try:
            return attempt()
        except mp.NotAccepted:
            self._log("the mux closed before taking the request (idle exit?): starting a new one")
            self.close()
        self.connect()
        try:
            return attempt()
        except mp.NotAccepted:
            # from None: NotAccepted is a retry signal this message states; ansible-core would append its cause
            raise errors.Unreachable("the connection multiplexer closed the connection twice "
                                     "before taking a request; see %s" % os.path.join(self.dir, mp.LOG_NAME)) from None

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        fields["op"] = op
        hop_file = hops.target()
        if hop_file:
            fields["hop"] = hops.new_id()

        def attempt() -> dict[str, Any]:
            sock = self.connect()._socket()
            sent = hops.now() if hop_file else 0
            try:
                mp.send_frame(sock, mp.REQUEST, fields)
            except (BrokenPipeError, ConnectionResetError) as e:
                raise mp.NotAccepted() from e
            for kind, payload in self._frames(sock):
                if kind == mp.ERROR:
                    raise errors.from_frame(payload)
                if kind == mp.RESULT:
                    if hop_file:
                        hops.record(hop_file, "worker", hop=fields["hop"], op=op, req=sent, sent=sent, exit=hops.now())
                    return dict(payload)
                raise errors.ProtocolMismatch("unexpected frame %d from the mux" % kind)
            raise mp.ProtocolError("the mux's reply ended")  # never: _frames() ends by raising
        return self._retrying(attempt)

    def exec(self, argv: list[str], env: dict[str, str] | None = None, workdir: str = "", timeout: int = 0,
             stdin: bytes = b"", run: dict[str, Any] | None = None, interact: Interact | None = None,
             interact_timeout: float = 0.0) -> ExecReply:
        """Run a command; returns (rc, stdout, stderr, exit info).

        `interact(stdout_so_far, stderr_so_far)` (optional) is called as output arrives while
        stdin is held back, with the growing output buffers themselves (not copied: it must only
        read them, and look only at what is new, or much output costs O(n^2)). It returns None
        (keep waiting), bytes (send them now, keep holding: a become password) or True (release
        stdin); an exception it raises ends the command. With `interact_timeout`, stdin still held
        back that many seconds after the start raises InteractTimeout(stdout_so_far, stderr_so_far),
        whether output keeps coming or not. Either way the connection to the mux is closed, which
        stops the command in the guest.
        """
        # max_output: the mux may stop the command as soon as the guest has printed more (the api road sees a job's
        # output grow in the guest before moving it); the count here stays the rule
        request = {"op": "exec", "argv": list(argv), "env": env or {}, "workdir": workdir, "timeout": timeout,
                   "run": run, "max_output": self.max_output}
        if interact is not None:
            request["hold_stdin"] = True  # stdin waits for output: the api road needs interactive stdin for it
        return self._retrying(lambda: self._exec_once(request, stdin or b"", interact, interact_timeout))

    def _exec_once(self, request: dict[str, Any], stdin: bytes, interact: Interact | None,
                   interact_timeout: float = 0.0) -> ExecReply:
        sock = self.connect()._socket()
        hop_file = hops.target()
        stamps = {"req": hops.now()} if hop_file else {}
        if hop_file:
            request = dict(request, hop=hops.new_id())
        try:
            mp.send_frame(sock, mp.REQUEST, request)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise mp.NotAccepted() from e
        state = {"released": False}
        sender = []

        def send_all() -> None:
            try:
                for offset in range(0, len(stdin), 1024 * 1024):
                    mp.send_frame(sock, mp.STDIN, stdin[offset:offset + 1024 * 1024])
                mp.send_frame(sock, mp.STDIN_EOF)
            except OSError:
                pass  # the mux went away: the reply loop reports it

        def release() -> None:
            state["released"] = True
            if len(stdin) <= 256 * 1024:
                send_all()  # small: no thread needed, the mux reads stdin concurrently
            else:  # big: a thread, so output keeps flowing while stdin goes out
                sender.append(threading.Thread(target=send_all, daemon=True))
                sender[0].start()

        if interact is None:
            release()
            if hop_file:
                stamps["sent"] = hops.now()
        out, err = bytearray(), bytearray()
        deadline = time.monotonic() + interact_timeout if interact is not None and interact_timeout else None
        frames = self._frames(sock)
        try:
            while True:
                if deadline is not None and not state["released"]:
                    sock.settimeout(max(0.001, deadline - time.monotonic()))
                try:
                    kind, payload = next(frames)
                except (TimeoutError, socket.timeout) as e:
                    self._interact_timed_out(out, err, e)
                finally:
                    if sock.gettimeout() is not None and self.sock is sock:
                        sock.settimeout(None)
                if kind in (mp.STDOUT, mp.STDERR):
                    (out if kind == mp.STDOUT else err).extend(payload)
                    if self.max_output and len(out) + len(err) > self.max_output:
                        self._output_over_limit(len(out) + len(err))
                elif kind == mp.EXIT:
                    if hop_file:
                        hops.record(hop_file, "worker", hop=request["hop"], op=request["op"], exit=hops.now(), **stamps)
                    return payload.get("rc"), bytes(out), bytes(err), payload
                elif kind == mp.ERROR:
                    raise errors.from_frame(payload)
                else:
                    raise errors.ProtocolMismatch("unexpected frame %d from the mux" % kind)
                if not state["released"] and interact is not None:
                    try:
                        answer = interact(out, err)
                    except Exception:
                        self.close()  # a refused become: stop the command rather than wait for it
                        raise
                    if answer is True:
                        release()
                    elif answer:
                        mp.send_frame(sock, mp.STDIN, answer)
                    if not state["released"] and deadline is not None and time.monotonic() >= deadline:
                        self._interact_timed_out(out, err)  # output that never stops does not hold it off
        finally:
            if not state["released"] and self.sock is sock:
                try:  # the command ended before stdin was released: end it so the connection stays in step
                    mp.send_frame(sock, mp.STDIN_EOF)
                except OSError:
                    pass
            for t in sender:
                t.join()

    def _interact_timed_out(self, out: bytearray, err: bytearray, cause: BaseException | None = None) -> NoReturn:
        self.close()  # the mux sees the worker go and stops the command in the guest
        raise InteractTimeout(bytes(out), bytes(err)) from cause

    def _output_over_limit(self, held: int) -> NoReturn:
        """A command printed more than this task may hold in memory: hang up (the mux stops the command in the
        guest, as for a task timeout) and fail naming the limit and how to change it."""
        self.close()
        raise errors.OutputOverLimit(self.cfg.session, self.max_output, "%d held" % held)

    def warm(self, interpreter: str, env: dict[str, str], payload: bytes, run: dict[str, Any] | None = None,
             core: str = "", before: list[dict[str, Any]] | None = None) -> ExecReply:
        """Run a pipelined module payload in the session's warm runner for (interpreter, core); like exec().

        `before`: task tmp dir ops (core_compat.tmp_op) the runner does first, in the same request.
        WarmRefused means the payload was not started (and `before` may not have been done): run them in a shell,
        then the module cold.
        """
        request: dict[str, Any] = {"op": "warm", "interpreter": interpreter, "env": env, "run": run, "core": core}
        if before:
            request["before"] = before
        return self._retrying(lambda: self._exec_once(request, payload, None))

    def tmp(self, op: dict[str, Any], run: dict[str, Any] | None = None) -> ExecReply:
        """A task tmp dir command (core_compat.tmp_op) done by the session's warm runner; like exec().

        WarmRefused means nothing was done: run the command in a shell.
        """
        request = {"op": "tmp", "tmp": op, "run": run}
        return self._retrying(lambda: self._exec_once(request, b"", None))

    def tmp_unawaited(self, op: dict[str, Any], argv: list[str], run: dict[str, Any] | None = None) -> bool:
        """Send a task tmp dir command (core_compat.tmp_op) the mux does without answering (frames.py "nowait"):
        by the warm runner, else `argv` in a shell, after this connection's earlier requests. False if it could
        not be sent (then nothing was: the caller runs it the usual way)."""
        request = {"op": "tmp", "tmp": op, "run": run, "nowait": True, "argv": list(argv)}
        try:
            sock = self.connect()._socket()
            sock.sendall(mp.encode(mp.REQUEST, request) + mp.encode(mp.STDIN_EOF))
        except (OSError, mp.NotAccepted, errors.SandboxError):
            return False
        return True

    def put(self, local: str, remote: str, run: dict[str, Any] | None = None,
            ahead: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A put; `ahead`: task tmp dir commands ({"op", "argv"}) the mux does first (a failure: {"ahead_failed"})."""
        if ahead:
            return self.request("put", local=os.path.abspath(local), remote=remote, run=run, ahead=ahead)
        return self.request("put", local=os.path.abspath(local), remote=remote, run=run)

    def put_archive(self, local: str, remote: str) -> dict[str, Any]:
        return self.request("put_archive", local=os.path.abspath(local), remote=remote)

    def fetch(self, remote: str, local: str, run: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("fetch", remote=remote, local=os.path.abspath(local), run=run)

    def reset(self) -> dict[str, Any] | None:
        """meta: reset_connection: close this session's link in the mux, if one runs; never starts one."""
        try:
            sock = mp.connect_in(self.dir, timeout=5)
        except (OSError, errors.UnusableDirectory):  # no mux could run there
            return None
        try:
            mp.send_frame(sock, mp.REQUEST, {"op": "reset", "key": self.key})
            for kind, payload in self._frames(sock):
                return dict(payload) if kind == mp.RESULT else None
            return None
        except mp.NotAccepted:
            return None
        finally:
            sock.close()


def pool_status(base_dir: str, uid: int | None = None) -> dict[str, dict[str, Any]]:
    """The "hello" answer of every running mux process of `base_dir` (the user's pool): {dir name: RESULT}.

    Never starts a mux; a dir whose socket does not answer is left out. Muxes of other protocol versions
    (an older collection's, still running until they idle out) are listed too: each answer gets its "slot"
    and whether it is "current" (of this collection's protocol). Each answer counts what its process
    served (see mux_protocol: "served"), which tests and benches read.
    """
    found: dict[str, dict[str, Any]] = {}
    uid = os.getuid() if uid is None else uid
    try:
        names = sorted(os.listdir(base_dir))
    except OSError:
        return found
    for name in names:
        m = PROCESS_DIR_NAME.match(name)
        if not m or int(m.group(1)) != uid:
            continue
        try:
            sock = mp.connect_in(os.path.join(base_dir, name), timeout=5)
        except (OSError, errors.UnusableDirectory):
            continue
        try:
            mp.send_frame(sock, mp.REQUEST, {"op": "hello"})
            ack, reply = mp.recv_frame(sock), mp.recv_frame(sock)
            if ack and ack[0] == mp.ACK and reply and reply[0] == mp.RESULT:
                found[name] = dict(reply[1], slot=int(m.group(2)), current=m.group(3) == PROTOCOL_DIGEST)
        except (OSError, mp.ProtocolError):
            pass
        finally:
            sock.close()
    return found
