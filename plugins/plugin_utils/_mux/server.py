# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The controller's shared multiplexer: the socket server and dispatch.

One mux process per controller user, multiplexer directory and pool slot (see _shared/config.py)
serves every session of every run. Started detached by the first worker that needs it (see
_worker/mux_client.py), it reads a ProcessConfig as one JSON line on stdin (no secrets), answers one JSON
line on stdout ({"ok": true} or an error), then serves workers on `<dir>/mux.sock` (0600, in a
0700 dir, peers of another uid refused). A worker's connection is bound to one session by
"attach"; the session's link (_mux/session_link.py: port-forward, gRPC channel, health and wake-up) is
opened on first use, kept while a run that used it lives, and closed `persist` idle seconds after that,
when its session is deleted, or on a
"reset" (meta: reset_connection). The process exits once no link and no worker connection is left
for a few seconds, on SIGTERM, or on "shutdown".

The jobs live in their own modules, all running in this process:
    _mux/session_link.py    one session's channel, health and wake-up
    _mux/run_dirs.py       runs and their TMPDIRs
    transfer_ops.py  put / fetch / put_archive and staging
    exec_ops.py       exec and warm: command streaming
    _shared/errors.py  the error vocabulary (one family of exceptions, each with its ERROR frame kind)

Run as: python -m ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.server
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import exec_ops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.run_dirs import RunWatch
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.switch_interval import SwitchInterval
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import transfer_ops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import tunnel as tunnel_mod
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig, ProcessConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import LinkClosed, SessionLink

log = logging.getLogger("microvm.mux")

# The watch thread sleeps until the next thing it has to do (an idle close, a session check, the exit), a run's
# ansible-playbook ends (run_dirs.RunWatch), or a request, connection or link changes something: an idle mux
# makes no wake-ups but these.
WATCH_INTERVAL = 1.0          # run-liveness polls where a run cannot be watched; the most the heap is trimmed
WATCH_BACKSTOP = 30.0         # the longest the watch thread (and the accept loop) sleeps whatever it expects
WATCH_GAP = 0.2               # passes come at most this often, however busy the mux
EMPTY_LINGER = 3.0            # seconds without links or workers before the process exits
MAINTENANCE_THREADS = 8       # links maintained at once (REST checks, idle closes): one slow session never stalls all
HOPS_FILE = hops.target()     # where each request's stamps go (bench/hops_bench.py), None when off: see _shared/hops.py


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another libc).

    gRPC's C core and the per-chunk buffers of transfers free memory that glibc keeps in its arenas
    (it returns only the top of a heap by itself); a fleet's mux would hold every session's high-water
    mark. Trimming once a watch pass after requests ended hands it back, at no cost to the byte path.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: no ldconfig run at start-up
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


MALLOC_TRIM = _malloc_trim()

# The session ops: name -> function. STREAM_OPS talk on the connection themselves (link, conn, req);
# RESULT_OPS return the RESULT payload (link, req). A new op is one function and one line here.
STREAM_OPS = {
    "exec": exec_ops.op_exec,
    "warm": exec_ops.op_warm,
    "tmp": exec_ops.op_tmp,
}
RESULT_OPS = {
    "put": transfer_ops.op_put,
    "fetch": transfer_ops.op_fetch,
    "put_archive": transfer_ops.op_put_archive,
}


def missing_requirements() -> str | None:
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


class MuxServer:
    """The socket server: workers in, one SessionLink per session key, ops dispatched to its link."""

    def __init__(self, cfg: ProcessConfig) -> None:
        self.cfg = cfg
        self.dir = cfg.dir
        self.socket_path = os.path.join(self.dir, mp.SOCKET_NAME)  # where it is (bound through self.sockets)
        self.links: dict[str, SessionLink] = {}
        self.generations: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.connections = 0
        self.requests_done = 0        # requests served so far (unlocked: a lost count only skips one trim)
        # What each session op was served as ("exec", "warm", "warm_refused", "tmp", "put"...), in total and per
        # session id: "hello" reports them, so tests and benches can tell a warm task from a cold one.
        self.served: collections.Counter = collections.Counter()
        self.served_by_session: dict[str, collections.Counter] = {}
        self.moved: collections.Counter = collections.Counter()  # transfers by the path their bytes took ("put_via_bulk")
        self.moved_by_session: dict[str, collections.Counter] = {}
        self.last_activity = time.monotonic()
        self.listener: socket.socket | None = None
        self.stopped = threading.Event()
        self.maintenance = concurrent.futures.ThreadPoolExecutor(MAINTENANCE_THREADS, thread_name_prefix="maintain")
        self.run_watch = RunWatch()
        self.sockets: mp.SocketDir | None = None  # the process dir, held open: the socket is bound through it
        self.switch_interval = SwitchInterval.from_environment()  # short only while requests compete

    # -- the socket ----------------------------------------------------------------------
    def listen(self) -> None:
        self.sockets = mp.SocketDir(mp.private_dir(self.dir))
        address = self.sockets.address(mp.SOCKET_NAME)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)
        self.listener = listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600
        try:
            listener.bind(address)
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        listener.listen(256)
        listener.settimeout(WATCH_BACKSTOP)  # stop() wakes accept() by shutting the socket down
        with open(os.path.join(self.dir, mp.PID_NAME), "w") as f:
            f.write(str(os.getpid()))

    def serve_forever(self) -> None:
        threading.Thread(target=self.watch, name="watch", daemon=True).start()
        while not self.stopping.is_set():
            try:
                conn = self.listener.accept()[0] if self.listener is not None else None
                if conn is None:
                    raise OSError("the mux's socket is not listening")
            except socket.timeout:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            uid = mp.peer_uid(conn)
            if uid is not None and uid != os.getuid():
                log.warning("refused a connection from uid %d", uid)
                conn.close()
                continue
            with self.lock:
                self.connections += 1
                self.last_activity = time.monotonic()
            threading.Thread(target=self.handle, args=(conn,), name="worker", daemon=True).start()

    # -- links ----------------------------------------------------------------------------
    def link_for(self, cfg: LinkConfig) -> SessionLink:
        """The open link of this session key, or a new one (opened by its first request)."""
        key = cfg.key
        with self.lock:
            if self.stopping.is_set():
                raise errors.Unreachable("the connection multiplexer is shutting down")
            link = self.links.get(key)
            if link is None or link.closed.is_set():
                generation = self.generations.get(key, 0) + 1
                self.generations[key] = generation
                link = SessionLink(cfg, os.path.join(self.dir, "t-" + key[:16]), generation, on_close=self.poke)
                self.links[key] = link
            return link

    def close_link(self, link: SessionLink, why: str, clean: bool = True,
                   because: errors.SandboxError | None = None) -> None:
        with self.lock:
            if self.links.get(link.key) is link:
                del self.links[link.key]
            self.last_activity = time.monotonic()
        link.close(why, clean=clean, because=because)
        self.poke()

    def attach(self, cfg: LinkConfig) -> SessionLink:
        """The session's link, opened (resolved, tunnel up, agent answering); a clear MuxFailure otherwise."""
        while True:
            link = self.link_for(cfg)
            try:
                with link.in_use():
                    link.open()
                return link
            except LinkClosed:
                continue  # closed (idle, reset) between lookup and use: take a fresh one
            except errors.SandboxError as e:
                self.close_link(link, "could not open: %s" % e, clean=False, because=e)
                raise

    # -- housekeeping ----------------------------------------------------------------------
    def poke(self) -> None:
        """Wake the watch thread: a request, connection or link changed, which may bring a deadline forward."""
        self.run_watch.poke()

    def watch(self) -> None:
        trimmed_at, trim_time = 0, 0.0
        last_pass = -WATCH_GAP
        timeout: float = 0.0
        due: set[SessionLink] = set()  # links to maintain at once: one of their runs ended
        try:
            while not self.stopping.is_set():
                due |= self.run_watch.wait(timeout)
                rest = last_pass + WATCH_GAP - time.monotonic()
                if self.stopping.wait(max(rest, 0.0)):
                    return
                now = last_pass = time.monotonic()
                if MALLOC_TRIM is not None and self.requests_done != trimmed_at and now - trim_time >= WATCH_INTERVAL:
                    trimmed_at, trim_time = self.requests_done, now
                    MALLOC_TRIM(0)
                with self.lock:
                    for key, link in list(self.links.items()):
                        if link.torn_down:  # closed by its own ops (session gone)
                            del self.links[key]
                            self.last_activity = now
                    links = list(self.links.values())
                    exit_at = self.last_activity + EMPTY_LINGER if not links and self.connections == 0 else float("inf")
                if now >= exit_at:
                    log.info("no session and no worker left: exiting")
                    self.stop()
                    return
                due |= self.run_watch.sync(links)
                polled = self.run_watch.polled_links()
                wake_at = min(exit_at, now + WATCH_BACKSTOP)
                if MALLOC_TRIM is not None and self.requests_done != trimmed_at:
                    wake_at = min(wake_at, trim_time + WATCH_INTERVAL)  # the trim put off above
                busy = set()
                for link in links:
                    if not link.opened or link.maintaining:
                        busy.add(link)  # its request or its maintenance pokes when done
                        continue
                    at = link.next_due()
                    if link in polled:
                        at = min(at, link.maintained_at + WATCH_INTERVAL)
                    if link in due or at <= now:
                        link.maintaining, link.maintained_at = True, now
                        self.maintenance.submit(self._maintain, link, now)
                    else:
                        wake_at = min(wake_at, at)
                due &= busy  # a run ended under a maintenance already running: maintain again after it
                timeout = max(0.0, wake_at - time.monotonic())
        finally:
            self.run_watch.close()

    def _maintain(self, link: SessionLink, now: float) -> None:
        try:
            verdict = link.maintain(now)
            if verdict is not None:
                self.close_link(link, *verdict)
        except Exception:  # housekeeping must never take the server down
            log.exception("session %s: housekeeping failed", link.label)
        finally:
            link.maintaining = False
            self.poke()

    def stop(self, clean: bool = True) -> None:
        with self.lock:
            if self.stopping.is_set():
                return
            self.stopping.set()
            links = list(self.links.values())
            self.links.clear()
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        if self.listener is not None:
            with contextlib.suppress(OSError):
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of serve_forever (Linux)
            with contextlib.suppress(OSError):
                self.listener.close()
        if self.sockets is not None:
            self.sockets.close()
        self.poke()
        threads = [threading.Thread(target=link.close, args=("the mux is stopping",), kwargs={"clean": clean}, daemon=True)
                   for link in links]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        self.maintenance.shutdown(wait=False)
        self.stopped.set()

    # -- one worker connection -----------------------------------------------------------------
    def handle(self, conn: socket.socket) -> None:
        link = None
        try:
            while not self.stopping.is_set():
                frame = mp.recv_frame(conn)
                if frame is None:
                    return
                kind, req = frame
                came = hops.now() if HOPS_FILE else 0
                if kind != mp.REQUEST:
                    mp.send_frame(conn, mp.ERROR, errors.ProtocolMismatch("expected a request, got frame %d" % kind).to_frame())
                    return
                with self.lock:
                    self.last_activity = time.monotonic()
                stamps: dict[str, Any] | None = None
                if HOPS_FILE and isinstance(req, dict) and isinstance(req.get("hop"), str):
                    stamps = req[exec_ops.STAMPS] = {"in": came}  # never a worker's: it is set here, over any sent
                elif isinstance(req, dict):
                    req.pop(exec_ops.STAMPS, None)
                # a "nowait" request is answered with nothing at all (frames.py): its worker may be gone already
                # (a stand-in for the socket: it has every method the ops use)
                out = cast(socket.socket, exec_ops.Unanswered(conn)) if isinstance(req, dict) and req.get("nowait") else conn
                self.switch_interval.enter()
                try:
                    if out is conn:
                        mp.send_frame(conn, mp.ACK)
                    result = self.dispatch(out, req, link)
                finally:
                    self.switch_interval.leave()
                    self.requests_done += 1
                    self.poke()  # the link's idle deadline moved; a new run or link may need watching
                if stamps is not None:
                    hops.record(HOPS_FILE, "mux", hop=req["hop"][:64], op=str(req.get("op"))[:16], out=hops.now(), **stamps)
                if result is False:
                    return
                if isinstance(result, SessionLink):
                    link = result
        except (OSError, mp.ProtocolError) as e:
            log.debug("worker connection ended: %s", e)
        finally:
            conn.close()
            with self.lock:
                self.connections -= 1
                self.last_activity = time.monotonic()
            self.poke()

    def dispatch(self, conn: socket.socket, req: dict[str, Any], link: SessionLink | None) -> SessionLink | bool | None:
        """Serve one request: a SessionLink after an attach, False to end the connection, else None."""
        op = req.get("op")
        if op == "attach":
            try:
                cfg = LinkConfig.from_wire(req.get("session") or {})
                link = self.attach(cfg)
            except errors.ProtocolMismatch as e:
                mp.send_frame(conn, mp.ERROR, e.to_frame())
                return False
            except errors.SandboxError as e:
                mp.send_frame(conn, mp.ERROR, e.to_frame())
                return None
            # road: the api road takes sudo's password up front; road_note: what `auto` chose, once per run (-v)
            mp.send_frame(conn, mp.RESULT, {"pid": os.getpid(), "session_id": link.session_id, "label": link.label,
                                            "generation": link.generation, "version": mp.PROTOCOL_VERSION,
                                            "road": link.road, "road_note": link.road_note(str(req.get("run") or "")),
                                            "tmp_warnings": exec_ops.take_tmp_warnings(link)})
            return link
        if op == "hello":
            with self.lock:
                served = dict(self.served)
                by_session = {sid: dict(counts) for sid, counts in self.served_by_session.items()}
                moved, moved_by_session = dict(self.moved), {sid: dict(c) for sid, c in self.moved_by_session.items()}
            mp.send_frame(conn, mp.RESULT, {"pid": os.getpid(), "version": mp.PROTOCOL_VERSION,
                                            "sessions": len(self.links), "served": served,
                                            "served_by_session": by_session, "moved": moved,
                                            "moved_by_session": moved_by_session})
            return None
        if op == "reset":
            self.op_reset(conn, req)
            return None
        if op == "shutdown":
            mp.send_frame(conn, mp.RESULT, {"pid": os.getpid()})
            log.info("shutdown requested")
            threading.Thread(target=self.stop, daemon=True).start()
            return False
        if op not in STREAM_OPS and op not in RESULT_OPS:
            mp.send_frame(conn, mp.ERROR, errors.ProtocolMismatch("unknown op %r" % op).to_frame())
            return None
        if link is None:
            mp.send_frame(conn, mp.ERROR, errors.ProtocolMismatch("op %r before attach" % op).to_frame())
            return False
        while True:
            if link.closed.is_set():  # reset, idle-closed or gone since the attach: a fresh link, or why not
                try:
                    link = self.attach(link.cfg)
                except errors.SandboxError as e:
                    mp.send_frame(conn, mp.ERROR, e.to_frame())
                    if op in STREAM_OPS:
                        exec_ops.drain_stdin(conn)  # keep the connection in step
                    return None
            try:
                with link.in_use():
                    if req.get("nowait"):
                        with exec_ops.unawaited(link):
                            self.run_op(op, link, conn, req)
                    else:
                        exec_ops.after_unawaited(link)  # an earlier task's rm, say, is done first
                        self.run_op(op, link, conn, req)
                return link
            except LinkClosed:
                continue  # nothing was sent for this request yet

    def run_op(self, op: str, link: SessionLink, conn: socket.socket, req: dict[str, Any]) -> None:
        result: Any = None
        if op in STREAM_OPS:
            outcome = STREAM_OPS[op](link, conn, req) or op  # a stream op may say how it was served
        else:
            try:
                result = RESULT_OPS[op](link, req)
            except errors.SandboxError as e:
                mp.send_frame(conn, mp.ERROR, link.report(e))
                outcome = op + "_failed"
            else:
                mp.send_frame(conn, mp.RESULT, result)
                outcome = op
        # which path carried a transfer's bytes: put_via_bulk, fetch_via_grpc, put_archive_via_api...
        via = "%s_via_%s" % (op, result["via"]) if isinstance(result, dict) and result.get("via") else None
        session = link.session_id or link.label
        with self.lock:
            self.served[outcome] += 1
            self.served_by_session.setdefault(session, collections.Counter())[outcome] += 1
            if via is not None:
                self.moved[via] += 1
                self.moved_by_session.setdefault(session, collections.Counter())[via] += 1

    def op_reset(self, conn: socket.socket, req: dict[str, Any]) -> None:
        """meta: reset_connection: close this session's link only; its next task opens a fresh one."""
        with self.lock:
            link = self.links.get(req.get("key") or "")
        if link is not None:
            self.close_link(link, "reset_connection")
        mp.send_frame(conn, mp.RESULT, {"pid": os.getpid(), "reset": link is not None})
        return None


def main() -> int:
    cfg = ProcessConfig(**json.loads(sys.stdin.readline()))
    sys.stdin.close()
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s mux[%(process)d] %(levelname)s %(message)s")
    problem = missing_requirements()
    if problem:
        sys.stdout.write(json.dumps(dict(errors.Unreachable(problem).to_frame(), ok=False)) + "\n")
        return 1
    server = MuxServer(cfg)
    signal.signal(signal.SIGTERM, lambda *_signal_args: threading.Thread(target=server.stop, daemon=True).start())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        server.listen()
    except errors.UnusableDirectory as e:
        reply = dict(e.to_frame(), ok=False)
    except OSError as e:
        reply = dict(errors.Unreachable("the connection multiplexer cannot listen on %s: %s"
                                        % (server.socket_path, e)).to_frame(), ok=False)
    else:
        reply = {"ok": True, "pid": os.getpid()}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    if not reply["ok"]:
        log.info("not started: %s", reply["message"])
        return 1
    log.info("serving on %s", shlex.quote(server.socket_path))
    try:
        server.serve_forever()
        server.stopped.wait(30)  # a stop() under way (SIGTERM, idle) finishes its links' housekeeping first
    finally:
        server.stop(clean=False)
        pid_file = os.path.join(server.dir, mp.PID_NAME)
        try:
            with open(pid_file) as f:
                ours = f.read().strip() == str(os.getpid())
            if ours:  # a successor may already have written its own
                os.unlink(pid_file)
        except OSError:
            pass
        log.info("exited")
    return 0


if __name__ == "__main__":
    sys.exit(main())
