# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Client of the guest agent's gRPC service: Exec, Upload and Download.

No silent loss: an Exec stream that ends without its exit frame, or fails
with UNAVAILABLE / NOT_FOUND, is a CommandLost and is never re-run (it may
have partly run). Uploads stream a file in chunks with its sha256 in
UploadEnd; downloads stream into a temporary file next to the destination
and are renamed into place only once the sha256 matches. Transfer paths
outside the transfer root are refused here, before any network call.

Uploads and downloads take a bulk line (bulk_line.py: one socket, no gRPC
threads) when the link gives a pool of them: an upload of at least BULK_MIN
bytes dials one, a smaller one uses an idle line or the channel, a download
always takes one (its size is unknown before it starts). A line that cannot
be dialled leaves the transfer to the channel (nothing was sent yet).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import tempfile
import threading
from typing import Any, BinaryIO, Callable, Iterator, Sequence

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import bulk_line, capped
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2 as pb
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2_grpc as pb_grpc

GRPC_IMPORT_ERROR: ImportError | None = None
try:
    import grpc
except ImportError as e:  # the mux reports it, naming the package to install
    # mypy types the name as the module; without it the mux refuses to start (server.py reads GRPC_IMPORT_ERROR)
    grpc = None  # type: ignore[assignment]
    GRPC_IMPORT_ERROR = e

log = logging.getLogger("microvm.mux")

CHUNK_SIZE = 2 * 1024 * 1024       # within the agent's accepted 1 KiB - 4 MiB, and under a default 4 MiB gRPC limit
MAX_MESSAGE = 16 * 1024 * 1024
BULK_MIN = 1024 * 1024   # an upload this big dials a bulk line when none is idle
SERVICE = "/do.teams.hosted_agents.runtime.sandbox_agent.v1.SandboxAgentService/"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    # a dropped tunnel should be redialled promptly, not after grpc's default 1-120 s backoff. Not
    # grpc.min_reconnect_backoff_ms: gRPC takes it as the minimum *connect timeout* too, and a fresh tunnel
    # (a WebSocket dial through the API, then the guest's bridge) often needs more than 100 ms to carry the
    # agent's SETTINGS frame: the attempt was abandoned and the next command failed without being sent.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # each channel its own connection: a channel opened to replace a lost one must never share its subchannel
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.enable_retries", 0),
    # bulk transfers: a deeper receive window and bigger HTTP/2 frames mean fewer stalls and wakeups
    ("grpc.http2.lookahead_bytes", 8 * 1024 * 1024),
    ("grpc.http2.max_frame_size", 1024 * 1024),
    ("grpc.default_authority", "sandbox-agent"),
]


def _current_umask() -> int:
    """The process umask, read without changing it (os.umask is not thread-safe to probe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


class prefetch_chunks:
    """Iterate a file in chunks read and hashed by a helper thread, a few chunks ahead.

    Reading and sha256 release the GIL, so they overlap with gRPC sending the previous chunk.
    `hexdigest()` is the sha256 of everything iterated once the iteration is over.
    """

    DEPTH = 4

    def __init__(self, f: BinaryIO, chunk_size: int) -> None:
        self._queue: queue.Queue[bytes | OSError | None] = queue.Queue(self.DEPTH)
        self._digest = hashlib.sha256()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(f, chunk_size), name="upload-read", daemon=True)
        self._thread.start()

    def _read(self, f: BinaryIO, chunk_size: int) -> None:
        try:
            while not self._stop.is_set():
                chunk = f.read(chunk_size)
                if not chunk:
                    break
                self._digest.update(chunk)
                self._queue.put(chunk)
            self._queue.put(None)
        except OSError as e:
            self._queue.put(e)

    def __iter__(self) -> Iterator[bytes]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def hexdigest(self) -> str:
        self._thread.join()
        return self._digest.hexdigest()

    def cancel(self) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a reader waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(0.05)


def land_download(local_path: str, fill: Callable[[BinaryIO], int]) -> int:
    """A download written into a temporary file beside local_path by fill(f), renamed into place only if fill returns
    (a cut, refused or unverified download leaves the old file or nothing); -> what fill returns (bytes written)."""
    local_dir = os.path.dirname(os.path.abspath(local_path))
    tmp: str | None
    fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(local_path)[:40], suffix=".part", dir=local_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            size = fill(f)
        os.chmod(tmp, 0o666 & ~_current_umask())  # like any new file, not mkstemp's 0600
        os.replace(tmp, local_path)
        tmp = None
        return size
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


class ExecResult:
    __slots__ = ("exit_code", "timed_out", "duration_ms", "hitl_rejected", "stdout", "stderr", "truncated")

    def __init__(self, exit_code: int, timed_out: bool = False, duration_ms: int = 0, hitl_rejected: bool = False, stdout: bytes = b"",
                 stderr: bytes = b"") -> None:
        self.exit_code = exit_code
        self.timed_out = timed_out
        self.duration_ms = duration_ms
        self.hitl_rejected = hitl_rejected
        self.stdout = stdout
        self.stderr = stderr
        self.truncated = False  # the mux's own helpers keep a few KiB of each stream (capped.py)


def open_channel(target: str) -> grpc.Channel:
    """A gRPC channel to the agent; `target` is e.g. 'unix:/path/to/tunnel.sock'."""
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def is_absent(error: grpc.RpcError) -> bool:
    """NOT_FOUND, or INTERNAL carrying a 404, means "absent" (platform contract, section 3)."""
    code = error.code() if hasattr(error, "code") else None
    details = (error.details() if hasattr(error, "details") else "") or ""
    return _absent(code, details)


def _absent(code: Any, details: str) -> bool:
    if code == grpc.StatusCode.NOT_FOUND:
        return True
    return code == grpc.StatusCode.INTERNAL and ("404" in details or "does not exist" in details)


def status_code(number: int) -> grpc.StatusCode:
    """A gRPC status number (from a bulk line's trailers) as grpcio's StatusCode (UNKNOWN for a number it lacks)."""
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code
    return grpc.StatusCode.UNKNOWN


def transfer_error(error: grpc.RpcError, path: str, label: str, verb: str) -> errors.SandboxError:
    """Map a gRPC error of Upload/Download to a clear SandboxError naming the path and session."""
    return status_error(error.code(), error.details() or "", path, label, verb)


def status_error(code: grpc.StatusCode, raw_details: str, path: str, label: str, verb: str) -> errors.SandboxError:
    """A refused or failed Upload/Download (its status and the agent's words) as a clear SandboxError."""
    details = shown(raw_details)  # the guest agent's words, shown to the user
    where = "%s on session %s" % (path, label)
    if _absent(code, raw_details):
        return errors.NotFound("cannot %s %s: no such file (%s)" % (verb, where, details))
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return errors.Denied("the guest agent refused to %s %s: %s" % (verb, where, details))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.SandboxError("the guest agent refused to %s %s: %s" % (verb, where, details))
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return errors.GuestUnavailable("lost the connection to session %s while trying to %s %s: %s (%s)" % (
            label, verb, path, details, code.name))
    return errors.SandboxError("cannot %s %s: %s (%s)" % (verb, where, details, code.name))


class _Line:
    """One channel and its stub. Retired when a stream on it was lost; closed once its last call is over."""

    __slots__ = ("channel", "stub", "calls", "retired")

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.SandboxAgentServiceStub(channel)
        self.calls = 0
        self.retired = False


class AgentClient:
    """The three RPCs of SandboxAgentService over one channel.

    With `redial` (a function returning a new channel to the same agent), a call whose stream is lost drops
    its channel's connection: later calls go through a fresh channel, so no call is sent down a cut connection
    in the moment before gRPC notices it closed (it would be lost too, never run). Calls still running on the
    old channel finish on it; it is closed after the last one.
    """

    def __init__(self, channel: grpc.Channel, label: str, scratch_dir: str = profile.SCRATCH_DIR,
                 redial: Callable[[], grpc.Channel] | None = None, bulk: bulk_line.Pool | None = None) -> None:
        self.label = label
        self.bulk = bulk
        self.scratch_dir = scratch_dir
        self._redial = redial
        self._lock = threading.Lock()
        self._line = _Line(channel)
        self._exec_lines: dict[int, _Line] = {}  # id(call) -> its line, from exec_stream to the end of iter_exec

    @property
    def channel(self) -> grpc.Channel:
        return self._line.channel

    @property
    def stub(self) -> Any:
        return self._line.stub

    def _take(self) -> _Line:
        with self._lock:
            line = self._line
            line.calls += 1
        return line

    def _give_back(self, line: _Line) -> None:
        with self._lock:
            line.calls -= 1
            done = line.retired and line.calls == 0
        if done:
            line.channel.close()

    @contextlib.contextmanager
    def _using(self) -> Iterator[_Line]:
        line = self._take()
        try:
            yield line
        finally:
            self._give_back(line)

    def drop_connection(self, line: _Line) -> None:
        """A stream on `line` was lost: the calls that follow dial a fresh connection."""
        if self._redial is None:
            return
        with self._lock:
            if line is not self._line:
                return  # another lost call replaced it already
            line.retired = True
            self._line = _Line(self._redial())
            done = line.calls == 0
        if done:
            line.channel.close()

    def close(self) -> None:
        with self._lock:
            line, self._redial = self._line, None
        line.channel.close()
        if self.bulk is not None:
            self.bulk.close()

    # -- Exec ------------------------------------------------------------------
    def exec_stream(self, argv: Sequence[str], env: dict[str, str] | None = None, workdir: str = "", timeout: int = 0,
                    stdin: bytes | None = None, deadline: float | None = None,
                    hold_stdin: bool = False, output_limit: int = 0) -> tuple[Any, queue.Queue[bytes | None]]:
        """Start a command; returns (call, stdin_queue).

        `hold_stdin` (stdin arrives while the command runs) changes nothing here: the stream carries it anyway.
        Nor does `output_limit` (the worker's max_output_bytes): the output streams as the guest prints it, so the
        worker's own count stops the command as soon as it passes it (it hangs up: the mux cancels the call).

        Feed stdin with stdin_queue.put(bytes) and end it with put(None). Iterate
        `call` with `iter_exec()`. A `stdin` bytes value is sent up front (and EOF).
        """
        feed: queue.Queue[bytes | None] = queue.Queue()
        start = pb.ExecRequest(start=pb.ExecStart(argv=list(argv), workdir=workdir or "",
                                                  env=dict(env or {}), timeout_seconds=int(timeout or 0)))

        def requests() -> Iterator[Any]:
            yield start
            while True:
                item = feed.get()
                if item is None:
                    return
                yield pb.ExecRequest(stdin=item)

        if stdin is not None:
            for offset in range(0, len(stdin), CHUNK_SIZE):
                feed.put(stdin[offset:offset + CHUNK_SIZE])
            feed.put(None)
        line = self._take()
        try:
            call = line.stub.Exec(requests(), timeout=deadline)
        except BaseException:
            self._give_back(line)
            raise
        with self._lock:
            self._exec_lines[id(call)] = line
        return call, feed

    def iter_exec(self, call: Any, feed: queue.Queue[bytes | None] | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ('stdout'|'stderr', bytes) and finally ('exit', ExecResult); raise CommandLost otherwise."""
        with self._lock:
            line = self._exec_lines.pop(id(call), None)
        try:
            yield from self._iter_exec(call, line)
        finally:
            if feed is not None:
                feed.put(None)  # unblock the request generator if stdin never ended
            if line is not None:
                self._give_back(line)

    def _iter_exec(self, call: Any, line: _Line | None) -> Iterator[tuple[str, Any]]:
        try:
            for out in call:
                which = out.WhichOneof("output")
                if which == "stdout":
                    yield "stdout", out.stdout
                elif which == "stderr":
                    yield "stderr", out.stderr
                elif which == "exit":
                    e = out.exit
                    yield "exit", ExecResult(e.exit_code, e.timed_out, e.duration_ms, e.hitl_rejected)
                    return
        except grpc.RpcError as e:
            error = self._exec_error(e)
            if isinstance(error, errors.CommandLost) and e.code() != grpc.StatusCode.CANCELLED and line is not None:
                self.drop_connection(line)  # CANCELLED is our own cancel: the connection is fine
            raise error from e
        if line is not None:
            self.drop_connection(line)
        raise errors.CommandLost("the command's output stream on session %s ended without an exit status: "
                                 "the command was lost (it may have partly run; it is not re-run)" % self.label)

    def _exec_error(self, e: grpc.RpcError) -> errors.SandboxError:
        code = e.code()
        details = shown(e.details() or "")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED):
            return errors.CommandLost("lost the command on session %s: %s (%s); it may have partly run and is not re-run"
                                      % (self.label, details, code.name))
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.CommandLost("the command on session %s ran past the client deadline: %s" % (self.label, details))
        return errors.SandboxError("the guest agent refused the command on session %s: %s (%s)" % (self.label, details, code.name))

    def exec(self, argv: Sequence[str], env: dict[str, str] | None = None, workdir: str = "", timeout: int = 0, stdin: bytes = b"",
             deadline: float | None = None) -> ExecResult:
        """Run a command to completion (the mux's own helpers): at most capped.HELPER_OUTPUT_LIMIT of stdout and stderr."""
        call, feed = self.exec_stream(argv, env=env, workdir=workdir, timeout=timeout, stdin=stdin or b"",
                                      deadline=deadline)
        return capped.collect_exec(self.iter_exec(call, feed))

    # -- Upload ----------------------------------------------------------------
    def upload(self, local_path: str, remote_path: str, mode: int = 0, chunk_size: int = CHUNK_SIZE, is_archive: bool = False) -> int:
        """Stream a local file to a guest path under the transfer root; returns bytes written (a Moved: `via` says how).

        With is_archive the file is a tar stream the agent extracts under remote_path.
        """
        with errors.path_rules():
            remote_path = profile.check_transfer_path(remote_path, self.scratch_dir,
                                                      what="archive destination" if is_archive else "upload destination")
        verb = "extract an archive into" if is_archive else "upload to"
        header = pb.UploadRequest(header=pb.UploadHeader(path=remote_path, mode=mode, is_archive=is_archive))
        if self.bulk is not None and (os.path.getsize(local_path) >= BULK_MIN or self.bulk.has_idle()):
            def upload_call(line: bulk_line.Line) -> int:
                answer = _Collected()
                with open(local_path, "rb") as f:
                    bulk_line.run_call(line, SERVICE + "Upload", _upload_messages(header, f, chunk_size), answer)
                return int(pb.UploadResponse.FromString(answer.data()).bytes_written)
            moved = self._on_bulk_line(upload_call, remote_path, verb, local_path)
            if moved is not None:
                return moved
        with open(local_path, "rb") as f:
            chunks = prefetch_chunks(f, chunk_size)

            def requests() -> Iterator[Any]:
                yield header
                for chunk in chunks:
                    yield pb.UploadRequest(chunk=chunk)
                yield pb.UploadRequest(end=pb.UploadEnd(sha256=chunks.hexdigest()))

            line = self._take()
            try:
                response = line.stub.Upload(requests())
            except grpc.RpcError as e:
                chunks.cancel()
                self._drop_if_lost(e, line)
                raise self._refused(e.code(), e.details() or "", remote_path, verb, local_path) from e
            finally:
                self._give_back(line)
        return Moved(response.bytes_written, "grpc")

    def _refused(self, code: grpc.StatusCode, details: str, remote_path: str, verb: str, local_path: str) -> errors.SandboxError:
        if code == grpc.StatusCode.INVALID_ARGUMENT and "sha" in details.lower():
            return errors.ChecksumMismatch("upload of %s to %s on session %s failed its checksum: %s" % (
                local_path, remote_path, self.label, shown(details)))
        return status_error(code, details, remote_path, self.label, verb)

    def _drop_if_lost(self, error: grpc.RpcError, line: _Line) -> None:
        if error.code() == grpc.StatusCode.UNAVAILABLE:  # the connection broke (a refusal leaves it alone)
            self.drop_connection(line)

    def _on_bulk_line(self, call: Callable[[bulk_line.Line], int], remote_path: str, verb: str,
                      local_path: str) -> Moved | None:
        """call(line) on a bulk line -> Moved(its bytes, "bulk"); None when no line could be dialled (use the channel).

        A reused line that breaks before any answer (its far end had closed it while idle) is replaced once by a
        fresh one: nothing of the transfer took effect (an upload lands only after its checksum is checked).
        """
        pool = self.bulk
        if pool is None:
            return None
        for attempt in (1, 2):
            try:
                line, reused = pool.take()
            except errors.TunnelFailure as e:
                log.warning("session %s: no bulk line (%s); the transfer of %s takes the gRPC channel", self.label, e, remote_path)
                return None
            try:
                moved = call(line)
            except bulk_line.CallFailed as e:
                pool.give_back(line)
                raise self._refused(status_code(e.code), e.message, remote_path, verb, local_path) from e
            except bulk_line.LineBroken as e:
                line.close()
                if reused and not e.answered and attempt == 1:
                    continue
                raise e.error from e
            except BaseException:
                line.close()
                raise
            pool.give_back(line)
            return Moved(moved, "bulk")
        return None  # not reached: the second attempt returns or raises

    # -- Download --------------------------------------------------------------
    def download(self, remote_path: str, local_path: str, chunk_size: int = CHUNK_SIZE) -> int:
        """Stream a guest file to local_path; verified, then renamed into place. Returns bytes written (a Moved)."""
        with errors.path_rules():
            remote_path = profile.check_transfer_path(remote_path, self.scratch_dir, what="download source")
        request = pb.DownloadRequest(path=remote_path, chunk_size_bytes=chunk_size)
        if self.bulk is not None:
            def download_call(line: bulk_line.Line) -> int:
                def fill(f: BinaryIO) -> int:
                    landing = _Landing(f, remote_path, self.label, local_path)
                    bulk_line.run_call(line, SERVICE + "Download", [[request.SerializeToString()]], _DownloadSink(landing))
                    return landing.verdict()
                return land_download(local_path, fill)
            moved = self._on_bulk_line(download_call, remote_path, "download", local_path)
            if moved is not None:
                return moved

        def fill(f: BinaryIO) -> int:
            landing = _Landing(f, remote_path, self.label, local_path)
            with self._using() as line:
                try:
                    for msg in line.stub.Download(request):
                        which = msg.WhichOneof("output")
                        if which == "chunk":
                            landing.chunk(msg.chunk)  # each access copies the bytes out of the message: take them once
                        elif which == "header":
                            landing.expected_size = msg.header.size_bytes
                        elif which == "end":
                            landing.expected_sha = msg.end.sha256
                except grpc.RpcError as e:
                    self._drop_if_lost(e, line)
                    raise transfer_error(e, remote_path, self.label, "download") from e
                if landing.expected_sha is None:
                    self.drop_connection(line)
            return landing.verdict()

        return Moved(land_download(local_path, fill), "grpc")


class Moved(int):
    """The bytes a transfer moved, and the path that carried them: `via` is "bulk" or "grpc"."""

    via: str

    def __new__(cls, size: int, via: str) -> Moved:
        moved = super().__new__(cls, size)
        moved.via = via
        return moved


class _Landing:
    """A download as it lands in its temporary file: written and hashed once, then judged (size, then sha256)."""

    def __init__(self, f: BinaryIO, remote_path: str, label: str, local_path: str) -> None:
        self._f = f
        self._digest = hashlib.sha256()
        self._where = (remote_path, label, local_path)
        self.size = 0
        self.expected_size = -1
        self.expected_sha: str | None = None

    def chunk(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._digest.update(data)
        self.size += len(data)

    def verdict(self) -> int:
        remote_path, label, local_path = self._where
        if self.expected_sha is None:
            raise errors.GuestUnavailable("the download of %s from session %s ended before its checksum: "
                                          "the stream was cut; nothing was written to %s" % (remote_path, label, local_path))
        if self.expected_size >= 0 and self.size != self.expected_size:
            raise errors.ChecksumMismatch("the download of %s from session %s has %d bytes, the agent announced %d; "
                                          "nothing was written to %s" % (remote_path, label, self.size, self.expected_size, local_path))
        if self.expected_sha and self.expected_sha.lower() != self._digest.hexdigest():
            raise errors.ChecksumMismatch("the download of %s from session %s failed its sha256 check; "
                                          "nothing was written to %s" % (remote_path, label, local_path))
        return self.size


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_CHUNK_TAG = 0x12  # field 2 (`chunk`), length-delimited, in both UploadRequest and DownloadChunk


def _upload_messages(header: Any, f: BinaryIO, chunk_size: int) -> Iterator[list[bytes | bytearray | memoryview]]:
    """The Upload's messages for a bulk line: the header, the file's chunks (read into one reused buffer, hashed as
    read, framed by hand so the bytes are not copied into a message object), and the end with the sha256."""
    yield [header.SerializeToString()]
    digest = hashlib.sha256()
    buf = bytearray(chunk_size)
    with memoryview(buf) as view:
        while True:
            n = f.readinto(buf)  # type: ignore[attr-defined]  # a file opened "rb"
            if not n:
                break
            digest.update(view[:n])
            yield [bytes((_CHUNK_TAG,)) + _varint(n), view[:n]]  # sent (copied into frames) before the next read
    yield [pb.UploadRequest(end=pb.UploadEnd(sha256=digest.hexdigest())).SerializeToString()]


class _Collected:
    """A small answer (UploadResponse), kept whole."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def begin(self, length: int) -> None:
        self._parts.clear()

    def piece(self, data: memoryview) -> None:
        self._parts.append(bytes(data))

    def end(self) -> None:
        pass

    def data(self) -> bytes:
        return b"".join(self._parts)


class _DownloadSink:
    """DownloadChunk messages off a bulk line: a chunk's bytes go straight to the landing file as they arrive; the
    header and end messages (small) are parsed whole."""

    SMALL = 64 * 1024

    def __init__(self, landing: _Landing) -> None:
        self._landing = landing
        self._kept = bytearray()
        self._streaming = False
        self._length = 0

    def begin(self, length: int) -> None:
        self._kept.clear()
        self._streaming = False
        self._length = length

    def piece(self, data: memoryview) -> None:
        if self._streaming:
            self._landing.chunk(data)
            return
        self._kept += data
        if self._length < self.SMALL:
            return
        # a big message must be a chunk: its tag and length, then the bytes streamed through
        head = _chunk_head(self._kept, self._length)
        if head is None:
            return  # the tag and length are not all here yet
        rest = bytes(self._kept[head:])
        self._kept.clear()
        self._streaming = True
        if rest:
            self._landing.chunk(rest)

    def end(self) -> None:
        if self._streaming:
            return
        msg = pb.DownloadChunk.FromString(bytes(self._kept))
        which = msg.WhichOneof("output")
        if which == "chunk":
            self._landing.chunk(msg.chunk)
        elif which == "header":
            self._landing.expected_size = msg.header.size_bytes
        elif which == "end":
            self._landing.expected_sha = msg.end.sha256


def _chunk_head(kept: bytearray, length: int) -> int | None:
    """The size of a chunk message's tag and length prefix, once both are in `kept`; refused if it is not a chunk."""
    if kept[0] != _CHUNK_TAG:
        raise bulk_line.BudgetBreach("a download message of %d bytes that is not a chunk" % length)
    value, at, shift = 0, 1, 0
    while at < len(kept):
        byte = kept[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            if at + value != length:
                raise bulk_line.BudgetBreach("a download chunk whose length (%d) does not fill its message (%d)" % (value, length))
            return at
        shift += 7
        if shift > 35:
            raise bulk_line.BudgetBreach("a download chunk with a malformed length")
    return None
