"""The documented data plane beside the port-forward: the buffered exec, and for a team with it, events and stdin.

`POST .../sandbox/exec` answers the buffered JSON of the pydo/DoTs pages: {exit_code, stdout, stderr,
duration_ms}, each stream capped at 1 MiB (a cut one named in a header, our reading: agentrpc.TRUNCATED_HEADERS),
timeout_seconds clamped (default 60, at most the plane's exec_max_timeout, 240 as documented). Only for a team
with interactive stdin (a plane setting here) does a client that asks for `text/event-stream` get the command's
output as Server-Sent Events, and `keep_stdin_open: true` keep stdin open for writes to
`.../sandbox/exec/{exec_id}/stdin` (403 for any other team), the exec id coming with the `started` event; the
writes answer the documented codes (404 unknown or finished exec; 409 closed stdin, offset gap, or a team that
cannot take it; at most 1 MiB each). Documented on 18 Nov 2026 ("How to Send Interactive Stdin to a Sandbox
Command", DoTs harness-post-session-sandbox-exec-stdin); the other event names and shapes, the Accept header and
the write's answer are OUR READING (docs/platform-contract.md, "Data plane"). Commands run in the guest through
the same agent as the REST exec (agentrpc).

Plane settings (the team's switches, `docs/platform-contract.md`, "Data plane"): the environment
gives the defaults, a `team-settings.json` in the state dir overrides them while the plane runs.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import grpc
from aiohttp import web

from . import agentrpc, contract
from .httputil import ApiFailure, check_id, error_response, read_document, read_limited
from .pb import pb2

INTERACTIVE_STDIN_ENV = "MICROVM_LOCALPLANE_INTERACTIVE_STDIN"
CLOSED_PORTS_ENV = "MICROVM_LOCALPLANE_CLOSED_PORTS"
EXEC_MAX_TIMEOUT_ENV = "MICROVM_LOCALPLANE_EXEC_MAX_TIMEOUT"
log = logging.getLogger(__name__)
SETTINGS_FILE = "team-settings.json"
SETTINGS_KEYS = frozenset(["interactive_stdin", "closed_ports", "exec_max_timeout", "throttle"])
THROTTLE_KEYS = frozenset(["id", "calls", "retry_after"])

EVENT_STREAM = "text/event-stream"
EXEC_EVENT_KEYS = contract.EXEC_KEYS | frozenset(["keep_stdin_open"])
STDIN_KEYS = frozenset(["data", "offset", "eof"])
STDIN_WRITE_MAX = 1024 * 1024          # "Each write is at most 1 MiB" (harness-post-session-sandbox-exec-stdin)
STDIN_BODY_MAX = 2 * 1024 * 1024       # 1 MiB as base64, with room for the JSON around it
KEEPALIVE_SECONDS = 15.0               # edges cut idle connections: a comment line keeps the stream alive
HANGUP_POLL_SECONDS = 0.2              # how soon a client's hang-up stops its command


@dataclass(frozen=True)
class Settings:
    """The per-team switches the platform keeps and the local plane stands in for."""

    interactive_stdin: bool = False
    closed_ports: frozenset = field(default_factory=frozenset)
    exec_max_timeout: int = contract.EXEC_MAX_TIMEOUT  # the exec clamp; lower in tests of long tasks
    throttle: Throttle | None = None  # the next execs answer 429, as a rate-limited team's would


@dataclass(frozen=True)
class Throttle:
    """`calls` execs from now answer 429 (with `Retry-After: retry_after` unless None); `id` names this batch, so a
    settings file re-read on every call starts it once."""

    id: str
    calls: int
    retry_after: int | None


def _throttle(value) -> Throttle | None:
    if value is None:
        return None
    calls, after = (value.get("calls"), value.get("retry_after")) if isinstance(value, dict) else (None, None)
    if (not isinstance(value, dict) or set(value) - THROTTLE_KEYS or not isinstance(value.get("id"), str)
            or not isinstance(calls, int) or calls < 0 or not (after is None or isinstance(after, int) and after >= 0)):
        raise ValueError("throttle must be {id: text, calls: count, retry_after: seconds or null}, got %r" % (value,))
    return Throttle(value["id"], calls, after)


def _clamp(value) -> int:
    if isinstance(value, str):
        value = value.strip() or contract.EXEC_MAX_TIMEOUT
    try:
        n = int(value)
    except (TypeError, ValueError) as e:
        raise ValueError("exec_max_timeout must be a whole number of seconds, got %r" % (value,)) from e
    if n < 1:
        raise ValueError("exec_max_timeout must be at least 1 second, got %r" % (value,))
    return n


def _truthy(text: str | None) -> bool:
    return (text or "").strip().lower() in contract.QUERY_TRUE


def _ports(value) -> frozenset:
    if isinstance(value, str):
        value = [p for p in value.replace(",", " ").split() if p]
    try:
        return frozenset(int(p) for p in value or ())
    except (TypeError, ValueError) as e:
        raise ValueError("closed_ports must be a list of port numbers, got %r" % (value,)) from e


def read_settings(state_dir: str) -> Settings:
    """The team's settings: the environment's, then the state dir's team-settings.json over them."""
    interactive = _truthy(os.environ.get(INTERACTIVE_STDIN_ENV))
    closed = _ports(os.environ.get(CLOSED_PORTS_ENV, ""))
    clamp = _clamp(os.environ.get(EXEC_MAX_TIMEOUT_ENV, ""))
    throttle = None
    path = os.path.join(state_dir, SETTINGS_FILE)
    with contextlib.suppress(FileNotFoundError):
        with open(path) as f:
            doc = json.load(f)
        if not isinstance(doc, dict) or set(doc) - SETTINGS_KEYS:
            raise ValueError("%s must be an object with only %s" % (path, ", ".join(sorted(SETTINGS_KEYS))))
        if "interactive_stdin" in doc:
            interactive = doc["interactive_stdin"] is True
        if "closed_ports" in doc:
            closed = _ports(doc["closed_ports"])
        if "exec_max_timeout" in doc:
            clamp = _clamp(doc["exec_max_timeout"])
        throttle = _throttle(doc.get("throttle"))
    return Settings(interactive, closed, clamp, throttle)


def write_settings(state_dir: str, **values) -> None:
    """Change the team's settings of a running plane (tests, and `microvm-localplane` users by hand)."""
    unknown = set(values) - SETTINGS_KEYS
    if unknown:
        raise ValueError("unknown team settings: %s" % ", ".join(sorted(unknown)))
    path = os.path.join(state_dir, SETTINGS_FILE)
    doc = {}
    with contextlib.suppress(FileNotFoundError):
        with open(path) as f:
            doc = json.load(f)
    doc.update({k: (sorted(v) if k == "closed_ports" else v) for k, v in values.items()})
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def wants_events(request) -> bool:
    return any(part.split(";", 1)[0].strip().lower() == EVENT_STREAM
               for part in request.headers.get("Accept", "").split(","))


def sse(event: str, data: dict) -> bytes:
    return ("event: %s\ndata: %s\n\n" % (event, json.dumps(data, separators=(",", ":")))).encode()


class ExecState:
    """One exec started on the event stream: where its stdin stands."""

    def __init__(self, exec_id: str, session_id: str, interactive: bool, initial: bytes):
        self.exec_id = exec_id
        self.session_id = session_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.offset = len(initial)     # stdin bytes accepted so far
        self.eof = not interactive
        if initial:
            self.queue.put_nowait(initial)
        if self.eof:
            self.queue.put_nowait(None)

    def write(self, offset: int, data: bytes, eof: bool) -> None:
        if self.eof:
            raise ApiFailure(409, "stdin of exec %s is closed" % self.exec_id)
        if offset > self.offset:
            raise ApiFailure(409, "offset %d is past the %d stdin bytes accepted so far: write from offset %d"
                             % (offset, self.offset, self.offset))
        data = data[self.offset - offset:]  # a lower offset is a retry: the overlap is trimmed
        if data:
            self.queue.put_nowait(data)
            self.offset += len(data)
        if eof:
            self.eof = True
            self.queue.put_nowait(None)


class DataPlane:
    """The exec and stdin handlers; `routes` is the server's Routes (session lookup, guest use counting)."""

    def __init__(self, routes):
        self.routes = routes
        self.plane = routes.plane
        self.execs: dict[str, ExecState] = {}
        self.throttled: dict[str, int] = {}  # a throttle's id: the 429s answered for it so far

    def settings(self) -> Settings:
        try:
            return read_settings(self.plane.state_dir)
        except (ValueError, OSError) as e:
            raise ApiFailure(500, "the local plane's team settings are unreadable: %s" % e) from e

    def check_port(self, port_text: str) -> None:
        """A port the plane's settings close answers as a guest port nothing listens on (502)."""
        with contextlib.suppress(ValueError):
            port = int(port_text)
            if port in self.settings().closed_ports:
                raise ApiFailure(502, "could not reach guest port %d: connection refused" % port)

    # -- POST .../sandbox/exec -------------------------------------------------------------
    async def exec_(self, request):
        rec = self.routes.session(request)
        settings = self.settings()
        throttle = settings.throttle
        if throttle is not None and self.throttled.get(throttle.id, 0) < throttle.calls:
            # a rate-limited team: refused before the call is taken (its body is not even read)
            self.throttled[throttle.id] = self.throttled.get(throttle.id, 0) + 1
            log.info("exec on session %s answered 429 (throttle %s: %d of %d)", rec["session_id"], throttle.id,
                     self.throttled[throttle.id], throttle.calls)
            resp = error_response(429, "too many requests: this team's exec calls are rate limited")
            if throttle.retry_after is not None:
                resp.headers["Retry-After"] = str(throttle.retry_after)
            return resp
        doc = await read_document(request, EXEC_EVENT_KEYS, "exec")
        keep = doc.pop("keep_stdin_open", False)
        if not isinstance(keep, bool):
            raise ApiFailure(400, "keep_stdin_open must be true or false, got %r" % (keep,))
        if keep and not settings.interactive_stdin:
            raise ApiFailure(403, "interactive stdin (keep_stdin_open) is not enabled for this team")
        events = settings.interactive_stdin and wants_events(request)  # other teams get the buffered answer
        if keep and not events:
            raise ApiFailure(400, "keep_stdin_open needs the event stream: send Accept: %s" % EVENT_STREAM)
        agentrpc.parse_exec(doc)  # refuse a bad body before waking anything
        clamp = settings.exec_max_timeout
        if not events:
            return await self.routes._with_guest(rec, "exec", lambda guest: agentrpc.rest_exec(guest, doc, clamp))
        return await self.routes._with_guest(rec, "exec", lambda guest: self._stream(request, guest, rec, doc, keep, clamp))

    async def _stream(self, request, guest, rec, doc, keep, clamp):
        argv, workdir, timeout, stdin = agentrpc.parse_exec(doc, clamp)
        state = ExecState(str(uuid.uuid4()), rec["session_id"], keep, stdin)

        async def requests():
            yield pb2.ExecRequest(start=pb2.ExecStart(argv=argv, workdir=workdir, timeout_seconds=timeout))
            while True:
                item = await state.queue.get()
                if item is None:
                    return
                for i in range(0, len(item), contract.TRANSFER_CHUNK):
                    yield pb2.ExecRequest(stdin=item[i:i + contract.TRANSFER_CHUNK])

        resp = web.StreamResponse(status=200, headers={"Content-Type": EVENT_STREAM, "Cache-Control": "no-cache"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        lock = asyncio.Lock()

        async def send(data: bytes):
            async with lock:
                await resp.write(data)

        running = {}

        async def keepalive():
            # A client that hangs up stops the command: a quiet command writes nothing that would notice, so the
            # connection is watched, and a keepalive comment goes out every KEEPALIVE_SECONDS.
            quiet = 0.0
            while True:
                await asyncio.sleep(HANGUP_POLL_SECONDS)
                transport = request.transport
                if transport is None or transport.is_closing():
                    if "call" in running:
                        running["call"].cancel()
                    return
                quiet += HANGUP_POLL_SECONDS
                if quiet >= KEEPALIVE_SECONDS:
                    quiet = 0.0
                    await send(b": keepalive\n\n")

        self.execs[state.exec_id] = state
        ticker = asyncio.ensure_future(keepalive())
        started = time.monotonic()
        try:
            await send(sse("started", {"exec_id": state.exec_id}))
            async with agentrpc.agent_stub(guest) as stub:
                call = running["call"] = stub.Exec(requests(), timeout=timeout + 30)
                try:
                    async for frame in call:
                        kind = frame.WhichOneof("output")
                        if kind in ("stdout", "stderr"):
                            payload = getattr(frame, kind)
                            await send(sse(kind, {"data": base64.b64encode(payload).decode()}))
                        elif kind == "exit":
                            e = frame.exit
                            await send(sse("exit", {"exit_code": e.exit_code, "timed_out": e.timed_out,
                                                    "duration_ms": e.duration_ms or int((time.monotonic() - started) * 1000)}))
                            break
                    else:
                        await send(sse("error", {"message": "the command was lost: its stream ended without an "
                                                            "exit status (it may have partly run)"}))
                except grpc.aio.AioRpcError as e:
                    await send(sse("error", {"message": "the command was lost: %s" % (e.details() or e.code().name)}))
                finally:
                    call.cancel()  # a client that hung up stops the command, as a cancelled agent stream does
        except ConnectionError:
            pass  # the client went away: the command was stopped above
        finally:
            ticker.cancel()
            self.execs.pop(state.exec_id, None)
            state.eof = True
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    # -- POST .../sandbox/exec/{exec_id}/stdin ---------------------------------------------
    async def write_stdin(self, request):
        rec = self.routes.session(request)
        exec_id = check_id(request.match_info["eid"], "exec")
        raw = await read_limited(request, STDIN_BODY_MAX)
        try:
            doc = json.loads(raw.decode("utf-8") or "{}")
        except (UnicodeDecodeError, ValueError) as e:
            raise ApiFailure(400, "stdin write body is not JSON: %s" % e) from e
        if not isinstance(doc, dict):
            raise ApiFailure(400, "stdin write body must be a JSON object with offset, data and eof")
        unknown = sorted(set(doc) - STDIN_KEYS)
        if unknown:
            raise ApiFailure(400, "unknown fields in stdin write body: %s (allowed: data, eof, offset)" % ", ".join(unknown))
        offset, data, eof = doc.get("offset"), doc.get("data"), doc.get("eof", False)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ApiFailure(400, "offset is required: the count of stdin bytes already accepted, got %r" % (offset,))
        if not isinstance(eof, bool):
            raise ApiFailure(400, "eof must be true or false, got %r" % (eof,))
        if data is None and not eof:
            raise ApiFailure(400, "a stdin write needs data, eof, or both")
        payload = b""
        if data is not None:
            if not isinstance(data, str):
                raise ApiFailure(400, "data must be base64 text")
            try:
                payload = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as e:
                raise ApiFailure(400, "data is not valid base64") from e
        if not payload and not eof:  # "A write needs data, eof, or both": empty data is none
            raise ApiFailure(400, "a stdin write needs data, eof, or both; this one has empty data and no eof")
        if len(payload) > STDIN_WRITE_MAX:
            raise ApiFailure(413, "a stdin write is at most %d bytes, this one has %d" % (STDIN_WRITE_MAX, len(payload)))
        state = self.execs.get(exec_id)
        if state is None or state.session_id != rec["session_id"]:
            raise ApiFailure(404, "exec %s is unknown or finished" % exec_id)
        if not self.settings().interactive_stdin:
            raise ApiFailure(409, "session %s cannot accept interactive stdin" % rec["session_id"])
        state.write(offset, payload, eof)
        return web.json_response({"exec_id": exec_id, "offset": state.offset, "eof": state.eof})
