# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Files on the api road: the documented workspace upload and download, and past their bounds the staged transfers.

Upload with X-Content-Sha256; download verified against its DOWSSHA1 footer and renamed into place; both only
inside /workspace (the mux stages the rest, as on the agent road). Past the streaming calls' bounds (500 MiB up,
50 MiB down) the documented staged transfers carry the file: parts PUT to presigned object-storage URLs (never
with the API token), or the object fetched from its presigned URL, bounded by the size the transfer reports and
verified against its sha256 before it is renamed into place.

The bytes move with as few copies as the protocol allows. Up: the sha256 must be in X-Content-Sha256, a header
that precedes the body, so the file is read twice: once to hash it, through one reused buffer (readinto), and
once by the kernel as it sends the body (sendfile; over TLS from the same buffer), parts alike. Down: each read
lands in one reused buffer (readinto) and goes to the hash and the file from there as memoryview slices; the
streaming download's footer is kept aside by a rolling 73-byte tail, so the payload is never re-sliced. Every
answer is bounded: a body the platform announces (Content-Length) or sends past the bound is refused naming it.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import posixpath
import time
from typing import BinaryIO, Callable

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_http import (
    COPY_CHUNK, TRANSFER_STALL, FileBody, Http, error_text)
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

log = logging.getLogger("microvm.mux")

MAX_UPLOAD = 500 * 1024 * 1024        # the streaming upload's cap (create_session_workspace_upload)
STREAM_DOWNLOAD_MAX = 50 * 1024 * 1024  # the streaming download's bound: "> ~50 MiB" is staged (TRANSFERS)
STAGED_MAX = 50 * 1024 ** 3           # "Maximum size 50 GiB" (doctl harness-runtime upload / download)
PART_URL_BATCH = 16                   # part URLs asked for at a time (they share one expiry)
STAGED_DEADLINE = 3600.0              # how long a staged transfer may stay pending or in progress
FOOTER_MAGIC = b"DOWSSHA1"
FOOTER_BYTES = 73                     # magic + 64 hex + "\n" (get_session_workspace_download)
ANSWER_LIMIT = 64 * 1024              # the most of an upload's JSON answer, or of an error body, that is read


class Transfers:
    """Upload and download for one session; `remote_size(path)` is the guest's word on a file's size (or None)."""

    def __init__(self, http: Http, label: str, scratch_dir: str, remote_size: Callable[[str], int | None]) -> None:
        self.http = http
        self.label = label
        self.scratch_dir = scratch_dir
        self.remote_size = remote_size

    def _transfer_error(self, e: errors.HttpRefused, path: str, verb: str) -> errors.SandboxError:
        where = "%s on session %s" % (path, self.label)
        if e.status == 403:
            return errors.Denied("the data plane refused to %s %s: %s" % (verb, where, e))
        if e.status == 404:
            return errors.NotFound("cannot %s %s: no such file (%s)" % (verb, where, e))
        if e.status == 400 and "sha" in str(e).lower():
            return errors.ChecksumMismatch("the %s of %s failed its checksum: %s; nothing was written" % (verb, where, e))
        if e.status >= 500:
            return errors.GuestUnavailable("cannot %s %s: %s" % (verb, where, e))
        return errors.SandboxError("cannot %s %s: %s" % (verb, where, e))

    def upload(self, local_path: str, remote_path: str, mode: int = 0, chunk_size: int = COPY_CHUNK, is_archive: bool = False) -> int:
        """Stream a local file to a guest path under the transfer root (X-Content-Sha256); returns bytes written."""
        what = "archive destination" if is_archive else "upload destination"
        with errors.path_rules():
            remote_path = profile.check_transfer_path(remote_path, self.scratch_dir, what=what)
        size = os.path.getsize(local_path)
        if size > STAGED_MAX:
            raise errors.SandboxError("%s is %d bytes: the platform's transfers carry at most %d bytes (50 GiB)"
                                      % (local_path, size, STAGED_MAX))
        verb = "extract an archive into" if is_archive else "upload to"
        buf = bytearray(COPY_CHUNK)  # the one buffer this upload reads into (hash pass; TLS send)
        with open(local_path, "rb", buffering=0) as f:
            sha = file_sha256(f, size, buf, local_path)
            if size > MAX_UPLOAD:
                return self._staged_upload(f, buf, remote_path, size, sha, is_archive, verb)
            query = {"path": remote_path, "is_archive": "true" if is_archive else "false"}
            try:
                conn, resp = self.http.send("POST", "/workspace/upload", FileBody(f, 0, size, buf), {
                    "Content-Type": "application/octet-stream", "Content-Length": str(size),
                    "X-Content-Sha256": sha}, query=query, stall=TRANSFER_STALL)
            except errors.HttpRefused as e:
                raise self._transfer_error(e, remote_path, verb) from e
            except (OSError, http.client.HTTPException) as e:
                raise errors.GuestUnavailable("lost the connection to session %s while trying to %s %s: %s"
                                              % (self.label, verb, remote_path, e)) from e
        try:
            doc = json.loads(resp.read(ANSWER_LIMIT).decode("utf-8") or "{}")
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise errors.GuestUnavailable("the upload of %s to session %s got no answer: %s" % (remote_path, self.label, e)) from e
        finally:
            conn.close()
        written = doc.get("bytes_written", size) if isinstance(doc, dict) else size
        return written if isinstance(written, int) and not isinstance(written, bool) else size

    def download(self, remote_path: str, local_path: str, chunk_size: int = COPY_CHUNK) -> int:
        """Fetch a guest file to local_path, verified, then renamed into place; a file past the streaming bound is staged."""
        with errors.path_rules():
            remote_path = profile.check_transfer_path(remote_path, self.scratch_dir, what="download source")
        size = self.remote_size(remote_path)
        if size is not None and size > STREAM_DOWNLOAD_MAX:
            return self._staged_download(remote_path, local_path, size)
        return self._direct_download(remote_path, local_path, chunk_size, size)

    def _direct_download(self, remote_path: str, local_path: str, chunk_size: int = COPY_CHUNK,
                         known_size: int | None = None) -> int:
        """The streaming download, at most STREAM_DOWNLOAD_MAX bytes of payload (refused before asking past it)."""
        if known_size is not None and known_size > STREAM_DOWNLOAD_MAX:
            raise errors.SandboxError("%s on session %s is %d bytes: the streaming download carries at most %d bytes "
                                      "(larger files need a staged transfer); nothing was asked of the platform"
                                      % (remote_path, self.label, known_size, STREAM_DOWNLOAD_MAX))
        try:
            conn, resp = self.http.send("GET", "/workspace/download", query={"path": remote_path, "as_archive": "false"},
                                        stall=TRANSFER_STALL)
        except errors.HttpRefused as e:
            raise self._transfer_error(e, remote_path, "download") from e
        except (OSError, http.client.HTTPException) as e:
            raise errors.GuestUnavailable("cannot download %s from session %s: %s" % (remote_path, self.label, e)) from e
        limit = STREAM_DOWNLOAD_MAX + FOOTER_BYTES

        def past_bound(what: str) -> errors.SandboxError:
            return errors.SandboxError("the download of %s from session %s %s the streaming bound of %d bytes (the file "
                                       "grew, or the guest misreported its size); nothing was written to %s"
                                       % (remote_path, self.label, what, STREAM_DOWNLOAD_MAX, local_path))

        def fill(f: BinaryIO) -> int:
            if resp.length is not None and resp.length > limit:  # announced (Content-Length) past the bound
                raise past_bound("was announced as %d bytes with its footer, past" % resp.length)
            digest, sizes = hashlib.sha256(), [0]

            def payload(data: memoryview | bytes) -> None:
                sizes[0] += len(data)
                if sizes[0] > STREAM_DOWNLOAD_MAX:
                    raise past_bound("passed")
                digest.update(data)
                f.write(data)

            split = FooterSplit(payload)
            try:
                pump(resp, limit + 1, split.feed, bytearray(min(chunk_size, COPY_CHUNK) or COPY_CHUNK))
            except (OSError, http.client.HTTPException) as e:
                raise errors.GuestUnavailable("the download of %s from session %s was cut: %s; nothing was written "
                                              "to %s" % (remote_path, self.label, e, local_path)) from e
            sha = split.footer_sha()
            if sha is None:
                raise errors.GuestUnavailable("the download of %s from session %s ended without its integrity footer: the "
                                              "transfer was cut; nothing was written to %s" % (remote_path, self.label, local_path))
            if sha != digest.hexdigest():
                raise errors.ChecksumMismatch("the download of %s from session %s failed its sha256 check; nothing was "
                                              "written to %s" % (remote_path, self.label, local_path))
            return sizes[0]

        try:
            return ac.land_download(local_path, fill)
        finally:
            conn.close()

    # -- staged transfers (object storage) --------------------------------------------------
    def _transfer(self, method: str, tail: str = "", doc: dict | None = None) -> dict:
        return self.http.json_call(method, "/workspace/transfers" + tail, None if method == "GET" else (doc or {}))

    def _cancel(self, tid: str, reason: str) -> None:
        try:
            self._transfer("POST", "/%s/cancel" % tid, {"reason": reason})
        except (errors.SandboxError, OSError, http.client.HTTPException, ValueError) as e:
            log.warning("session %s: could not cancel transfer %s: %s", self.label, tid, e)

    def _await_transfer(self, tid: str, remote_path: str, verb: str) -> dict:
        """Poll a transfer until it is completed; a failed one raises naming its error_message."""
        deadline, pause = time.monotonic() + STAGED_DEADLINE, 0.05
        while True:
            doc = self._transfer("GET", "/" + tid)
            status = doc.get("status")
            if status == "completed":
                return doc
            if status == "failed":
                message = str(doc.get("error_message") or "no reason given")[:500]
                cls = errors.ChecksumMismatch if "sha256" in message.lower() else errors.SandboxError
                raise cls("the staged transfer to %s %s on session %s failed: %s" % (verb, remote_path, self.label, message))
            if status not in ("pending", "in_progress"):
                raise errors.SandboxError("staged transfer %s answered status %r" % (tid, status))
            if time.monotonic() > deadline:
                self._cancel(tid, "the client gave up waiting")
                raise errors.SandboxError("the staged transfer to %s %s on session %s was still %s after %d s"
                                          % (verb, remote_path, self.label, status, STAGED_DEADLINE))
            time.sleep(pause)
            pause = min(pause * 2, 2.0)

    def _part_urls(self, tid: str, numbers: list) -> dict:
        doc = self._transfer("POST", "/%s/part-upload-urls" % tid, {"part_numbers": numbers})
        urls = {}
        for item in doc.get("part_urls") or ():
            if isinstance(item, dict) and item.get("part_number") in numbers and item.get("upload_url"):
                urls[item["part_number"]] = str(item["upload_url"])
        missing = [n for n in numbers if n not in urls]
        if missing:
            raise errors.SandboxError("the data plane gave no upload URL for parts %s of transfer %s" % (missing[:5], tid))
        return urls

    def _staged_upload(self, f: BinaryIO, buf: bytearray, remote_path: str, size: int, sha: str, is_archive: bool,
                       verb: str) -> int:
        """Create an upload transfer, PUT its parts to their presigned URLs, commit with the sha256, wait for it."""
        body = {"direction": "upload", "path": posixpath.relpath(remote_path, profile.TRANSFER_ROOT),
                "size_bytes": size, "sha256": sha}
        if is_archive:
            body["is_archive"] = True
        try:
            created = self._transfer("POST", "", body)
        except errors.HttpRefused as e:
            raise self._transfer_error(e, remote_path, verb) from e
        tid, part_size = str(created.get("transfer_id") or ""), created.get("part_size")
        if not tid or "/" in tid or not isinstance(part_size, int) or isinstance(part_size, bool) or part_size <= 0:
            raise errors.SandboxError("the data plane answered a staged upload with %r" % (created,))
        count = -(-size // part_size)
        done = False
        try:
            for first in range(1, count + 1, PART_URL_BATCH):
                batch = list(range(first, min(count, first + PART_URL_BATCH - 1) + 1))
                urls = self._part_urls(tid, batch)
                for n in batch:
                    offset = (n - 1) * part_size
                    part = FileBody(f, offset, min(part_size, size - offset), buf)
                    for attempt in (1, 2):
                        conn, resp = self.http.presigned("PUT", urls[n], part)
                        try:
                            text = error_text(resp.read(ANSWER_LIMIT))
                        finally:
                            conn.close()
                        if resp.status < 300:
                            break
                        if resp.status == 403 and attempt == 1:  # "If URLs expire before the PUT, request them again"
                            urls.update(self._part_urls(tid, [m for m in batch if m >= n]))
                            continue
                        raise errors.SandboxError("object storage refused part %d of %d of the staged upload to %s: "
                                                  "HTTP %d: %s" % (n, count, remote_path, resp.status, text))
            self._transfer("POST", "/%s/commit" % tid, {"sha256": sha})
            doc = self._await_transfer(tid, remote_path, verb)
            done = True
        except errors.HttpRefused as e:
            raise self._transfer_error(e, remote_path, verb) from e
        except (OSError, http.client.HTTPException) as e:
            raise errors.GuestUnavailable("lost the connection during the staged upload to %s on session %s: %s"
                                          % (remote_path, self.label, e)) from e
        finally:
            if not done:
                self._cancel(tid, "the client gave up")
        return int(doc.get("bytes_written") or size)

    def _staged_download(self, remote_path: str, local_path: str, size_hint: int) -> int:
        """Create a download transfer, wait for it, fetch its object: bounded by the size it reports, verified."""
        try:
            created = self._transfer("POST", "", {"direction": "download",
                                                  "path": posixpath.relpath(remote_path, profile.TRANSFER_ROOT)})
        except errors.HttpRefused as e:
            if e.status in (404, 405, 501) and "route" in str(e):
                raise errors.SandboxError("%s on session %s is %d bytes, past the %d bytes the streaming download carries, "
                                          "and the platform has no staged transfers (%s): use transport agent"
                                          % (remote_path, self.label, size_hint, STREAM_DOWNLOAD_MAX, e)) from e
            raise self._transfer_error(e, remote_path, "download") from e
        tid = str(created.get("transfer_id") or "")
        if not tid or "/" in tid:
            raise errors.SandboxError("the data plane answered a staged download with %r" % (created,))
        try:
            doc = self._await_transfer(tid, remote_path, "download")
            sha, declared = doc.get("sha256"), doc.get("bytes_written")
            if not isinstance(sha, str) or len(sha) != 64 or set(sha) - set("0123456789abcdef"):
                raise errors.ChecksumMismatch("the staged download of %s from session %s reported no usable sha256 (%r); "
                                              "nothing was written to %s" % (remote_path, self.label, str(sha)[:80], local_path))
            if not isinstance(declared, int) or isinstance(declared, bool) or not 0 <= declared <= STAGED_MAX:
                raise errors.SandboxError("the staged download of %s from session %s reported a size of %r bytes (at most "
                                          "%d); nothing was written to %s" % (remote_path, self.label, declared, STAGED_MAX,
                                                                              local_path))
            for attempt in (1, 2):
                conn, resp = self.http.presigned("GET", doc.get("download_url") or "")
                if resp.status == 403 and attempt == 1:  # expired: "freshly minted" at each poll
                    conn.close()
                    doc = self._await_transfer(tid, remote_path, "download")
                    continue
                break
        except errors.HttpRefused as e:
            self._cancel(tid, "the client gave up")
            raise self._transfer_error(e, remote_path, "download") from e
        except (OSError, http.client.HTTPException) as e:
            self._cancel(tid, "the client gave up")
            raise errors.GuestUnavailable("cannot fetch the staged download of %s from session %s: %s"
                                          % (remote_path, self.label, e)) from e

        def fill(f: BinaryIO) -> int:
            if resp.status >= 300:
                raise errors.SandboxError("object storage refused the staged download of %s: HTTP %d: %s"
                                          % (remote_path, resp.status, error_text(resp.read(ANSWER_LIMIT))))
            if resp.length is not None and resp.length != declared:  # http.client's reading of Content-Length
                raise errors.SandboxError("the staged download of %s from session %s is %d bytes, the transfer reported %d; "
                                          "nothing was written to %s" % (remote_path, self.label, resp.length, declared, local_path))
            digest = hashlib.sha256()

            def payload(data: memoryview) -> None:
                digest.update(data)
                f.write(data)

            try:
                got = pump(resp, declared + 1, payload, bytearray(COPY_CHUNK))  # one byte past the size tells a longer body
            except (OSError, http.client.HTTPException) as e:
                raise errors.GuestUnavailable("the staged download of %s from session %s was cut: %s; nothing was "
                                              "written to %s" % (remote_path, self.label, e, local_path)) from e
            if got > declared:
                raise errors.SandboxError("the staged download of %s from session %s sent more than the %d bytes "
                                          "the transfer reported; nothing was written to %s"
                                          % (remote_path, self.label, declared, local_path))
            if got != declared:
                raise errors.GuestUnavailable("the staged download of %s from session %s ended after %d of %d bytes; "
                                              "nothing was written to %s" % (remote_path, self.label, got, declared, local_path))
            if digest.hexdigest() != sha:
                raise errors.ChecksumMismatch("the staged download of %s from session %s failed its sha256 check; nothing "
                                              "was written to %s" % (remote_path, self.label, local_path))
            return got

        try:
            return ac.land_download(local_path, fill)
        finally:
            conn.close()


def file_sha256(f: BinaryIO, size: int, buf: bytearray, name: str) -> str:
    """The sha256 of an open file's `size` bytes, read into `buf` (reused); a file of another size raises (it changed)."""
    digest, view, got = hashlib.sha256(), memoryview(buf), 0
    f.seek(0)
    while True:
        n = f.readinto(view)  # type: ignore[attr-defined]
        if not n:
            break
        digest.update(view[:n])
        got += n
    if got != size:
        raise errors.SandboxError("%s changed while it was read (%d bytes, then %d); nothing was sent: run again once "
                                  "it is still" % (name, size, got))
    return digest.hexdigest()


def pump(resp: http.client.HTTPResponse, budget: int, sink: Callable[[memoryview], None], buf: bytearray) -> int:
    """Read an answer's body into `buf` (reused) and hand each read to sink as a view of it, until the body ends or
    `budget` bytes came (the caller sets it one past what it accepts); -> bytes read. sink must not keep the view."""
    view, got = memoryview(buf), 0
    while got < budget:
        n = resp.readinto(view[:min(len(view), budget - got)])
        if not n:
            if resp.length:  # http.client's readinto takes a body cut short of its Content-Length as its end
                raise http.client.IncompleteRead(b"", resp.length)
            break
        got += n
        sink(view[:n])
    return got


class FooterSplit:
    """A download's bytes as they come: all but the last FOOTER_BYTES go to `payload` at once; those are kept in a
    small rolling tail, so no byte of the payload is copied to find the footer."""

    def __init__(self, payload: Callable[[memoryview], None]) -> None:
        self.payload = payload
        self.tail = bytearray()

    def feed(self, data: memoryview) -> None:
        spare = len(self.tail) + len(data) - FOOTER_BYTES  # bytes now known to be payload
        if spare <= 0:
            self.tail += data
            return
        from_tail = min(spare, len(self.tail))
        if from_tail:
            self.payload(memoryview(bytes(self.tail[:from_tail])))  # at most 73 bytes
            del self.tail[:from_tail]
        from_data = spare - from_tail
        if from_data:
            self.payload(data[:from_data])
        self.tail += data[from_data:]

    def footer_sha(self) -> str | None:
        """The footer's sha256 (64 lowercase hex) once the body ended, or None when the tail has no footer's shape."""
        tail = bytes(self.tail)
        if (len(tail) != FOOTER_BYTES or not tail.startswith(FOOTER_MAGIC) or not tail.endswith(b"\n")
                or any(c not in b"0123456789abcdef" for c in tail[8:72])):
            return None
        return tail[8:72].decode()
