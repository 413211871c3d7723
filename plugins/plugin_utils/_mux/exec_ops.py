# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Command streaming for one session: the exec and warm ops of the mux (see _mux/server.py).

Output goes to the worker as it arrives; stdin comes from the worker until STDIN_EOF. A command
whose stream is lost is reported as lost and never re-run; a worker that hangs up mid-command
(task timeout, ^C) gets its command stopped in the guest.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown

if TYPE_CHECKING:  # imported for its name only: session_link imports nothing from here, but keep it one-way
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink

log = logging.getLogger("microvm.mux")

DEADLINE_GRACE = 30.0          # client deadline beyond the agent's own command timeout
STAMPS = "_stamps"             # the key of a request's hop stamps (server.py adds it: never from the worker)


def op_exec(link: SessionLink, conn: socket.socket, req: dict[str, Any]) -> None:
    timeout = int(req.get("timeout") or 0)
    try:
        link.ensure_ready()
        link.runs.ensure(req.get("run"))
        call, feed = link.client.exec_stream(req["argv"], env=req.get("env"), workdir=req.get("workdir") or "",
                                             timeout=timeout, deadline=(timeout + DEADLINE_GRACE) if timeout else None,
                                             hold_stdin=bool(req.get("hold_stdin")),
                                             output_limit=_output_limit(req))
    except errors.SandboxError as e:
        # answer first (the worker may hold stdin back), then drain its stdin up to STDIN_EOF
        # so that the next request on this connection is read as a request
        mp.send_frame(conn, mp.ERROR, link.report(e))
        drain_stdin(conn)
        return
    done = threading.Event()
    reader = threading.Thread(target=_pump_stdin, args=(conn, call, feed, done), name="stdin", daemon=True)
    reader.start()
    # the worker may hold stdin back (a become password prompt), so the final frame goes out
    # before waiting for its STDIN_EOF
    final: tuple[int, dict[str, Any]] | None = None
    try:
        for kind, data in link.client.iter_exec(call, feed):
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
    except errors.SandboxError as e:
        final = (mp.ERROR, link.report(e))
    if final is None:  # never from either road (an exec ends with its exit or raises), reported all the same
        final = (mp.ERROR, link.report(errors.CommandLost("the command on session %s ended without a status: "
                                                          "it is not re-run" % link.label)))
    done.set()
    mp.send_frame(conn, *final)
    reader.join()


def _output_limit(req: dict[str, Any]) -> int:
    """The worker's max_output_bytes sent with an exec (0 = none; a worker before it sends none)."""
    limit = req.get("max_output")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0


def op_warm(link: SessionLink, conn: socket.socket, req: dict[str, Any]) -> str | None:
    """Run a pipelined module payload in the session's warm module runner (see module_runners.py), after the
    task tmp dir ops the worker deferred to it (`before`: the chmod of the files it put), in the same request.

    Before any output, a request the runner cannot take is answered with an ERR_WARM error, and
    the worker runs it cold; once started, a lost runner is a lost command (never re-run).
    Returns what the mux counts it as (see MuxServer.run_op): None (served warm) or why not.
    """
    stamps = req.get(STAMPS)  # set by the server when the hops switch is on (_shared/hops.py)
    payload = bytearray()
    while True:
        frame = mp.recv_frame(conn)
        if frame is None:
            return None
        if frame[0] == mp.STDIN_EOF:
            break
        if frame[0] != mp.STDIN:
            raise mp.ProtocolError("expected stdin, got frame %d" % frame[0])
        payload += frame[1]
    if stamps is not None:
        stamps["payload"] = hops.now()
    try:
        link.ensure_ready()
        link.runs.ensure(req.get("run"))
        runner = link.runners.get(req["interpreter"], req.get("core") or "")
        rid, events = runner.submit(req.get("env") or {}, bytes(payload), before=req.get("before") or None,
                                    stamps=stamps is not None)
        if stamps is not None:
            stamps["submitted"] = hops.now()
    except errors.WarmRefused as e:
        mp.send_frame(conn, mp.ERROR, e.to_frame())
        return "warm_refused"
    except errors.SandboxError as e:
        mp.send_frame(conn, mp.ERROR, link.report(e))
        return "warm_failed"
    done = threading.Event()

    def watch_hangup() -> None:
        # the worker sends nothing until it has the EXIT: readable before that means it went away
        try:
            if not conn.recv(1, socket.MSG_PEEK) and not done.is_set():
                runner.abandon(rid)
        except OSError:
            if not done.is_set():
                runner.abandon(rid)

    threading.Thread(target=watch_hangup, name="warm-hangup", daemon=True).start()
    started = False
    try:
        while True:
            kind, data = events.get()
            if stamps is not None and kind in ("started", "exit"):
                stamps[kind] = hops.now()
            if kind == "started":
                started = True
            elif kind in ("stdout", "stderr"):
                mp.send_frame(conn, mp.STDOUT if kind == "stdout" else mp.STDERR, data)
            elif kind == "exit":
                done.set()
                mp.send_frame(conn, mp.EXIT, {"rc": data, "timed_out": False, "warm": True})
                if stamps is not None:
                    stamps["answered"] = hops.now()
                    stamps["runner"] = runner.stamps_of(rid)
                return None
            elif kind == "refuse" or not started:
                done.set()
                mp.send_frame(conn, mp.ERROR, errors.WarmRefused(data).to_frame())
                return "warm_refused"
            else:
                done.set()
                lost = errors.CommandLost("the warm module runner on session %s died during the task (%s): "
                                          "the module was lost (it may have partly run; it is not re-run)"
                                          % (link.label, data))
                mp.send_frame(conn, mp.ERROR, link.report(lost))
                return None
    except OSError:
        runner.abandon(rid)
        raise
    finally:
        if stamps is not None:
            runner.stamps_of(rid)  # a refused or lost request's: nobody takes them (already taken after an exit)


def drain_stdin(conn: socket.socket) -> None:
    while True:
        frame = mp.recv_frame(conn)
        if frame is None or frame[0] == mp.STDIN_EOF:
            return
        if frame[0] != mp.STDIN:
            raise mp.ProtocolError("expected stdin, got frame %d" % frame[0])


def _pump_stdin(conn: socket.socket, call: Any, feed: queue.Queue[bytes | None], done: threading.Event) -> None:
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


def op_tmp(link: SessionLink, conn: socket.socket, req: dict[str, Any]) -> str:
    """A task tmp dir command (core_compat.tmp_op: mkdtemp, chmod, rm) done by a running warm runner.

    Answers EXIT with the command's output, or ERR_WARM (nothing to undo: the worker runs the command
    in a shell); a runner lost under it is a lost command. Like every stream op, the worker's (empty)
    stdin is read up to its STDIN_EOF first. A "nowait" one (the rm at a task's end) is answered with
    nothing: see tmp_unawaited.
    """
    drain_stdin(conn)
    if req.get("nowait"):
        return tmp_unawaited(link, req)
    try:
        link.ensure_ready()
        link.runs.ensure(req.get("run"))
        runner = link.runners.any_alive()
        try:
            done = runner.tmp(req["tmp"])
        except errors.CommandLost as e:
            raise errors.CommandLost("the warm module runner on session %s died during a task tmp dir command (%s): "
                                     "it is not re-run" % (link.label, e)) from e
    except errors.WarmRefused as e:
        mp.send_frame(conn, mp.ERROR, e.to_frame())
        return "tmp_refused"
    except errors.SandboxError as e:
        mp.send_frame(conn, mp.ERROR, link.report(e))
        return "tmp_lost" if isinstance(e, errors.CommandLost) else "tmp_failed"
    if done.get("stdout"):
        mp.send_frame(conn, mp.STDOUT, done["stdout"].encode("utf-8", "surrogateescape"))
    if done.get("stderr"):
        mp.send_frame(conn, mp.STDERR, done["stderr"].encode("utf-8", "surrogateescape"))
    mp.send_frame(conn, mp.EXIT, {"rc": int(done.get("rc") or 0), "timed_out": False, "warm": True})
    return "tmp"


# -- requests nobody waits for ---------------------------------------------------------------------------
UNAWAITED_STDERR_KEPT = 2000   # of a tmp dir command's output run by the mux: only for a message
UNAWAITED_TIMEOUT = 60         # seconds an unawaited tmp dir command may take in a shell (the agent stops it then)


class Unanswered:
    """A worker connection whose current request gets no answer (frames.py "nowait"): reads go to the
    connection, every frame sent is dropped, so the connection stays in step whatever the op would have said."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn

    def sendall(self, data: Any) -> None:
        return None

    def send(self, data: Any) -> int:
        return len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


@contextlib.contextmanager
def unawaited(link: SessionLink) -> Iterator[None]:
    """Serve an unanswered request: the session's requests that come after it wait until it is done
    (after_unawaited), so a later task finds its predecessor's tmp dir removed, as with core's awaited rm."""
    with link.unawaited_done:
        link.unawaited += 1
    try:
        yield
    finally:
        with link.unawaited_done:
            link.unawaited -= 1
            link.unawaited_done.notify_all()


def after_unawaited(link: SessionLink) -> None:
    """Wait for the session's unanswered requests in progress (bounded: each is, by UNAWAITED_TIMEOUT)."""
    with link.unawaited_done:
        link.unawaited_done.wait_for(lambda: link.unawaited == 0, timeout=UNAWAITED_TIMEOUT + DEADLINE_GRACE)


def tmp_ahead(link: SessionLink, req: dict[str, Any]) -> dict[str, Any] | None:
    """The task tmp dir commands the worker deferred to this request (`ahead`: [{"op": core_compat.tmp_op, "argv":
    core's command}], a put's mkdtemp), done first, in order: by the warm runner, else in a shell. None when all
    succeeded, else the first failure {"index", "rc", "stdout", "stderr"} (the request is then not done: the worker
    fails the task in core's words)."""
    for index, item in enumerate(req.get("ahead") or []):
        try:
            done = link.runners.any_alive().tmp(item["op"])
            rc, stdout, stderr = (int(done.get("rc") or 0), shown(str(done.get("stdout") or "")[-UNAWAITED_STDERR_KEPT:], text=True),
                                  shown(str(done.get("stderr") or "")[-UNAWAITED_STDERR_KEPT:], text=True))
        except errors.WarmRefused:  # nothing done (tmp_op): core's own command does it
            rc, stdout, stderr = _run_quietly(link, [str(a) for a in item.get("argv") or []])
        if rc != 0:
            return {"index": index, "rc": rc, "stdout": stdout, "stderr": stderr}
    return None


def tmp_unawaited(link: SessionLink, req: dict[str, Any]) -> str:
    """A task tmp dir command its worker did not wait for (the rm at a task's end, agent.py _forget_rm): done by the
    warm runner, else in a shell (the worker's `argv`, core's own command). A failure goes to the log and to the
    session's next attach (take_tmp_warnings), in core's words for a failed rm. Returns how it was served."""
    try:
        link.ensure_ready()
        link.runs.ensure(req.get("run"))
        try:
            done = link.runners.any_alive().tmp(req["tmp"])
            rc, stderr, how = int(done.get("rc") or 0), shown(str(done.get("stderr") or ""), text=True), "tmp_nowait"
        except errors.WarmRefused:
            rc, _stdout, stderr = _run_quietly(link, [str(a) for a in req.get("argv") or []])
            how = "tmp_nowait_shell"
    except errors.SandboxError as e:
        rc, stderr, how = -1, str(e), "tmp_nowait_failed"
    if rc != 0:
        # core's words (ActionBase._remove_tmp_path), which it shows as a warning of the task itself
        warning = ("Error deleting remote temporary files (rc: %s, stderr: %s})" % (rc, stderr[-UNAWAITED_STDERR_KEPT:]))
        log.warning("session %s: %s", link.label, warning)
        link.tmp_warnings.append(warning)
        return "tmp_nowait_failed"
    return how


def _run_quietly(link: SessionLink, argv: list[str]) -> tuple[int, str, str]:
    """(rc, stdout, stderr) of a task tmp dir command run as the agent's user, the tail of each (a few lines at most:
    they only go into a message), shown escaped."""
    if not argv:
        return -1, "", "no command to run"
    call, feed = link.client.exec_stream(argv, env={}, workdir="", timeout=UNAWAITED_TIMEOUT, stdin=b"",
                                         deadline=UNAWAITED_TIMEOUT + DEADLINE_GRACE)
    kept, rc = {"stdout": b"", "stderr": b""}, -1
    for kind, data in link.client.iter_exec(call, feed):
        if kind in kept:
            kept[kind] = (kept[kind] + data[-UNAWAITED_STDERR_KEPT:])[-UNAWAITED_STDERR_KEPT:]
        elif kind == "exit":
            rc = int(data.exit_code)
    return rc, shown(kept["stdout"], text=True), shown(kept["stderr"], text=True)


def take_tmp_warnings(link: SessionLink) -> list[str]:
    """The unawaited tmp dir failures of this session not yet shown, for the attach that shows them."""
    taken = []
    while True:
        try:
            taken.append(link.tmp_warnings.popleft())
        except IndexError:
            return taken
