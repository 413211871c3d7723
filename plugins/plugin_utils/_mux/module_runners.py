# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The mux's side of the warm module runner (see _guest/module_runner.py, which runs in the guest).

Not to be confused with the guest agent (the gRPC service every command goes through) or the
session's `agent` field (an AI agent spec).

One ModuleRunner per (session, interpreter), held by the session's link over one long-lived
Exec stream. Requests carry ids, so several tasks can run at once (each in its
own fork in the guest). A runner that dies is replaced by the next request; a
request the runner never started is refused (the worker then runs it cold), one
it started and then lost is reported as failed and never re-run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import posixpath
import queue
import struct
import threading
from typing import Any

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import source_of
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import warm_client as wc
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_exec
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_http import Call

log = logging.getLogger("microvm.mux")

START_TIMEOUT = 30.0
TMP_TIMEOUT = 60.0     # a task tmp dir op is a few syscalls; no answer by then means the runner is stuck
HELD_MAX = 256
# The runner sends a module's output in OUT/ERR frames of at most one 64 KiB pipe read (module_runner.on_pipe), and
# small JSON otherwise: any output size is legal, streamed. 16x that is a margin no honest frame reaches.
FRAME_MAX = 1024 * 1024
# Events of one task waiting for its worker to read them: while they are this many, the runner's stream waits (and so
# does the guest), so a worker that lags (loaded controller, stopped process) never makes the mux hold its output.
EVENTS_QUEUED_MAX = 16
STDERR_KEPT = 2000     # the tail of the runner's own stderr, for the message when it ends
CORE_CONFIG = core_compat.runner_config()
WORK_DIR = "warm-runners"  # under the session's scratch dir: the runners' preload dirs
CORE = wr.CoreConfig(CORE_CONFIG)
# What a request's queue carries: (kind, data), kind one of ready, started, stdout, stderr, exit, refuse, done, dead.
Event = tuple[str, Any]


def runner_python_argv(interpreter: str, work_root: str = "") -> list[str]:
    """`<interpreter> -c <the runner's source> microvm-warm-runner <core config JSON> [<work root>]`."""
    return [interpreter, "-c", runner_source(), wr.MARKER, json.dumps(CORE_CONFIG)] + ([work_root] if work_root else [])


def runner_argv(interpreter: str, work_root: str) -> list[str]:
    """The Exec argv that starts a warm runner: through sh, so a missing interpreter is an exit code, not an error.

    Its files go under `work_root` (in the session's scratch dir), not in the guest's /tmp.
    """
    python = runner_python_argv(interpreter, work_root)
    return ["/bin/sh", "-c", 'exec "$0" -c "$1" "$2" "$3" "$4"', python[0]] + python[2:]


def runner_work_root(scratch_dir: str) -> str:
    """Where a session's warm runners keep their files: its scratch dir, which no export takes."""
    return posixpath.join(scratch_dir, WORK_DIR)


def runner_source() -> str:
    return source_of(wr)


class FrameReader:
    """The runner's frames out of its stdout chunks, in linear time, none longer than `max_body`.

    Bytes are appended to one buffer and parsed from an offset; the parsed part is dropped once it is at least
    half of the buffer, so each byte is copied a bounded number of times whatever the chunking. A header announcing
    more than `max_body` is refused before its body is waited for, so no frame is ever buffered past the limit.
    `copied` counts the bytes moved (for the tests' bound on the work done).
    """

    def __init__(self, max_body: int | None = None) -> None:
        self.max_body = FRAME_MAX if max_body is None else max_body
        self.buf = bytearray()
        self.pos = 0
        self.copied = 0

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """The (request id, kind, body) of every frame `data` completes; frames.ProtocolError on an oversized one."""
        self.buf += data
        self.copied += len(data)
        frames = []
        size = wr.HEADER.size
        while len(self.buf) - self.pos >= size:
            length, rid, kind = wr.HEADER.unpack_from(self.buf, self.pos)
            if length > self.max_body:
                raise mp.ProtocolError("the warm runner sent a frame of %d bytes, past the %d bytes (%d KiB) any frame of its "
                                       "protocol may have: something in the guest wrote into the runner's protocol pipe. The "
                                       "runner was stopped and the task is not re-run; the next task starts a new runner "
                                       "(set the connection's warm_runner option to false to run modules without one)"
                                       % (length, self.max_body, self.max_body // 1024))
            end = self.pos + size + length
            if len(self.buf) < end:
                break
            frames.append((rid, kind, bytes(self.buf[self.pos + size:end])))
            self.copied += length
            self.pos = end
        if self.pos and self.pos * 2 >= len(self.buf):
            self.copied += len(self.buf) - self.pos
            del self.buf[:self.pos]
            self.pos = 0
        return frames


class ModuleRunner:
    def __init__(self, client: Any, interpreter: str, scratch_dir: str = profile.SCRATCH_DIR) -> None:
        self.client = client   # the link's road client (exec_stream, iter_exec)
        self.interpreter = interpreter
        self.work_root = runner_work_root(scratch_dir)
        self.lock = threading.Lock()
        self.pending: dict[int, queue.Queue[Event]] = {}  # request id -> queue of events
        self.next_id = 1
        self.call: Any = None
        self.feed: queue.Queue[bytes | None] | None = None
        self.alive = False
        self.info: dict[str, Any] | None = None
        self.held: set[str] = set()  # zip keys the runner has taken: later payloads send only a reference
        self.whole: dict[int, tuple[str | None, bytes]] = {}  # request id -> (zip key, the whole RUN body) until answered
        self.stamped: dict[int, dict[str, int]] = {}  # request id -> the runner's stamps, for requests that ask (hops)
        self.abandoned: set[int] = set()  # requests whose worker went away: nobody reads their events

    def start(self) -> None:
        self.call, self.feed = self.client.exec_stream(runner_argv(self.interpreter, self.work_root), env={}, workdir="", timeout=0,
                                                       deadline=None)
        ready: queue.Queue[Event] = queue.Queue()
        self.pending[0] = ready
        threading.Thread(target=self._read, name="warm-runner", daemon=True).start()
        try:
            event = ready.get(timeout=START_TIMEOUT)
        except queue.Empty:
            event = ("dead", "no answer within %ds" % START_TIMEOUT)
        self.pending.pop(0, None)
        if event[0] != "ready":
            self.stop()
            raise errors.WarmRefused("the warm runner could not start with %s: %s" % (self.interpreter, event[1]))
        self.info = event[1]
        self.alive = True
        log.info("session %s: warm runner for %s started in the guest (python %s, pid %s)", self.client.label, self.interpreter,
                 self.info.get("python"), self.info.get("pid"))

    def _read(self) -> None:
        frames = FrameReader()
        stderr = b""
        why = "its stream ended"
        try:
            for kind, data in self.client.iter_exec(self.call, self.feed):
                if kind == "stderr":
                    stderr = (stderr + data[-STDERR_KEPT:])[-STDERR_KEPT:]  # the tail only, each chunk copied once
                    continue
                if kind != "stdout":
                    why = "it exited with code %s" % data.exit_code
                    break
                for rid, fkind, body in frames.feed(data):
                    self._dispatch(rid, fkind, body)
        except mp.ProtocolError as e:
            # a frame no runner sends (a module or process in the guest wrote into the runner's protocol pipe):
            # nothing more it says can be trusted, so its stream is cut now and the next task starts a new one
            why = str(e)
            self.call.cancel()
        except Exception as e:  # the stream is gone, whatever the reason
            why = str(e)
        if stderr.strip():
            why += "; stderr: %s" % stderr.decode("utf-8", "replace").strip()[-500:]
        with self.lock:
            self.alive = False
            waiting = list(self.pending.items())
            self.pending.clear()
            self.whole.clear()
            self.stamped.clear()
        if waiting:
            log.warning("session %s: warm runner for %s ended: %s", self.client.label, self.interpreter, why)
        else:
            # Nothing was running in it (the session was deleted, paused or rolled back between tasks): nothing was
            # lost, and the next task starts a new runner. The stream's own error would say a command was lost.
            log.info("session %s: warm runner for %s ended while no module ran in it", self.client.label,
                     self.interpreter)
        for rid, q in waiting:
            self._deliver(rid, q, ("dead", why), last=True)
        self.abandoned.clear()

    def _dispatch(self, rid: int, kind: int, body: bytes) -> None:
        try:
            self._take(rid, kind, body)
        except (ValueError, KeyError, TypeError) as e:  # JSON that is not the runner's (UnicodeDecodeError is a ValueError)
            raise mp.ProtocolError("the warm runner sent a malformed frame (kind %d: %s: %s)" % (kind, type(e).__name__, e)) from e

    def _take(self, rid: int, kind: int, body: bytes) -> None:
        q = self.pending.get(rid)
        if q is None:
            return
        if kind == wr.READY:
            self._deliver(rid, q, ("ready", json.loads(body.decode("utf-8"))))
        elif kind == wr.STARTED:
            sent = self.whole.pop(rid, None)
            if sent is not None and sent[0] is not None:
                if len(self.held) >= HELD_MAX:  # the runner keeps fewer: a stale guess only costs a MISS
                    self.held.clear()
                self.held.add(sent[0])
            self._deliver(rid, q, ("started", None))
        elif kind == wr.MISS:  # the runner no longer holds that zip: send the payload whole
            key, whole = self.whole[rid]
            self.held.discard(key)
            self._send(rid, wr.RUN, whole)
        elif kind == wr.OUT:
            self._deliver(rid, q, ("stdout", body))
        elif kind == wr.ERR:
            self._deliver(rid, q, ("stderr", body))
        elif kind == wr.EXIT:
            done = json.loads(body.decode("utf-8"))
            rc = done["rc"]  # parsed first: a malformed frame leaves the task waiting, told
            if rid in self.stamped:  # asked for (bench/hops_bench.py): the runner's own stamps, within a budget
                self.stamped[rid] = hops.runner_stamps(done.get("hops"))
            self.pending.pop(rid, None)
            self._deliver(rid, q, ("exit", rc), last=True)
        elif kind == wr.REFUSE:
            reason = json.loads(body.decode("utf-8"))["reason"]
            self.pending.pop(rid, None)
            self.whole.pop(rid, None)
            self._deliver(rid, q, ("refuse", reason), last=True)
        elif kind == wr.DONE:
            done = json.loads(body.decode("utf-8"))
            self.pending.pop(rid, None)
            self._deliver(rid, q, ("done", done), last=True)

    def _deliver(self, rid: int, q: queue.Queue[Event], event: Event, last: bool = False) -> None:
        """Hand an event to its task, waiting while EVENTS_QUEUED_MAX are unread; never for a task whose worker left."""
        while rid not in self.abandoned:
            try:
                q.put(event, timeout=0.5)
                return
            except queue.Full:
                continue
        if last:  # the task's own thread may still wait for its end: make room for it, dropping unread output
            with contextlib.suppress(queue.Empty):
                while True:
                    q.get_nowait()
            q.put_nowait(event)
            self.abandoned.discard(rid)

    def _send(self, rid: int, kind: int, body: bytes = b"") -> None:
        if self.feed is None:
            raise errors.WarmRefused("the warm runner is not running")
        self.feed.put(wr.HEADER.pack(len(body), rid, kind) + body)

    def submit(self, env: dict[str, str], payload: bytes, before: list[dict[str, Any]] | None = None,
               stamps: bool = False) -> tuple[int, queue.Queue[Event]]:
        """Queue a module run: (request id, event queue).

        `before`: task tmp dir ops (core_compat.tmp_op) the worker deferred to this run, done by the runner
        first, in the same request (one refused: the run is refused, nothing started).
        A payload whose zip the runner already holds goes without it (about 170 KiB less per task);
        if the runner has dropped it meanwhile it answers MISS and gets the whole payload.
        `stamps`: the runner sends its timestamps with the EXIT (see _shared/hops.py), taken with stamps_of().
        """
        split = wr.split_payload(payload, CORE)
        key = wr.zip_key(split[1]) if split else None
        extra: dict[str, Any] = {"before": before} if before else {}
        if stamps:
            extra["hops"] = 1
        meta = json.dumps({"env": env, **extra}).encode("utf-8")
        whole = struct.pack("!I", len(meta)) + meta + payload
        rid, q = self._new_request()
        with self.lock:
            self.whole[rid] = (key, whole)
            if stamps:
                self.stamped[rid] = {}
        if split and key is not None and key in self.held:
            ref = json.dumps({"env": env, "zip": key, **extra}).encode("utf-8")
            self._send(rid, wr.RUNREF, struct.pack("!I", len(ref)) + ref + split[0])
        else:
            self._send(rid, wr.RUN, whole)
        return rid, q

    def stamps_of(self, rid: int) -> dict[str, int]:
        """The runner's stamps for a request submitted with stamps=True (once; {} if it sent none)."""
        with self.lock:
            return self.stamped.pop(rid, {})

    def _new_request(self) -> tuple[int, queue.Queue[Event]]:
        q: queue.Queue[Event] = queue.Queue(maxsize=EVENTS_QUEUED_MAX)
        with self.lock:
            if not self.alive:
                raise errors.WarmRefused("the warm runner is not running")
            rid = self.next_id
            self.next_id += 1
            self.pending[rid] = q
        return rid, q

    def tmp(self, op: dict[str, Any]) -> dict[str, Any]:
        """Have the runner do a task tmp dir op (core_compat.tmp_op) -> {"rc", "stdout", "stderr"}.

        WarmRefused: nothing to undo, run the command in a shell. CommandLost: the runner died under it.
        """
        rid, q = self._new_request()
        self._send(rid, wr.TMP, json.dumps(op).encode("utf-8"))
        try:
            kind, data = q.get(timeout=TMP_TIMEOUT)
        except queue.Empty as e:
            self.pending.pop(rid, None)
            raise errors.CommandLost("the warm runner did not answer within %ds" % TMP_TIMEOUT) from e
        if kind == "done":
            return data
        if kind == "refuse":
            raise errors.WarmRefused(data)
        raise errors.CommandLost(data)

    def kill(self, rid: int) -> None:
        if self.alive:
            self._send(rid, wr.KILL)

    def abandon(self, rid: int) -> None:
        """The task's worker went away: stop its module and drop what it still sends."""
        self.abandoned.add(rid)
        self.kill(rid)

    def stop(self, touch_guest: bool = True) -> None:
        """End the runner's stream (stdin EOF: it waits for its children and exits). `touch_guest` changes nothing
        here: nothing but that EOF, on the runner's own stream, reaches the guest."""
        self.alive = False
        if self.feed is not None:
            self.feed.put(None)  # stdin EOF: the runner waits for its children and exits
        if self.call is not None:
            timer = threading.Timer(10.0, self.call.cancel)
            timer.daemon = True
            timer.start()


class ModuleRunners:
    """A session's runners, one per (interpreter, controller core version): the payloads of two cores
    differ in their module_utils, so each core's runs preload their own. Interpreters that cannot run
    a runner are remembered."""

    def __init__(self, client: Any, scratch_dir: str = profile.SCRATCH_DIR) -> None:
        self.client = client
        self.scratch_dir = scratch_dir
        self.lock = threading.Lock()
        self.runners: dict[tuple[str, str], ModuleRunner] = {}
        self.broken: dict[str, str] = {}  # interpreter -> why it cannot run a runner

    def get(self, interpreter: str, core: str = "") -> ModuleRunner:
        with self.lock:
            if interpreter in self.broken:
                raise errors.WarmRefused(self.broken[interpreter])
            runner = self.runners.get((interpreter, core))
            if runner is not None and runner.alive:
                return runner
            if runner is not None:
                log.info("warm runner for %s (core %s) died: starting a new one", interpreter, core or "?")
            runner = self._new_runner(interpreter, core)
            try:
                runner.start()
            except errors.WarmRefused as e:
                self.broken[interpreter] = str(e)
                raise
            self.runners[(interpreter, core)] = runner
            return runner

    def _new_runner(self, interpreter: str, core: str) -> ModuleRunner:
        return ModuleRunner(self.client, interpreter, self.scratch_dir)

    def any_alive(self) -> ModuleRunner:
        """A running runner of this session (the oldest), for work that needs no particular interpreter."""
        with self.lock:
            for runner in self.runners.values():
                if runner.alive:
                    return runner
        raise errors.WarmRefused("no warm runner is running in this session yet")

    def stop(self, touch_guest: bool = True) -> None:
        """Stop every runner; without `touch_guest` (a session not usable now) nothing runs in the guest for it."""
        with self.lock:
            for runner in self.runners.values():
                runner.stop(touch_guest)
            self.runners.clear()

    def leave_files(self) -> bool:
        """Whether stopping a runner runs a command in the guest (to remove its files)."""
        return False


class ApiModuleRunner(ModuleRunner):
    """A warm runner on the api road, where no exec has a stdin that stays open (interactive stdin is a team
    setting, off by default): the same runner (_guest/module_runner.py) started detached on a unix socket in the
    mux's api dir, each request one buffered exec of _guest/warm_client.py carrying its frames, followed as a
    job (api_exec.Jobs: a module that outlives the slice is polled, a big answer downloaded, a cancelled one
    killed). The frames are handled as on the agent road (ModuleRunner._dispatch), under the same bounds."""

    def __init__(self, client: Any, interpreter: str, api_dir: str, name: str) -> None:
        super().__init__(client, interpreter)
        self.dir = posixpath.join(api_dir, name)   # the runner's socket, log and preload dir; removed when it stops
        self.work_root = self.dir
        self.socket = posixpath.join(self.dir, "sock")
        self.calls: dict[int, Any] = {}            # request id -> the exec carrying it (cancel() stops it)

    def client_argv(self, job: str, wait: int, connect_wait: float = 0.0) -> list[str]:
        """`<python> -I -S -c <warm_client.py> <socket> <job> <slice> <inline> <marker> [<connect wait>]`."""
        return [self.interpreter, "-I", "-S", "-c", source_of(wc), self.socket, job, str(wait), str(api_exec.INLINE_MAX),
                api_exec.TRAILER.decode()] + (["%g" % connect_wait] if connect_wait else [])

    def launch_argv(self, job: str, wait: int) -> list[str]:
        """Start the runner detached (its stderr in its dir's log), then greet it with the client (its READY)."""
        greet = self.client_argv(job, wait, START_TIMEOUT)  # it reads its own arguments only: the runner's follow
        return ["/bin/sh", "-c", 'd=$1 m=$2; shift 2; mkdir -p -m 0700 -- "$d" || exit 1; '
                '(shift "$m"; exec "$@") </dev/null >/dev/null 2>"$d/log" & export %s=$!; exec "$@"' % wc.RUNNER_PID_ENV,
                "sh", self.dir, str(len(greet))] + greet + runner_python_argv(self.interpreter, self.dir) + [self.socket]

    def start(self) -> None:
        ready: queue.Queue[Event] = queue.Queue()
        self.pending[0] = ready
        why = "it sent no READY"
        try:
            self._exchange(b"", self.launch_argv)
        except errors.SandboxError as e:
            why = str(e)
        self.pending.pop(0, None)
        event: Event = ready.get_nowait() if not ready.empty() else ("dead", why)
        if event[0] != "ready":
            self.stop()
            raise errors.WarmRefused("the warm runner could not start with %s: %s" % (self.interpreter, event[1]))
        info: dict[str, Any] = event[1]
        self.info = info
        self.alive = True
        log.info("session %s: warm runner for %s started in the guest on the api road (python %s, pid %s)",
                 self.client.label, self.interpreter, info.get("python"), info.get("pid"))

    def _exchange(self, frames: bytes, start: Any, call: Any = None) -> None:
        """One exec carrying `frames` to the runner; every frame of its answer dispatched as it comes."""
        call = call or Call([], "", 0, False)
        reader = FrameReader()
        for kind, data in self.client.jobs.run(call, frames, start=start):
            if kind == "stdout":
                for rid, fkind, body in reader.feed(data):
                    self._dispatch(rid, fkind, body)
            elif kind == "stderr" and data.strip():
                log.info("session %s: warm client said: %s", self.client.label, shown(data[-STDERR_KEPT:], text=True))

    def kill(self, rid: int) -> None:
        """Stop a request's exec (alive or not: a runner marked lost may still run its module)."""
        self._send(rid, wr.KILL)

    def _send(self, rid: int, kind: int, body: bytes = b"") -> None:
        if kind == wr.KILL:
            call = self.calls.get(rid)
            if call is not None:
                call.cancel()  # the road drops its job: the client (or its keeper) is killed, the runner kills the module
            return
        frame = wr.HEADER.pack(len(body), rid, kind) + body
        call = Call([], "", 0, False)
        self.calls[rid] = call
        threading.Thread(target=self._request, args=(rid, call, frame), name="warm-request", daemon=True).start()

    def _request(self, rid: int, call: Any, frame: bytes) -> None:
        why = "the runner's answer ended before the task's end"
        try:
            if len(frame) > api_exec.ONE_SHOT_MAX:
                q = self.pending.pop(rid, None)
                if q is not None:
                    self._deliver(rid, q, ("refuse", "%d bytes of request do not fit one exec's stdin" % len(frame)), last=True)
                return
            self._exchange(frame, self.client_argv, call)
        except mp.ProtocolError as e:  # a frame no runner sends: nothing more it says can be trusted
            why = str(e)
            self.alive = False
        except errors.SandboxError as e:  # no runner at the socket (never started), or the exec was lost
            why = str(e)
            self.alive = False  # the next task starts a new runner (a live one stops when its socket is replaced)
        finally:
            if self.calls.get(rid) is call:  # not when a MISS sent the request again on a new exec
                self.calls.pop(rid, None)
                q = self.pending.pop(rid, None)
                self.whole.pop(rid, None)
                if q is not None:  # its answer ended without the request's last frame: the runner is lost
                    self.alive = False
                    self._deliver(rid, q, ("dead", why), last=True)
                self.abandoned.discard(rid)

    def stop(self, touch_guest: bool = True) -> None:
        """Remove the runner's dir: it stops once its socket file is gone (module_runner.serve), its modules killed.

        Without `touch_guest` (the session is paused: any exec would wake it) the dir is left: the next runner of
        this mux takes its socket over (the old one then stops), and a later mux's sweep removes the dir.
        """
        self.alive = False
        for call in list(self.calls.values()):
            call.cancel()
        if not touch_guest:
            log.info("session %s: the session is not usable: the warm runner's dir %s is left to a later link",
                     self.client.label, self.dir)
            return
        with contextlib.suppress(errors.SandboxError):
            self.client.jobs.raw(["rm", "-rf", "--", self.dir], timeout=10)


class ApiModuleRunners(ModuleRunners):
    """The api road's runners (ApiModuleRunner), one per (interpreter, core) as on the agent road, each in its own
    dir of the mux's api dir (run_dirs.api_dir_name: a later link sweeps it if this mux dies)."""

    def leave_files(self) -> bool:
        with self.lock:
            return bool(self.runners)

    def _new_runner(self, interpreter: str, core: str) -> ModuleRunner:
        name = "warm-" + hashlib.sha256(("%s\0%s" % (interpreter, core)).encode("utf-8")).hexdigest()[:12]
        return ApiModuleRunner(self.client, interpreter, self.client.api_dir, name)
