"""Staged workspace transfers: the platform's object-storage-backed road for large payloads.

Pages (pydo v0.45-0.46, DoTs v1.24.0, Nov 2026): create_session_workspace_transfer,
create_session_workspace_part_upload_urls, commit_session_workspace_transfer,
get_session_workspace_transfer, cancel_session_workspace_transfer; doctl harness-runtime upload and
download ("Maximum size 50 GiB"). docs/platform-contract.md, "Data plane (exec and files)", has every
rule and every local decision; the constants below are those decisions.

The bulk bytes never go through the API routes: the plane presigns URLs of its own object store,
served under SPACES_PREFIX on the same listener, which takes no bearer token (a request that sends
one is refused, as object storage refuses two auth mechanisms) and checks an HMAC signature and
an expiry instead. Transfers live in the plane's memory (a plane restart fails them) and their
bytes under `<state dir>/transfers/<id>/`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import posixpath
import secrets
import shutil
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

import grpc
from aiohttp import web

from . import agentrpc, contract
from .httputil import ApiFailure, check_id, read_document
from .pb import pb2

log = logging.getLogger("microvm_localplane.transfers")

CREATE_KEYS = frozenset(["direction", "path", "is_archive", "as_archive", "size_bytes", "sha256"])
PART_URL_KEYS = frozenset(["part_numbers"])
COMMIT_KEYS = frozenset(["sha256"])
CANCEL_KEYS = frozenset(["reason"])
MAX_STAGED_BYTES = 50 * 1024 ** 3   # "Maximum size 50 GiB" (doctl harness-runtime upload / download)
PART_SIZE = 64 * 1024 * 1024        # Decision: every part but the last is exactly this long
MAX_PARTS = 10_000                  # Decision: object storage's multipart limit (64 MiB x 10,000 > 50 GiB)
MAX_PART_URLS = 100                 # Decision: part numbers presigned by one call
URL_TTL_SECONDS = 900               # Decision: presigned URLs live 15 minutes ("request them again")
KEEP_SECONDS = 3600                 # Decision: a finished download's object is kept an hour, then swept
SPACES_PREFIX = "/_spaces"          # the local object store's URLs (outside /v2: no bearer token there)
SPACES_ROUTES = ("spaces-part", "spaces-object")  # the only routes the bearer check lets through (they check a signature)
PENDING, IN_PROGRESS, COMPLETED, FAILED = "pending", "in_progress", "completed", "failed"
HEX = frozenset("0123456789abcdef")


def _sha256_field(value, what: str) -> str:
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or len(value) != 64 or set(value) - HEX:
        raise ApiFailure(400, "%s must be 64 lowercase hex characters (a SHA-256), got %r" % (what, value))
    return value


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Transfer:
    transfer_id: str
    session_id: str
    direction: str
    path: str                        # absolute guest path under /workspace
    archive: bool
    size_bytes: int | None           # declared at create (upload)
    sha256: str                      # declared (upload), then the payload's (completed)
    workdir: str
    status: str = PENDING
    bytes_written: int = 0
    error_message: str = ""
    committed: bool = False
    finished: float = 0.0
    task: asyncio.Task | None = None
    created: float = field(default_factory=time.time)
    parts: dict = field(default_factory=dict)   # part number -> size (upload)

    @property
    def object_path(self) -> str:
        return os.path.join(self.workdir, "object")

    def part_path(self, number: int) -> str:
        return os.path.join(self.workdir, "part-%05d" % number)


class StagedTransfers:
    """The transfer routes and the local object store; `routes` is the server's Routes."""

    def __init__(self, routes):
        self.routes = routes
        self.sessions = routes.plane.sessions
        self.root = os.path.join(routes.plane.state_dir, "transfers")
        self.key = secrets.token_bytes(32)
        self.transfers: dict[str, Transfer] = {}
        shutil.rmtree(self.root, ignore_errors=True)  # a restarted plane has no transfer to finish

    # -- helpers --------------------------------------------------------------------------
    def _get(self, request) -> tuple[dict, Transfer]:
        rec = self.routes.session(request)
        tid = check_id(request.match_info["tid"], "transfer")
        t = self.transfers.get(tid)
        if t is None or t.session_id != rec["session_id"]:
            raise ApiFailure(404, "transfer %s not found" % tid)
        return rec, t

    def _sign(self, method: str, path: str, expires: int) -> str:
        return hmac.new(self.key, ("%s\n%s\n%d" % (method, path, expires)).encode(), hashlib.sha256).hexdigest()

    def _presign(self, request, method: str, path: str) -> tuple[str, int]:
        expires = int(time.time()) + URL_TTL_SECONDS
        url = "%s%s?expires=%d&signature=%s" % (request.url.origin(), path, expires, self._sign(method, path, expires))
        return url, expires

    def _finish(self, t: Transfer, status: str, error: str = "") -> None:
        t.status, t.error_message, t.finished = status, error, time.time()
        log.info("staged %s %s of session %s: %s, %d bytes%s", t.direction, t.transfer_id, t.session_id, status,
                 t.bytes_written, (": " + error) if error else "")
        if status == FAILED:
            t.bytes_written = 0 if t.direction == "upload" else t.bytes_written
            shutil.rmtree(t.workdir, ignore_errors=True)
        elif t.direction == "upload":
            shutil.rmtree(t.workdir, ignore_errors=True)  # the parts are in the workspace now

    def _sweep(self) -> None:
        """Finished transfers an hour after they finished, and uploads never committed an hour after they began
        (as object storage aborts stale multipart uploads)."""
        now = time.time()
        for tid, t in list(self.transfers.items()):
            if (t.finished and now - t.finished > KEEP_SECONDS) or (
                    not t.committed and not t.finished and t.direction == "upload" and now - t.created > KEEP_SECONDS):
                shutil.rmtree(t.workdir, ignore_errors=True)
                del self.transfers[tid]

    def _busy(self, sid: str, delta: int) -> None:
        self.sessions.in_flight[sid] = self.sessions.in_flight.get(sid, 0) + delta
        self.sessions.activity.touch(sid)

    # -- POST .../workspace/transfers -----------------------------------------------------
    async def create(self, request):
        rec = self.routes.session(request)
        doc = await read_document(request, CREATE_KEYS, "workspace transfer")
        direction = doc.get("direction")
        if direction not in ("upload", "download"):
            raise ApiFailure(400, "direction must be upload or download, got %r" % (direction,))
        path = doc.get("path")
        if not isinstance(path, str) or not path:
            raise ApiFailure(400, "path is required: a workspace-relative path")
        if path.startswith("/") or "\0" in path:
            raise ApiFailure(400, "path must be workspace-relative (no leading /), got %s" % json.dumps(path))
        full = posixpath.normpath(posixpath.join(contract.TRANSFER_ROOT, path))
        if full != contract.TRANSFER_ROOT and not full.startswith(contract.TRANSFER_ROOT + "/"):
            raise ApiFailure(403, "path outside workspace: %s" % json.dumps(path))
        # Decision: a field of the other direction is refused, not ignored (size_bytes and sha256 are upload's)
        wrong = [k for k in (("as_archive",) if direction == "upload" else ("is_archive", "size_bytes", "sha256"))
                 if k in doc]
        if wrong:
            raise ApiFailure(400, "%s: only for the other direction (%s)" % (", ".join(wrong), direction))
        archive = doc.get("is_archive" if direction == "upload" else "as_archive", False)
        if not isinstance(archive, bool):
            raise ApiFailure(400, "is_archive / as_archive must be true or false, got %r" % (archive,))
        size = doc.get("size_bytes")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ApiFailure(400, "size_bytes must be a whole number of bytes, got %r" % (size,))
        if size is not None and size > MAX_STAGED_BYTES:
            raise ApiFailure(413, "size_bytes %d is more than the %d bytes (50 GiB) a staged transfer carries"
                             % (size, MAX_STAGED_BYTES))
        sha = _sha256_field(doc.get("sha256"), "sha256")
        self._sweep()
        guest = await self.sessions.usable_guest(rec, "download") if direction == "download" else None
        tid = "tr_" + uuid.uuid4().hex
        t = Transfer(tid, rec["session_id"], direction, full, archive, size, sha, os.path.join(self.root, tid))
        os.makedirs(t.workdir, mode=0o700)
        self.transfers[tid] = t
        if direction == "upload":
            return web.json_response({"transfer_id": tid, "part_size": PART_SIZE}, status=201)
        started = asyncio.get_running_loop().create_future()
        t.task = asyncio.ensure_future(self._export(t, guest, started))
        try:
            await started  # a missing or refused source answers here, as the streaming download does
        except ApiFailure:
            self.transfers.pop(tid, None)
            raise
        return web.json_response({"transfer_id": tid}, status=202)

    async def _export(self, t: Transfer, guest, started: asyncio.Future) -> None:
        """Copy the guest's file (or tar) into the object store, hashing it; bounded at 50 GiB."""
        self._busy(t.session_id, 1)
        digest = hashlib.sha256()
        try:
            async with agentrpc.agent_stub(guest) as stub:
                call = stub.Download(pb2.DownloadRequest(path=t.path, as_archive=t.archive), timeout=3600)
                frames = call.__aiter__()
                try:
                    first = await frames.__anext__()
                except StopAsyncIteration:
                    started.set_exception(ApiFailure(502, "download: the agent sent nothing"))
                    return self._finish(t, FAILED, "the agent sent nothing")
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.INTERNAL and "404" in (e.details() or ""):
                        failure = ApiFailure(404, "download failed: %s" % e.details())
                    else:
                        failure = agentrpc.rpc_failure(e, "download")
                    started.set_exception(failure)
                    return self._finish(t, FAILED, failure.message)
                t.status = IN_PROGRESS
                started.set_result(None)
                with open(t.object_path, "wb") as f:
                    frame = first
                    while True:
                        if frame.WhichOneof("output") == "chunk":
                            t.bytes_written += len(frame.chunk)
                            if t.bytes_written > MAX_STAGED_BYTES:
                                call.cancel()
                                return self._finish(t, FAILED, "%s is larger than the %d bytes (50 GiB) a staged "
                                                    "transfer carries" % (json.dumps(t.path), MAX_STAGED_BYTES))
                            digest.update(frame.chunk)
                            f.write(frame.chunk)
                        try:
                            frame = await frames.__anext__()
                        except StopAsyncIteration:
                            break
            t.sha256 = digest.hexdigest()
            self._finish(t, COMPLETED)
        except grpc.aio.AioRpcError as e:
            self._finish(t, FAILED, "the export was cut: %s" % (e.details() or e.code().name))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a full disk, the guest gone: the transfer fails, the plane goes on
            log.exception("staged download %s failed", t.transfer_id)
            self._finish(t, FAILED, "the export failed: %s" % type(e).__name__)
        finally:
            if not started.done():
                started.set_exception(ApiFailure(502, "download: the export stopped before it began"))
            self._busy(t.session_id, -1)

    # -- POST .../transfers/{id}/part-upload-urls -----------------------------------------
    async def part_urls(self, request):
        _rec, t = self._get(request)
        doc = await read_document(request, PART_URL_KEYS, "part upload URLs")
        if t.direction != "upload":
            raise ApiFailure(400, "part upload URLs are for upload transfers only")
        if t.committed or t.status != PENDING:
            raise ApiFailure(409, "transfer %s is %s: it takes no more parts" % (t.transfer_id,
                                                                                 "committed" if t.committed else t.status))
        numbers = doc.get("part_numbers")
        if not isinstance(numbers, list) or not numbers or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            raise ApiFailure(400, "part_numbers must be a non-empty list of 1-based part numbers")
        if len(numbers) > MAX_PART_URLS:
            raise ApiFailure(400, "at most %d part numbers per request, got %d" % (MAX_PART_URLS, len(numbers)))
        last = MAX_PARTS
        if t.size_bytes is not None:
            last = max(1, -(-t.size_bytes // PART_SIZE))
        bad = sorted(n for n in set(numbers) if not 1 <= n <= last)
        if bad:
            raise ApiFailure(400, "part numbers %s are outside 1..%d (%s)" % (
                bad[:5], last, "size_bytes %d in parts of %d" % (t.size_bytes, PART_SIZE)
                if t.size_bytes is not None else "the most parts a transfer has"))
        urls, expires = [], 0
        for n in sorted(set(numbers)):
            url, expires = self._presign(request, "PUT", "%s/%s/parts/%d" % (SPACES_PREFIX, t.transfer_id, n))
            urls.append({"part_number": n, "upload_url": url})
        return web.json_response({"transfer_id": t.transfer_id, "part_urls": urls, "expires_at": _iso(expires)})

    # -- POST .../transfers/{id}/commit ---------------------------------------------------
    async def commit(self, request):
        rec, t = self._get(request)
        doc = await read_document(request, COMMIT_KEYS, "transfer commit")
        if t.direction != "upload":
            raise ApiFailure(400, "commit is for upload transfers only")
        if t.committed or t.status != PENDING:
            raise ApiFailure(409, "transfer %s was already %s" % (t.transfer_id, "committed" if t.committed else t.status))
        sha = _sha256_field(doc.get("sha256"), "sha256")
        if sha and t.sha256 and sha != t.sha256:
            raise ApiFailure(400, "sha256 %s does not match the %s given at create" % (sha, t.sha256))
        t.sha256 = t.sha256 or sha
        count = len(t.parts)
        if not count:
            raise ApiFailure(400, "no part was uploaded: PUT the parts to their URLs before the commit")
        missing = [n for n in range(1, count + 1) if n not in t.parts]
        if missing:
            raise ApiFailure(400, "parts %s are missing: parts must be numbered 1..N without gaps" % missing[:5])
        short = [n for n in range(1, count) if t.parts[n] != PART_SIZE]
        if short:
            raise ApiFailure(400, "part %d is %d bytes: every part but the last must be %d bytes (part_size)"
                             % (short[0], t.parts[short[0]], PART_SIZE))
        total = sum(t.parts.values())
        if t.size_bytes is not None and total != t.size_bytes:
            raise ApiFailure(400, "the parts hold %d bytes, size_bytes said %d" % (total, t.size_bytes))
        t.committed = True
        guest = await self.sessions.usable_guest(rec, "upload")
        t.task = asyncio.ensure_future(self._import(t, guest, count))
        return web.json_response({"transfer_id": t.transfer_id, "status": t.status, "size_bytes": total}, status=202)

    async def _import(self, t: Transfer, guest, count: int) -> None:
        """Stream the parts into the guest through the agent's Upload, which writes nothing on a checksum mismatch."""
        self._busy(t.session_id, 1)
        t.status = IN_PROGRESS
        digest = hashlib.sha256()

        async def requests():
            yield pb2.UploadRequest(header=pb2.UploadHeader(path=t.path, is_archive=t.archive))
            for n in range(1, count + 1):
                with open(t.part_path(n), "rb") as f:
                    for chunk in iter(lambda f=f: f.read(contract.TRANSFER_CHUNK), b""):
                        digest.update(chunk)
                        t.bytes_written += len(chunk)
                        yield pb2.UploadRequest(chunk=chunk)
            # the declared checksum when there is one, else our own, so torn parts never land
            yield pb2.UploadRequest(end=pb2.UploadEnd(sha256=t.sha256 or digest.hexdigest()))

        try:
            async with agentrpc.agent_stub(guest) as stub:
                resp = await stub.Upload(requests(), timeout=3600)
            t.bytes_written, t.sha256 = resp.bytes_written, digest.hexdigest()
            self._finish(t, COMPLETED)
        except grpc.aio.AioRpcError as e:
            if t.sha256 and t.sha256 != digest.hexdigest():
                self._finish(t, FAILED, "sha256 mismatch: the parts hash to %s, the transfer declared %s; nothing "
                                        "was written" % (digest.hexdigest(), t.sha256))
            else:
                self._finish(t, FAILED, "the import failed: %s" % (e.details() or e.code().name))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("staged upload %s failed", t.transfer_id)
            self._finish(t, FAILED, "the import failed: %s" % type(e).__name__)
        finally:
            self._busy(t.session_id, -1)

    # -- GET .../transfers/{id} -----------------------------------------------------------
    async def get(self, request):
        _rec, t = self._get(request)
        url, expires = "", None
        if t.direction == "download" and t.status == COMPLETED:
            # "a freshly minted presigned GET download_url (its TTL starts at poll time)"
            url, ts = self._presign(request, "GET", "%s/%s/object" % (SPACES_PREFIX, t.transfer_id))
            expires = _iso(ts)
        return web.json_response({"transfer_id": t.transfer_id, "direction": t.direction, "status": t.status,
                                  "bytes_written": t.bytes_written, "sha256": t.sha256 if t.status == COMPLETED else "",
                                  "download_url": url, "expires_at": expires, "error_message": t.error_message})

    # -- POST .../transfers/{id}/cancel ---------------------------------------------------
    async def cancel(self, request):
        _rec, t = self._get(request)
        doc = await read_document(request, CANCEL_KEYS, "transfer cancel")
        reason = doc.get("reason") or ""
        if not isinstance(reason, str):
            raise ApiFailure(400, "reason must be text, got %r" % (reason,))
        if t.status in (COMPLETED, FAILED):
            return web.json_response({"transfer_id": t.transfer_id, "aborted": False, "status": t.status})
        if t.task is not None:
            t.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t.task
        self._finish(t, FAILED, "cancelled%s" % (": " + reason[:200] if reason else ""))
        return web.json_response({"transfer_id": t.transfer_id, "aborted": True, "status": t.status})

    # -- the object store -----------------------------------------------------------------
    def _object_transfer(self, request, method: str) -> Transfer:
        if "Authorization" in request.headers:
            # as object storage answers a presigned URL sent with a second credential; and no token leaves the API
            raise ApiFailure(400, "only one auth mechanism is allowed: a presigned URL takes no Authorization header")
        try:
            expires = int(request.query.get("expires", ""))
        except ValueError as e:
            raise ApiFailure(403, "the URL is not presigned (no expires)") from e
        given = request.query.get("signature", "")
        if not hmac.compare_digest(given.encode("utf-8", "replace"), self._sign(method, request.path, expires).encode()):
            raise ApiFailure(403, "signature does not match")
        if expires < time.time():
            raise ApiFailure(403, "request has expired: ask the API for a fresh URL")
        t = self.transfers.get(request.match_info["tid"])
        if t is None:
            raise ApiFailure(404, "no such object")
        return t

    async def put_part(self, request):
        t = self._object_transfer(request, "PUT")
        number = int(request.match_info["n"])
        if t.committed or t.status != PENDING:
            state = "committed" if t.committed else t.status
            raise ApiFailure(409, "transfer %s takes no more parts (%s)" % (t.transfer_id, state))
        length = request.content_length
        if length is None:
            raise ApiFailure(411, "a part needs its Content-Length")
        if length > PART_SIZE:
            raise ApiFailure(413, "part %d is %d bytes: a part is at most %d bytes (part_size)" % (number, length, PART_SIZE))
        tmp = t.part_path(number) + ".%s.tmp" % uuid.uuid4().hex[:8]
        size = 0
        try:
            with open(tmp, "wb") as f:
                while True:
                    chunk = await request.content.read(contract.TRANSFER_CHUNK)
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > length:
                        raise ApiFailure(400, "part %d is longer than its Content-Length" % number)
                    f.write(chunk)
            if size != length:
                raise ApiFailure(400, "part %d ended after %d of its %d bytes" % (number, size, length))
            if t.committed or t.status != PENDING:
                raise ApiFailure(409, "transfer %s was committed or cancelled while part %d arrived" % (t.transfer_id, number))
            os.replace(tmp, t.part_path(number))
            tmp = None
            t.parts[number] = size
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return web.Response(status=200)

    async def get_object(self, request):
        t = self._object_transfer(request, "GET")
        if t.direction != "download" or t.status != COMPLETED or not os.path.exists(t.object_path):
            raise ApiFailure(404, "no such object")
        return web.FileResponse(t.object_path, headers={"Content-Type": "application/octet-stream"})


def add_routes(app, transfers: StagedTransfers, session_base: str) -> list:
    """The API routes (under each prefix) and the object store's; returns the API table for the caller."""
    t = "%s/workspace/transfers" % session_base
    table = [
        ("POST", t, transfers.create),
        ("GET", t + "/{tid}", transfers.get),
        ("POST", t + "/{tid}/part-upload-urls", transfers.part_urls),
        ("POST", t + "/{tid}/commit", transfers.commit),
        ("POST", t + "/{tid}/cancel", transfers.cancel),
    ]
    app.router.add_route("PUT", SPACES_PREFIX + "/{tid}/parts/{n:[0-9]{1,5}}", transfers.put_part, name=SPACES_ROUTES[0])
    app.router.add_route("GET", SPACES_PREFIX + "/{tid}/object", transfers.get_object, name=SPACES_ROUTES[1])
    return table
