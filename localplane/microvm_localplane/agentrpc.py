"""REST exec and workspace transfer, done the platform's way: gRPC to the guest's agent on 8443.

grpc.aio needs an address, so each call opens a private unix socket whose
connections are piped to Guest.dial(8443). The agent, inside the guest,
decides what a path means (symlinks, `..`), so the REST layer never sees
the host filesystem.
"""
import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
import time
import uuid

import grpc
from aiohttp import web

from . import contract
from .bridge import pipe
from .httputil import ApiFailure
from .pb import pb2, pb2_grpc

log = logging.getLogger("microvm_localplane.agentrpc")

GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.DATA_LOSS: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 502,
}
SOCKET_DIR = None
PIPE_CHUNK = 65536  # what REST exec and transfers read at a time between the agent socket and the guest


def _socket_dir():
    # Unix socket paths are limited to 107 bytes: keep them short, outside the state dir.
    global SOCKET_DIR
    if SOCKET_DIR is None or not os.path.isdir(SOCKET_DIR):
        SOCKET_DIR = tempfile.mkdtemp(prefix="mvlp-agent-")
    return SOCKET_DIR


def cleanup_sockets():
    if SOCKET_DIR:
        shutil.rmtree(SOCKET_DIR, ignore_errors=True)


@contextlib.asynccontextmanager
async def agent_stub(guest):
    """A SandboxAgentService stub whose connections go through guest.dial(8443)."""
    path = os.path.join(_socket_dir(), uuid.uuid4().hex[:16] + ".sock")
    pipes = set()

    async def on_connect(reader, writer):
        try:
            g_reader, g_writer = await guest.dial(contract.AGENT_PORT)
        except Exception:
            writer.close()
            return
        tasks = [asyncio.ensure_future(pipe(reader, g_writer, PIPE_CHUNK)),
                 asyncio.ensure_future(pipe(g_reader, writer, PIPE_CHUNK))]
        pipes.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)

    server = await asyncio.start_unix_server(on_connect, path)
    channel = grpc.aio.insecure_channel("unix:" + path)
    try:
        yield pb2_grpc.SandboxAgentServiceStub(channel)
    finally:
        await channel.close()
        server.close()
        for task in pipes:
            task.cancel()
        with contextlib.suppress(OSError):
            os.unlink(path)
        await asyncio.gather(*pipes, return_exceptions=True)


def rpc_failure(e, what):
    status = GRPC_TO_HTTP.get(e.code(), 502)
    return ApiFailure(status, "%s failed: %s" % (what, e.details() or e.code().name))


# -- REST exec ------------------------------------------------------------------
# Our reading of "truncation is indicated via response headers when present" (no page names them): these two,
# "true" on a stream the 1 MiB cap cut. The collection never relies on them alone (_mux/api_exec.py).
TRUNCATED_HEADERS = {"stdout": "X-Exec-Stdout-Truncated", "stderr": "X-Exec-Stderr-Truncated"}


def parse_exec(doc, max_timeout=contract.EXEC_MAX_TIMEOUT):
    """(argv, workdir, timeout, stdin) of an exec body; timeout_seconds is "clamped server-side (default 60, maximum
    240) regardless of the value sent": a missing, zero or negative one is the default, a bigger one the maximum
    (the plane's exec_max_timeout setting, dataplane.py)."""
    argv = doc.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ApiFailure(400, "argv must be a non-empty list of strings (there is no implicit shell)")
    workdir = doc.get("workdir") or contract.DEFAULT_WORKDIR
    if not isinstance(workdir, str) or not workdir.startswith("/"):
        raise ApiFailure(400, "workdir must be an absolute path, got %r" % (workdir,))
    timeout = doc.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)):
        raise ApiFailure(400, "timeout_seconds must be a whole number, got %r" % (timeout,))
    if timeout is None or timeout <= 0:
        timeout = contract.EXEC_DEFAULT_TIMEOUT
    timeout = min(timeout, max_timeout)
    stdin = doc.get("stdin")
    data = b""
    if stdin is not None:
        if not isinstance(stdin, str):
            raise ApiFailure(400, "stdin must be base64 text")
        try:
            data = base64.b64decode(stdin, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiFailure(400, "stdin is not valid base64") from e
    return argv, workdir, timeout, data


async def rest_exec(guest, doc, max_timeout=contract.EXEC_MAX_TIMEOUT):
    """The documented buffered answer {exit_code, stdout, stderr, duration_ms}: each stream capped at 1 MiB (a cut
    one named in its header), a non-zero exit still HTTP 200."""
    argv, workdir, timeout, stdin = parse_exec(doc, max_timeout)

    async def requests():
        yield pb2.ExecRequest(start=pb2.ExecStart(argv=argv, workdir=workdir, timeout_seconds=timeout))
        for i in range(0, len(stdin), contract.TRANSFER_CHUNK):
            yield pb2.ExecRequest(stdin=stdin[i:i + contract.TRANSFER_CHUNK])

    streams = {"stdout": bytearray(), "stderr": bytearray()}
    cut = set()
    exit_frame = None
    started = time.monotonic()
    async with agent_stub(guest) as stub:
        try:
            call = stub.Exec(requests(), timeout=timeout + 30)
            async for frame in call:
                kind = frame.WhichOneof("output")
                if kind in streams:
                    data, kept = getattr(frame, kind), streams[kind]
                    room = contract.EXEC_STREAM_CAP - len(kept)
                    if len(data) > room:
                        cut.add(kind)
                    kept += data[:max(room, 0)]
                elif kind == "exit":
                    exit_frame = frame.exit
        except grpc.aio.AioRpcError as e:
            raise rpc_failure(e, "exec") from e
    if exit_frame is None:
        raise ApiFailure(502, "exec: the command was lost (the agent's stream ended without an exit status)")
    doc = {"exit_code": exit_frame.exit_code, "stdout": streams["stdout"].decode("utf-8", "replace"),
           "stderr": streams["stderr"].decode("utf-8", "replace"),
           "duration_ms": exit_frame.duration_ms or int((time.monotonic() - started) * 1000)}
    return web.json_response(doc, headers={TRUNCATED_HEADERS[k]: "true" for k in sorted(cut)})


# -- workspace transfer -----------------------------------------------------------
def _flag(request, name):
    value = request.query.get(name, "false").lower()
    if value not in ("true", "false", "1", "0", ""):
        raise ApiFailure(400, "%s must be true or false, got %r" % (name, value))
    return value in ("true", "1")


def _transfer_path(request):
    path = request.query.get("path", "")
    if not path:
        raise ApiFailure(400, "path is required: an absolute path under %s" % contract.TRANSFER_ROOT)
    if not path.startswith("/"):
        # "Relative paths resolve under the workspace root" (create_session_workspace_upload, ..._download)
        path = posixpath.join(contract.TRANSFER_ROOT, path)
    norm = posixpath.normpath(path)
    if norm != contract.TRANSFER_ROOT and not norm.startswith(contract.TRANSFER_ROOT + "/"):
        raise ApiFailure(403, "path outside workspace: %s" % json.dumps(path))
    return path


async def upload(guest, request):
    path = _transfer_path(request)
    is_archive = _flag(request, "is_archive")
    expected = (request.headers.get("X-Content-Sha256") or "").strip().lower()
    if expected and (len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected)):
        raise ApiFailure(400, "X-Content-Sha256 must be 64 hex characters")
    if request.content_length is not None and request.content_length > contract.MAX_UPLOAD_BYTES:
        raise ApiFailure(413, "upload is %d bytes; at most %d bytes are accepted" % (
            request.content_length, contract.MAX_UPLOAD_BYTES))
    digest = hashlib.sha256()
    state = {"size": 0, "too_big": False}

    async def requests():
        yield pb2.UploadRequest(header=pb2.UploadHeader(path=path, is_archive=is_archive))
        while True:
            chunk = await request.content.read(contract.TRANSFER_CHUNK)
            if not chunk:
                break
            state["size"] += len(chunk)
            if state["size"] > contract.MAX_UPLOAD_BYTES:
                state["too_big"] = True
                # A wrong checksum makes the agent discard the partial file.
                yield pb2.UploadRequest(end=pb2.UploadEnd(sha256="0" * 64))
                return
            digest.update(chunk)
            yield pb2.UploadRequest(chunk=chunk)
        # Our own checksum when none is given, so a torn body never lands.
        yield pb2.UploadRequest(end=pb2.UploadEnd(sha256=expected or digest.hexdigest()))

    async with agent_stub(guest) as stub:
        try:
            resp = await stub.Upload(requests(), timeout=3600)
        except grpc.aio.AioRpcError as e:
            if state["too_big"]:
                raise ApiFailure(413, "upload is larger than %d bytes" % contract.MAX_UPLOAD_BYTES) from e
            if expected and expected != digest.hexdigest():
                raise ApiFailure(400, "X-Content-Sha256 %s does not match the body (sha256 %s); nothing was written"
                                 % (expected, digest.hexdigest())) from e
            raise rpc_failure(e, "upload") from e
    if expected and expected != digest.hexdigest():
        raise ApiFailure(400, "X-Content-Sha256 %s does not match the body (sha256 %s)" % (expected, digest.hexdigest()))
    return {"path": resp.path, "bytes_written": resp.bytes_written}


async def download(guest, request, start_response):
    """Stream a file (or a tar of a directory) from the guest, then the 73-byte DOWSSHA1 footer.

    The first frame is read before any header goes out, so a refusal is still
    a proper HTTP status.
    """
    path = _transfer_path(request)
    as_archive = _flag(request, "as_archive")
    digest = hashlib.sha256()
    async with agent_stub(guest) as stub:
        call = stub.Download(pb2.DownloadRequest(path=path, as_archive=as_archive), timeout=3600)
        frames = call.__aiter__()
        try:
            first = await frames.__anext__()
        except StopAsyncIteration as e:
            raise ApiFailure(502, "download: the agent sent nothing") from e
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INTERNAL and "404" in (e.details() or ""):
                raise ApiFailure(404, "download failed: %s" % e.details()) from e
            raise rpc_failure(e, "download") from e
        if first.WhichOneof("output") == "header" and first.header.size_bytes > contract.MAX_DOWNLOAD_BYTES:
            call.cancel()
            raise ApiFailure(413, "%s is %d bytes; the REST download streams at most %d bytes "
                                  "(contract.MAX_DOWNLOAD_BYTES): use a staged transfer (POST .../workspace/transfers) "
                                  "or the guest agent" % (json.dumps(path), first.header.size_bytes,
                                                          contract.MAX_DOWNLOAD_BYTES))
        response = await start_response()
        sent = 0
        try:
            frame = first
            while True:
                if frame.WhichOneof("output") == "chunk":
                    sent += len(frame.chunk)
                    if sent > contract.MAX_DOWNLOAD_BYTES:
                        # an archive past the bound (its size is known only as it is made): cut, no footer
                        log.warning("download of %s cut at %d bytes (contract.MAX_DOWNLOAD_BYTES)",
                                    json.dumps(path), contract.MAX_DOWNLOAD_BYTES)
                        call.cancel()
                        return response
                    digest.update(frame.chunk)
                    await response.write(frame.chunk)
                try:
                    frame = await frames.__anext__()
                except StopAsyncIteration:
                    break
        except grpc.aio.AioRpcError:
            # Headers are out; a torn stream without a footer is how the client learns of it.
            return response
        await response.write(contract.DOWNLOAD_FOOTER_MAGIC + digest.hexdigest().encode() + b"\n")
        await response.write_eof()
        return response
