# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The second road into a sandbox: the platform's documented exec (Server-Sent Events) and file API.

The mux's SessionLink uses ApiRoadClient in place of the gRPC AgentClient when the connection's
`transport` is `api`, or `auto` and the agent port does not answer; it has the same methods
(exec_stream, iter_exec, exec, upload, download, close), so every op of the mux runs unchanged
on either road. Standard library only (http.client): the mux imports no HTTP package for it.

What the documented API gives, and how the Ansible semantics are kept (docs/platform-contract.md,
"Data plane (exec and files)"; docs/connection.md, "Transports"):

- No per-command env: it is carried by `/usr/bin/env -- NAME=VALUE ... argv`.
- One-shot stdin (base64 in the request, then EOF). A payload too big for one request body is
  uploaded into the scratch dir and redirected into the command. Stdin that arrives while the
  command runs (a become password prompt, microvm.sandbox.sync's stream) needs interactive stdin
  (`keep_stdin_open`), which the platform enables per team: without it such a command fails
  before it starts, naming the team setting.
- The platform clamps every command to 240 s (default 60): a command without a timeout is sent
  with the maximum, and one that runs into it is reported as timed out, naming the limit.
- A command whose event stream is cut, or ends without its exit event, is lost: reported, never
  re-run. A stdin write is retried at the same offset, which the platform trims.
- Transfers: upload with X-Content-Sha256, download verified against its DOWSSHA1 footer and
  renamed into place; both only inside /workspace (the mux stages the rest, as on the agent road).
  Past the streaming calls' bounds (500 MiB up, 50 MiB down) the documented staged transfers carry
  the file: parts PUT to presigned object-storage URLs (never with the API token), or the object
  fetched from its presigned URL, bounded by the size the transfer reports and verified against its
  sha256 before it is renamed into place.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import os
import posixpath
import queue
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
import uuid
from typing import TYPE_CHECKING, Any, BinaryIO, Iterator, NoReturn, Protocol, Sequence

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import USER_AGENT
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import capped
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

if TYPE_CHECKING:
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink

log = logging.getLogger("microvm.mux")

TRANSPORTS = ("agent", "api", "auto")
AUTO_PROBE_SECONDS = 5.0              # auto: how long the agent port may take to answer before the api road is used
EXEC_MAX_TIMEOUT = 240                # "Clamped server-side (default 60, maximum 240)" (post_session_sandbox_exec)
ONE_SHOT_MAX = 512 * 1024             # stdin bytes sent inline; base64 of more would pass a 1 MiB request body
STDIN_WRITE = 768 * 1024              # one interactive stdin write ("at most 1 MiB" each)
MAX_UPLOAD = 500 * 1024 * 1024        # the streaming upload's cap (create_session_workspace_upload)
STREAM_DOWNLOAD_MAX = 50 * 1024 * 1024  # the streaming download's bound: "> ~50 MiB" is staged (TRANSFERS)
STAGED_MAX = 50 * 1024 ** 3           # "Maximum size 50 GiB" (doctl harness-runtime upload / download)
PART_URL_BATCH = 16                   # part URLs asked for at a time (they share one expiry)
STAGED_DEADLINE = 3600.0              # how long a staged transfer may stay pending or in progress
FOOTER_MAGIC = b"DOWSSHA1"
FOOTER_BYTES = 73                     # magic + 64 hex + "\n" (get_session_workspace_download)
READ_TIMEOUT = 120.0                  # the plane sends a keepalive comment every 15 s on a quiet stream
COPY_CHUNK = 1024 * 1024
TEAM_SETTING = "interactive stdin (keep_stdin_open), which the platform enables per team"


def _error_text(body: bytes) -> str:
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return body[:300].decode("utf-8", "replace").strip()
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or "")
    if isinstance(doc, dict) and doc.get("message"):
        return str(doc["message"])
    return body[:300].decode("utf-8", "replace")


def env_argv(argv: Sequence[str], env: dict[str, str] | None) -> list[str]:
    """argv with the per-command environment the documented exec lacks, through env(1)."""
    if not env:
        return list(argv)
    for name in env:
        if not name or "=" in name or "\0" in name:
            raise errors.SandboxError("environment variable name %r cannot be passed to a command" % name)
    return ["/usr/bin/env", "--"] + ["%s=%s" % (k, v) for k, v in sorted(env.items())] + list(argv)


class ApiExec:
    """One command on the event stream: the `call` of exec_stream (cancel() stops it)."""

    def __init__(self, client: ApiRoadClient, argv: list, workdir: str, timeout: int, hold_stdin: bool) -> None:
        self.client = client
        self.argv = argv
        self.workdir = workdir
        self.requested_timeout = timeout
        self.timeout = min(timeout, EXEC_MAX_TIMEOUT) if timeout else EXEC_MAX_TIMEOUT
        self.hold_stdin = hold_stdin
        self.conn: http.client.HTTPConnection | None = None
        self.cancelled = threading.Event()
        self.exec_id = ""

    def cancel(self) -> None:
        self.cancelled.set()
        conn = self.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)  # the plane sees the client go: it stops the command
            except OSError:
                pass


class ApiRoadClient:
    """Exec, upload and download through the documented data plane of one session."""

    channel = None  # no gRPC channel on this road

    def __init__(self, api_url: str, prefix: str, token: str, session_id: str, label: str,
                 scratch_dir: str = profile.SCRATCH_DIR, validate_certs: bool = True, connect_timeout: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(api_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise errors.SandboxError("api_url %r is not an http(s) URL" % api_url)
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.base = parts.path + prefix + "/sessions/" + urllib.parse.quote(session_id, safe="")
        self._token = token
        self.label = label
        self.scratch_dir = scratch_dir
        self.connect_timeout = float(connect_timeout or 60.0)
        self.context = None
        if self.scheme == "https":
            self.context = ssl.create_default_context()
            if not validate_certs:
                self.context.check_hostname = False
                self.context.verify_mode = ssl.CERT_NONE
        self.interactive: bool | None = None  # the team's switch, learnt from the first keep_stdin_open (403 = off)
        self._closed = False

    def __repr__(self) -> str:
        return "ApiRoadClient(%r)" % self.label

    def close(self) -> None:
        self._closed = True

    # -- HTTP -------------------------------------------------------------------------------
    def _connection(self) -> http.client.HTTPConnection:
        if self._closed:
            raise errors.GuestUnavailable("the link to session %s was closed" % self.label)
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.connect_timeout, context=self.context,
                                               blocksize=COPY_CHUNK)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout, blocksize=COPY_CHUNK)

    def _headers(self, extra: dict | None = None) -> dict:
        headers = {"Authorization": "Bearer " + self._token, "User-Agent": USER_AGENT}
        headers.update(extra or {})
        return headers

    def _send(self, method: str, path: str, body: bytes | BinaryIO | None = None, headers: dict | None = None,
              query: dict | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """(connection, response) of one call; an error status raises HttpRefused (the connection is closed)."""
        url = self.base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        conn = self._connection()
        try:
            conn.request(method, url, body=body, headers=self._headers(headers))
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException):
            conn.close()
            raise
        if resp.status >= 300:
            text = _error_text(resp.read(64 * 1024))
            conn.close()
            raise errors.HttpRefused(resp.status, "HTTP %d: %s" % (resp.status, text))
        return conn, resp

    def _json_call(self, method: str, path: str, doc: dict) -> dict:
        conn, resp = self._send(method, path, json.dumps(doc).encode(), {"Content-Type": "application/json"})
        try:
            return json.loads(resp.read().decode("utf-8") or "{}")
        finally:
            conn.close()

    # -- exec -------------------------------------------------------------------------------
    def exec_stream(self, argv: Sequence[str], env: dict[str, str] | None = None, workdir: str = "", timeout: int = 0,
                    stdin: bytes | None = None, deadline: float | None = None,
                    hold_stdin: bool = False) -> tuple[ApiExec, queue.Queue[bytes | None]]:
        """Prepare a command; returns (call, stdin_queue) like AgentClient.exec_stream.

        It starts in iter_exec: with one-shot stdin once the queue's stdin is complete (put(None)),
        with interactive stdin at once.
        """
        call = ApiExec(self, env_argv(argv, env), workdir or "", int(timeout or 0), bool(hold_stdin))
        feed: queue.Queue[bytes | None] = queue.Queue()
        if stdin is not None:
            if stdin:
                feed.put(bytes(stdin))
            feed.put(None)
        if hold_stdin and self.interactive is False:
            raise errors.SandboxError(self._needs_interactive())
        return call, feed

    def _needs_interactive(self) -> str:
        return ("session %s: this command needs stdin while it runs (a become password prompt, or "
                "microvm.sandbox.sync's stream), which the api transport carries only with %s; it is not enabled "
                "for this team (the platform answered 403). Enable it for the team, use transport agent, or "
                "become without a password (NOPASSWD). Nothing was run." % (self.label, TEAM_SETTING))

    def iter_exec(self, call: ApiExec, feed: queue.Queue[bytes | None] | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ('stdout'|'stderr', bytes) and finally ('exit', ExecResult); raise CommandLost otherwise."""
        feed = feed if feed is not None else queue.Queue()
        staged, finished = None, False
        try:
            if call.hold_stdin:
                resp = self._start(call, b"", keep_open=True)
                writer = threading.Thread(target=self._write_stdin, args=(call, feed), name="api-stdin", daemon=True)
                writer.start()
            else:
                stdin = self._collect(feed)
                if call.cancelled.is_set():  # the worker went away before its stdin was complete: never start it
                    raise errors.CommandLost("the command on session %s was cancelled before it started" % self.label)
                if len(stdin) > ONE_SHOT_MAX:
                    staged, call.argv = self._stage_stdin(stdin, call.argv)
                    stdin = b""
                resp = self._start(call, stdin, keep_open=False)
            yield from self._events(call, resp)
            finished = True
        finally:
            if not finished:
                call.cancel()  # a consumer that gave up, or a failure: the command must not run on
            feed.put(None)  # unblock the stdin writer if stdin never ended
            if call.conn is not None:
                call.conn.close()
            if staged:
                try:
                    self.exec(["rm", "-f", "--", staged], deadline=60)
                except errors.SandboxError as e:
                    log.warning("session %s: could not remove staged stdin %s: %s", self.label, staged, e)

    def _collect(self, feed: queue.Queue[bytes | None]) -> bytes:
        parts: list[bytes] = []
        while True:
            item = feed.get()
            if item is None:
                return b"".join(parts)
            parts.append(item)

    def _stage_stdin(self, stdin: bytes, argv: list) -> tuple[str, list]:
        """Upload a stdin too big for one request into the scratch dir; argv reads it from there."""
        path = posixpath.join(self.scratch_dir, ".stdin.%s" % uuid.uuid4().hex)
        fd, local = tempfile.mkstemp(prefix=".microvm-stdin.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(stdin)
            self.exec(["mkdir", "-p", "--", self.scratch_dir], deadline=60)
            self.upload(local, path)
        finally:
            os.unlink(local)
        return path, ["/bin/sh", "-c", 'f=$1; shift; exec "$@" < "$f"', "sh", path] + list(argv)

    def _start(self, call: ApiExec, stdin: bytes, keep_open: bool) -> http.client.HTTPResponse:
        body = {"argv": call.argv, "timeout_seconds": call.timeout}
        if call.workdir:
            body["workdir"] = call.workdir
        if stdin:
            body["stdin"] = base64.b64encode(stdin).decode()
        if keep_open:
            body["keep_stdin_open"] = True
        try:
            conn, resp = self._send("POST", "/sandbox/exec", json.dumps(body).encode(),
                                    {"Content-Type": "application/json", "Accept": "text/event-stream"})
        except errors.HttpRefused as e:
            if keep_open and e.status == 403:
                self.interactive = False
                raise errors.SandboxError(self._needs_interactive()) from e
            if e.status in (404, 410):
                raise errors.CommandLost("session %s cannot run the command: %s" % (self.label, e)) from e
            if e.status >= 500 or e.status == 409:
                raise errors.GuestUnavailable("session %s did not take the command: %s; nothing was run" % (self.label, e)) from e
            raise errors.SandboxError("the data plane refused the command on session %s: %s" % (self.label, e)) from e
        except ConnectionRefusedError as e:
            raise errors.GuestUnavailable("cannot reach the API for session %s: %s; nothing was run" % (self.label, e)) from e
        except (OSError, http.client.HTTPException) as e:
            raise errors.CommandLost("lost the command on session %s before its answer: %s; it may have partly run "
                                     "and is not re-run" % (self.label, e)) from e
        if keep_open:
            self.interactive = True
        call.conn = conn
        if conn.sock is not None:
            conn.sock.settimeout(READ_TIMEOUT)
        return resp

    def _events(self, call: ApiExec, resp: http.client.HTTPResponse) -> Iterator[tuple[str, Any]]:
        lost = "its event stream ended without an exit event"
        try:
            for event, data in _read_events(resp):
                if event == "started":
                    call.exec_id = str(data.get("exec_id") or "")
                elif event in ("stdout", "stderr"):
                    yield event, base64.b64decode(data.get("data") or "")
                elif event == "exit":
                    result = ac.ExecResult(int(data.get("exit_code", -1)), bool(data.get("timed_out")),
                                           int(data.get("duration_ms") or 0))
                    if result.timed_out and not call.requested_timeout:
                        log.warning("session %s: a command ran into the platform's %d s exec limit", self.label,
                                    EXEC_MAX_TIMEOUT)
                    yield "exit", result
                    return
                elif event == "error":
                    lost = str(data.get("message") or "the data plane reported an error")
                    break
        except (OSError, http.client.HTTPException, ValueError) as e:
            lost = "%s: %s" % ("cancelled" if call.cancelled.is_set() else "the event stream was cut", e)
        raise errors.CommandLost("lost the command on session %s: %s; it may have partly run and is not re-run"
                                 % (self.label, lost))

    def _write_stdin(self, call: ApiExec, feed: queue.Queue[bytes | None]) -> None:
        """Forward the queue's stdin as offset-keyed writes; a failed write is retried once at its offset."""
        offset = 0
        while not call.exec_id and not call.cancelled.is_set():
            call.cancelled.wait(0.01)  # the exec id comes with the started event
        while not call.cancelled.is_set():
            item = feed.get()
            eof = item is None
            data = b"" if item is None else bytes(item)
            for i in range(0, max(len(data), 1), STDIN_WRITE):
                piece = data[i:i + STDIN_WRITE]
                last = eof or i + STDIN_WRITE >= len(data)
                doc: dict[str, int | str | bool] = {"offset": offset}
                if piece:
                    doc["data"] = base64.b64encode(piece).decode()
                if eof and last:
                    doc["eof"] = True
                if len(doc) == 1:
                    continue
                for attempt in (1, 2):
                    try:
                        offset = int(self._json_call("POST", "/sandbox/exec/%s/stdin" % call.exec_id, doc)
                                     .get("offset", offset + len(piece)))
                        break
                    except errors.HttpRefused as e:
                        log.info("session %s: stdin write refused (%s): the command has ended", self.label, e)
                        return
                    except (OSError, http.client.HTTPException) as e:
                        if attempt == 2:
                            log.warning("session %s: stdin write failed twice: %s; stopping the command", self.label, e)
                            call.cancel()
                            return
            if eof:
                return

    def exec(self, argv: Sequence[str], env: dict[str, str] | None = None, workdir: str = "", timeout: int = 0, stdin: bytes = b"",
             deadline: float | None = None) -> ac.ExecResult:
        """Run a command to completion (the mux's own helpers): at most capped.HELPER_OUTPUT_LIMIT of stdout and stderr."""
        call, feed = self.exec_stream(argv, env=env, workdir=workdir, timeout=timeout, stdin=stdin or b"")
        return capped.collect_exec(self.iter_exec(call, feed))

    # -- files ------------------------------------------------------------------------------
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
        digest = hashlib.sha256()
        with open(local_path, "rb") as f:
            for chunk in iter(lambda: f.read(COPY_CHUNK), b""):
                digest.update(chunk)
        verb = "extract an archive into" if is_archive else "upload to"
        if size > MAX_UPLOAD:
            return self._staged_upload(local_path, remote_path, size, digest.hexdigest(), is_archive, verb)
        query = {"path": remote_path, "is_archive": "true" if is_archive else "false"}
        with open(local_path, "rb") as f:
            try:
                conn, resp = self._send("POST", "/workspace/upload", f, {
                    "Content-Type": "application/octet-stream", "Content-Length": str(size),
                    "X-Content-Sha256": digest.hexdigest()}, query=query)
            except errors.HttpRefused as e:
                raise self._transfer_error(e, remote_path, verb) from e
            except (OSError, http.client.HTTPException) as e:
                raise errors.GuestUnavailable("lost the connection to session %s while trying to %s %s: %s"
                                              % (self.label, verb, remote_path, e)) from e
        try:
            doc = json.loads(resp.read().decode("utf-8") or "{}")
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise errors.GuestUnavailable("the upload of %s to session %s got no answer: %s" % (remote_path, self.label, e)) from e
        finally:
            conn.close()
        return int(doc.get("bytes_written", size))

    def download(self, remote_path: str, local_path: str, chunk_size: int = COPY_CHUNK) -> int:
        """Fetch a guest file to local_path, verified, then renamed into place; a file past the streaming bound is staged."""
        with errors.path_rules():
            remote_path = profile.check_transfer_path(remote_path, self.scratch_dir, what="download source")
        size = self._remote_size(remote_path)
        if size is not None and size > STREAM_DOWNLOAD_MAX:
            return self._staged_download(remote_path, local_path, size)
        return self._direct_download(remote_path, local_path, chunk_size, size)

    def _remote_size(self, remote_path: str) -> int | None:
        """The guest's word on a file's size (it only picks the road: both roads bound and verify what comes)."""
        try:
            res = self.exec(["stat", "-L", "-c", "%s", "--", remote_path], timeout=60)
        except errors.SandboxError:
            return None
        text = res.stdout.strip()
        if res.exit_code != 0 or not text.isdigit() or len(text) > 20:
            return None  # a missing file: the download says so
        return int(text)

    def _direct_download(self, remote_path: str, local_path: str, chunk_size: int = COPY_CHUNK,
                         known_size: int | None = None) -> int:
        """The streaming download, at most STREAM_DOWNLOAD_MAX bytes of payload (refused before asking past it)."""
        if known_size is not None and known_size > STREAM_DOWNLOAD_MAX:
            raise errors.SandboxError("%s on session %s is %d bytes: the streaming download carries at most %d bytes "
                                      "(larger files need a staged transfer); nothing was asked of the platform"
                                      % (remote_path, self.label, known_size, STREAM_DOWNLOAD_MAX))
        try:
            conn, resp = self._send("GET", "/workspace/download", query={"path": remote_path, "as_archive": "false"})
        except errors.HttpRefused as e:
            raise self._transfer_error(e, remote_path, "download") from e
        except (OSError, http.client.HTTPException) as e:
            raise errors.GuestUnavailable("cannot download %s from session %s: %s" % (remote_path, self.label, e)) from e

        def fill(f: BinaryIO) -> int:
            digest, size, tail = hashlib.sha256(), 0, b""
            try:
                while True:
                    chunk = resp.read(chunk_size)
                    if not chunk:
                        break
                    tail += chunk
                    if len(tail) > FOOTER_BYTES:  # everything but the last 73 bytes is payload
                        body, tail = tail[:-FOOTER_BYTES], tail[-FOOTER_BYTES:]
                        size += len(body)
                        if size > STREAM_DOWNLOAD_MAX:
                            raise errors.SandboxError("the download of %s from session %s passed the streaming bound of %d "
                                                      "bytes (the file grew, or the guest misreported its size); nothing "
                                                      "was written to %s" % (remote_path, self.label, STREAM_DOWNLOAD_MAX,
                                                                             local_path))
                        f.write(body)
                        digest.update(body)
            except (OSError, http.client.HTTPException) as e:
                raise errors.GuestUnavailable("the download of %s from session %s was cut: %s; nothing was written "
                                              "to %s" % (remote_path, self.label, e, local_path)) from e
            footer_ok = (len(tail) == FOOTER_BYTES and tail.startswith(FOOTER_MAGIC) and tail.endswith(b"\n")
                         and all(c in b"0123456789abcdef" for c in tail[8:72]))
            if not footer_ok:
                raise errors.GuestUnavailable("the download of %s from session %s ended without its integrity footer: the "
                                              "transfer was cut; nothing was written to %s" % (remote_path, self.label, local_path))
            if tail[8:72].decode() != digest.hexdigest():
                raise errors.ChecksumMismatch("the download of %s from session %s failed its sha256 check; nothing was "
                                              "written to %s" % (remote_path, self.label, local_path))
            return size

        try:
            return ac.land_download(local_path, fill)
        finally:
            conn.close()

    # -- staged transfers (object storage) --------------------------------------------------
    def _transfer(self, method: str, tail: str = "", doc: dict | None = None) -> dict:
        path = "/workspace/transfers" + tail
        if method == "GET":
            conn, resp = self._send("GET", path)
            try:
                answer = json.loads(resp.read(1024 * 1024).decode("utf-8") or "{}")
            finally:
                conn.close()
        else:
            answer = self._json_call(method, path, doc or {})
        if not isinstance(answer, dict):
            raise errors.SandboxError("the data plane answered %s %s with %r, not an object" % (method, path, answer))
        return answer

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

    def _object(self, method: str, url: str, body: "bytes | _Readable | None" = None,
                length: int = 0) -> "tuple[http.client.HTTPConnection, http.client.HTTPResponse]":
        """(connection, response) of a presigned object-storage URL: never the API token, its own credential."""
        parts = urllib.parse.urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise errors.SandboxError("the data plane gave a presigned URL that is not http(s): %r" % str(url)[:200])
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            context = self.context or ssl.create_default_context()
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=READ_TIMEOUT, context=context,
                                               blocksize=COPY_CHUNK)
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=READ_TIMEOUT, blocksize=COPY_CHUNK)
        headers = {"User-Agent": USER_AGENT}
        if body is not None:
            headers.update({"Content-Length": str(length), "Content-Type": "application/octet-stream"})
        try:
            conn.request(method, parts.path + ("?" + parts.query if parts.query else ""), body=body, headers=headers)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

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

    def _staged_upload(self, local_path: str, remote_path: str, size: int, sha: str, is_archive: bool, verb: str) -> int:
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
            with open(local_path, "rb") as f:
                for first in range(1, count + 1, PART_URL_BATCH):
                    batch = list(range(first, min(count, first + PART_URL_BATCH - 1) + 1))
                    urls = self._part_urls(tid, batch)
                    for n in batch:
                        offset = (n - 1) * part_size
                        length = min(part_size, size - offset)
                        for attempt in (1, 2):
                            f.seek(offset)
                            conn, resp = self._object("PUT", urls[n], _Slice(f, length), length)
                            try:
                                text = _error_text(resp.read(64 * 1024))
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
                conn, resp = self._object("GET", doc.get("download_url") or "")
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
                                          % (remote_path, resp.status, _error_text(resp.read(64 * 1024))))
            length = resp.getheader("Content-Length")
            if length is not None and length.strip() != str(declared):
                raise errors.SandboxError("the staged download of %s from session %s is %s bytes, the transfer reported %d; "
                                          "nothing was written to %s" % (remote_path, self.label, length[:30], declared, local_path))
            digest, got = hashlib.sha256(), 0
            try:
                while True:
                    chunk = resp.read(min(COPY_CHUNK, declared + 1 - got))  # one byte past the size tells a longer body
                    if not chunk:
                        break
                    got += len(chunk)
                    if got > declared:
                        raise errors.SandboxError("the staged download of %s from session %s sent more than the %d bytes "
                                                  "the transfer reported; nothing was written to %s"
                                                  % (remote_path, self.label, declared, local_path))
                    digest.update(chunk)
                    f.write(chunk)
            except (OSError, http.client.HTTPException) as e:
                raise errors.GuestUnavailable("the staged download of %s from session %s was cut: %s; nothing was "
                                              "written to %s" % (remote_path, self.label, e, local_path)) from e
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


class _Readable(Protocol):
    """A request body http.client reads in blocks: an open file, or a _Slice of one."""

    def read(self, n: int = -1, /) -> bytes: ...


class _Slice:
    """`length` bytes of an open file from its current position, as a body http.client reads in blocks."""

    def __init__(self, f: BinaryIO, length: int) -> None:
        self.f, self.left = f, length

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.f.read(n) if n else b""
        self.left -= len(data)
        return data


def _read_events(resp: http.client.HTTPResponse) -> Iterator[tuple[str, Any]]:
    """(event, data) pairs of a Server-Sent Events body; comments (keepalives) are skipped."""
    event: str | None = None
    data: list[str] = []
    while True:
        raw = resp.readline(8 * 1024 * 1024)
        if not raw:
            return
        line = raw.rstrip(b"\r\n").decode("utf-8")
        if not line:
            if event is not None or data:
                yield event or "message", json.loads("\n".join(data) or "{}")
            event, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


class NoWarm:
    """The api road has no warm module runner (it needs a long-lived stdin): the worker runs modules cold."""

    def get(self, interpreter: str, core: str = "") -> NoReturn:
        raise errors.WarmRefused("the api transport has no warm runner")

    def any_alive(self) -> NoReturn:
        """No runner to do a task's tmp dir commands either: the worker runs them in a shell."""
        self.get("")

    def stop(self) -> None:
        pass


def attach(link: SessionLink) -> None:
    """Give a SessionLink (_mux/session_link.py) the api road: its client and no warm runner."""
    cfg = link.cfg
    link.road = "api"
    link.client = ApiRoadClient(cfg.api_url, cfg.prefix, cfg.token, link.resolved_id, link.label,
                                scratch_dir=cfg.scratch_dir, validate_certs=cfg.validate_certs,
                                connect_timeout=min(cfg.connect_timeout, 30.0))
    link.runners = NoWarm()
    log.info("session %s: using the documented exec and file API (transport %s)", link.label, cfg.transport)
