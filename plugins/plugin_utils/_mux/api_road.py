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
import urllib.parse
import uuid

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import USER_AGENT
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

log = logging.getLogger("microvm.mux")

TRANSPORTS = ("agent", "api", "auto")
AUTO_PROBE_SECONDS = 5.0              # auto: how long the agent port may take to answer before the api road is used
EXEC_MAX_TIMEOUT = 240                # "Clamped server-side (default 60, maximum 240)" (post_session_sandbox_exec)
ONE_SHOT_MAX = 512 * 1024             # stdin bytes sent inline; base64 of more would pass a 1 MiB request body
STDIN_WRITE = 768 * 1024              # one interactive stdin write ("at most 1 MiB" each)
MAX_UPLOAD = 500 * 1024 * 1024        # the streaming upload's cap (create_session_workspace_upload)
FOOTER_MAGIC = b"DOWSSHA1"
FOOTER_BYTES = 73                     # magic + 64 hex + "\n" (get_session_workspace_download)
READ_TIMEOUT = 120.0                  # the plane sends a keepalive comment every 15 s on a quiet stream
COPY_CHUNK = 1024 * 1024
TEAM_SETTING = "interactive stdin (keep_stdin_open), which the platform enables per team"


HttpFailure = errors.HttpRefused  # the old name, for code written against it


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


def env_argv(argv: list, env: dict | None) -> list:
    """argv with the per-command environment the documented exec lacks, through env(1)."""
    if not env:
        return list(argv)
    for name in env:
        if not name or "=" in name or "\0" in name:
            raise errors.SandboxError("environment variable name %r cannot be passed to a command" % name)
    return ["/usr/bin/env", "--"] + ["%s=%s" % (k, v) for k, v in sorted(env.items())] + list(argv)


class ApiExec:
    """One command on the event stream: the `call` of exec_stream (cancel() stops it)."""

    def __init__(self, client: ApiRoadClient, argv: list, workdir: str, timeout: int, hold_stdin: bool):
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
                 scratch_dir: str = profile.SCRATCH_DIR, validate_certs: bool = True, connect_timeout: float = 60.0):
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

    def _send(self, method: str, path: str, body=None, headers: dict | None = None, query: dict | None = None):
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
    def exec_stream(self, argv, env=None, workdir="", timeout=0, stdin=None, deadline=None, hold_stdin=False):
        """Prepare a command; returns (call, stdin_queue) like AgentClient.exec_stream.

        It starts in iter_exec: with one-shot stdin once the queue's stdin is complete (put(None)),
        with interactive stdin at once.
        """
        call = ApiExec(self, env_argv(argv, env), workdir or "", int(timeout or 0), bool(hold_stdin))
        feed: queue.Queue = queue.Queue()
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

    def iter_exec(self, call: ApiExec, feed: queue.Queue | None = None):
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

    def _collect(self, feed: queue.Queue) -> bytes:
        parts = []
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

    def _start(self, call: ApiExec, stdin: bytes, keep_open: bool):
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

    def _events(self, call: ApiExec, resp):
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

    def _write_stdin(self, call: ApiExec, feed: queue.Queue) -> None:
        """Forward the queue's stdin as offset-keyed writes; a failed write is retried once at its offset."""
        offset = 0
        while not call.exec_id and not call.cancelled.is_set():
            call.cancelled.wait(0.01)  # the exec id comes with the started event
        while not call.cancelled.is_set():
            item = feed.get()
            eof = item is None
            data = b"" if eof else bytes(item)
            for i in range(0, max(len(data), 1), STDIN_WRITE):
                piece = data[i:i + STDIN_WRITE]
                last = eof or i + STDIN_WRITE >= len(data)
                doc = {"offset": offset}
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

    def exec(self, argv, env=None, workdir="", timeout=0, stdin=b"", deadline=None):
        """Run a command to completion, collecting stdout and stderr apart (the mux's own helpers)."""
        call, feed = self.exec_stream(argv, env=env, workdir=workdir, timeout=timeout, stdin=stdin or b"")
        return ac.collect_exec(self.iter_exec(call, feed))

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

    def upload(self, local_path, remote_path, mode=0, chunk_size=COPY_CHUNK, is_archive=False):
        """Stream a local file to a guest path under the transfer root (X-Content-Sha256); returns bytes written."""
        what = "archive destination" if is_archive else "upload destination"
        with errors.path_rules():
            remote_path = profile.check_transfer_path(remote_path, self.scratch_dir, what=what)
        size = os.path.getsize(local_path)
        if size > MAX_UPLOAD:
            raise errors.SandboxError("%s is %d bytes: the api transport uploads at most %d bytes in one request, and "
                                      "staged (object storage) transfers are not supported yet; use transport agent"
                                      % (local_path, size, MAX_UPLOAD))
        digest = hashlib.sha256()
        with open(local_path, "rb") as f:
            for chunk in iter(lambda: f.read(COPY_CHUNK), b""):
                digest.update(chunk)
        query = {"path": remote_path, "is_archive": "true" if is_archive else "false"}
        verb = "extract an archive into" if is_archive else "upload to"
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

    def download(self, remote_path, local_path, chunk_size=COPY_CHUNK):
        """Stream a guest file to local_path; verified against the DOWSSHA1 footer, then renamed into place."""
        with errors.path_rules():
            remote_path = profile.check_transfer_path(remote_path, self.scratch_dir, what="download source")
        try:
            conn, resp = self._send("GET", "/workspace/download", query={"path": remote_path, "as_archive": "false"})
        except errors.HttpRefused as e:
            raise self._transfer_error(e, remote_path, "download") from e
        except (OSError, http.client.HTTPException) as e:
            raise errors.GuestUnavailable("cannot download %s from session %s: %s" % (remote_path, self.label, e)) from e
        local_dir = os.path.dirname(os.path.abspath(local_path))
        fd, tmp = tempfile.mkstemp(prefix=".%s." % os.path.basename(local_path)[:40], suffix=".part", dir=local_dir)
        try:
            digest, size, tail = hashlib.sha256(), 0, b""
            with os.fdopen(fd, "wb") as f:
                try:
                    while True:
                        chunk = resp.read(chunk_size)
                        if not chunk:
                            break
                        tail += chunk
                        if len(tail) > FOOTER_BYTES:  # everything but the last 73 bytes is payload
                            body, tail = tail[:-FOOTER_BYTES], tail[-FOOTER_BYTES:]
                            f.write(body)
                            digest.update(body)
                            size += len(body)
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
            os.chmod(tmp, 0o666 & ~ac._current_umask())  # like any new file, not mkstemp's 0600
            os.replace(tmp, local_path)
            tmp = None
            return size
        finally:
            conn.close()
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


def _read_events(resp):
    """(event, data) pairs of a Server-Sent Events body; comments (keepalives) are skipped."""
    event, data = None, []
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

    def get(self, interpreter, core=""):
        raise errors.WarmRefused("the api transport has no warm runner")

    def any_alive(self):
        """No runner to do a task's tmp dir commands either: the worker runs them in a shell."""
        return self.get("")

    def stop(self) -> None:
        pass


def attach(link) -> None:
    """Give a SessionLink (_mux/session_link.py) the api road: its client and no warm runner."""
    cfg = link.cfg
    link.road = "api"
    link.client = ApiRoadClient(cfg.api_url, cfg.prefix, cfg.token, link.session_id, link.label,
                                scratch_dir=cfg.scratch_dir, validate_certs=cfg.validate_certs,
                                connect_timeout=min(cfg.connect_timeout, 30.0))
    link.runners = NoWarm()
    log.info("session %s: using the documented exec and file API (transport %s)", link.label, cfg.transport)
