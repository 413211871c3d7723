# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""HTTP for the api road (api_road.py): one session's data-plane calls and presigned object-storage URLs.

Standard library only (http.client): the mux imports no HTTP package for it. An error status raises
errors.HttpRefused carrying the status and the platform's message; the API token goes only to the API,
never to a presigned URL. One connection to the API is kept alive per session between calls (`release`); a
call made while it is in use opens its own, and a connection that was cancelled, not read to its end, or
told to close is never kept.

A 429 is the one answer retried, here in `send` alone: the platform answers it before taking the call, so
sending it again is safe for any call, an exec too. The wait is the answer's Retry-After (seconds or an HTTP
date), else a short backoff, each wait capped and all of them within RATE_LIMIT_BUDGET; then the 429 is
raised, naming what to do. A 413 is raised with what it means on this road and what to do.

A file body (`FileBody`) is sent by the kernel (`socket.sendfile`) on a plain-HTTP connection and from one
reused buffer over TLS (which encrypts in user space); once a transfer has started, TRANSFER_STALL bounds any
silence of the other side (`send(..., stall=...)`, and the presigned calls).
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import random
import select
import socket
import ssl
import threading
import time
import urllib.parse
from typing import BinaryIO, Callable

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import USER_AGENT, retry_after_seconds
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

log = logging.getLogger("microvm.mux")

READ_TIMEOUT = 120.0     # the longest a data-plane answer may stay silent (a buffered exec waits at most WAIT_SLICE)
TRANSFER_STALL = READ_TIMEOUT  # the longest either side of a started transfer may stay silent
COPY_CHUNK = 1024 * 1024
RATE_LIMIT_BUDGET = 120.0  # all the waits one call spends on 429s before it gives up (a task is not held longer)
RATE_LIMIT_WAIT_MAX = 30.0  # one wait, whatever Retry-After asks (as the REST client caps it)
RATE_LIMIT_BACKOFF = 0.5    # the first wait of a 429 without Retry-After; doubled each time
RATE_LIMIT_RETRIES = 8      # sends after a 429, whatever the waits (a Retry-After of 0 must not loop forever)


class FileBody:
    """`length` bytes of a file open for reading (unbuffered) from `offset`, as a request body: sent by the kernel
    on a plain connection, else read into `buf` (one buffer, reused) and sent from it. It can be sent again
    (after a 429): each send starts at `offset`."""

    def __init__(self, f: io.RawIOBase | BinaryIO, offset: int, length: int, buf: bytearray | None = None) -> None:
        self.f, self.offset, self.length = f, offset, length
        self.buf = buf if buf is not None else bytearray(COPY_CHUNK)

    def __len__(self) -> int:
        return self.length

    def send(self, sock: socket.socket) -> None:
        """All `length` bytes on sock; a file that ended sooner (it shrank since it was sized) raises OSError."""
        if self.length == 0:
            return
        if isinstance(sock, ssl.SSLSocket):  # TLS encrypts in user space: the kernel cannot send the file itself
            sent = send_from_buffer(sock, self.f, self.offset, self.length, self.buf)
        else:
            sent = sock.sendfile(self.f, self.offset, self.length)  # os.sendfile beneath
        if sent != self.length:
            raise OSError("the file ended after %d of its %d bytes: it changed while it was sent" % (sent, self.length))


def send_from_buffer(sock: socket.socket, f: io.RawIOBase | BinaryIO, offset: int, length: int, buf: bytearray) -> int:
    """Send `length` bytes of f from `offset` through one reused buffer (no new bytes object a block); -> bytes sent."""
    view, left = memoryview(buf), length
    f.seek(offset)
    while left:
        n = f.readinto(view[:min(left, len(view))])  # type: ignore[union-attr]
        if not n:
            break
        sock.sendall(view[:n])
        left -= n
    return length - left


def error_text(body: bytes) -> str:
    """The platform's message in an error body ({"error": {"message"}} or {"message"}), else its first bytes."""
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


class Http:
    """The data plane of one session: `send` and `json_call` under its base path, `presigned` for object storage."""

    def __init__(self, api_url: str, prefix: str, token: str, session_id: str, label: str, validate_certs: bool = True,
                 connect_timeout: float = 60.0) -> None:
        parts = urllib.parse.urlsplit(api_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise errors.SandboxError("api_url %r is not an http(s) URL" % api_url)
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.base = parts.path + prefix + "/sessions/" + urllib.parse.quote(session_id, safe="")
        self._token = token
        self.label = label
        self.connect_timeout = float(connect_timeout or 60.0)
        self.context: ssl.SSLContext | None = None
        if self.scheme == "https":
            self.context = ssl.create_default_context()
            if not validate_certs:
                self.context.check_hostname = False
                self.context.verify_mode = ssl.CERT_NONE
        self.closed = False
        self.sleep: Callable[[float], object] = time.sleep  # tests record the 429 waits instead
        self._idle: http.client.HTTPConnection | None = None  # the kept-alive connection, when no call uses it
        self._idle_lock = threading.Lock()

    def close(self) -> None:
        self.closed = True
        with self._idle_lock:
            idle, self._idle = self._idle, None
        if idle is not None:
            idle.close()

    def release(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse, call: Call | None = None) -> None:
        """Done with a call whose answer was read: keep its connection for the next call, or close it."""
        if call is not None and call.conn is conn:
            call.conn = None
        if (self.closed or resp.will_close or not resp.isclosed() or conn.sock is None
                or (call is not None and call.cancelled.is_set())):
            conn.close()
            return
        conn.sock.settimeout(self.connect_timeout)  # a long exec may have set a longer one
        with self._idle_lock:
            old, self._idle = self._idle, conn
        if old is not None:
            old.close()

    def _take_idle(self) -> http.client.HTTPConnection | None:
        """The kept connection, unless the server has closed it since (or sent something unasked: not reused)."""
        with self._idle_lock:
            conn, self._idle = self._idle, None
        if conn is not None and (conn.sock is None or select.select([conn.sock], [], [], 0)[0]):
            conn.close()
            return None
        return conn

    def _connection(self) -> http.client.HTTPConnection:
        if self.context is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=self.connect_timeout, context=self.context,
                                               blocksize=COPY_CHUNK)
        return http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout, blocksize=COPY_CHUNK)

    def _exchange(self, method: str, url: str, body: bytes | BinaryIO | FileBody | None, headers: dict, call: Call | None,
                  runs: bool = False, stall: float | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """One request and its response head, on the kept connection when there is one (a body that is a stream is
        never sent on it: it could not be sent again if the server had closed it).

        A kept connection that fails is replaced and the call sent again, except a call that `runs` a command (an
        exec): the server may have taken it before the connection broke, and a command is never run twice (the
        road reports it lost). _take_idle() leaves out a connection the server had already closed, so that is rare."""
        reused = self._take_idle() if body is None or isinstance(body, bytes) else None
        while True:
            conn = reused or self._connection()
            if call is not None:
                call.conn = conn
                if call.cancelled.is_set():
                    conn.close()
                    raise ConnectionAbortedError("the call was cancelled")
            try:
                request(conn, method, url, body, headers, stall)
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                if reused is None or runs or (call is not None and call.cancelled.is_set()):
                    raise
                reused = None  # the server had closed the kept connection before reading the request: send it anew
            except (OSError, http.client.HTTPException):
                conn.close()
                raise

    def send(self, method: str, path: str, body: bytes | BinaryIO | FileBody | None = None, headers: dict | None = None,
             query: dict | None = None, call: Call | None = None,
             stall: float | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """(connection, response) of one call; an error status raises HttpRefused (the connection is closed).

        With `call`, the connection is the call's from the start: its cancel() hangs up a call still waiting
        for its answer (a buffered exec says nothing until its command is over). With `stall` (a transfer), the
        longest the other side may stay silent once the request is under way."""
        if self.closed:
            raise errors.GuestUnavailable("the link to session %s was closed" % self.label)
        url = self.base + path + ("?" + urllib.parse.urlencode(query) if query else "")
        all_headers = {"Authorization": "Bearer " + self._token, "User-Agent": USER_AGENT}
        all_headers.update(headers or {})
        start = _file_start(body)
        replayable = body is None or isinstance(body, (bytes, bytearray, FileBody)) or start is not None
        waited, attempt = 0.0, 0
        while True:
            conn, resp = self._exchange(method, url, body, all_headers, call,
                                        runs=method == "POST" and path == "/sandbox/exec", stall=stall)
            if resp.status < 300:
                return conn, resp
            text = error_text(resp.read(64 * 1024))
            conn.close()
            if resp.status == 413:
                raise errors.HttpRefused(413, too_large(method, path, body, all_headers, text))
            if resp.status != 429:
                raise errors.HttpRefused(resp.status, "HTTP %d: %s" % (resp.status, text))
            wait = rate_limit_wait(resp.getheader("Retry-After"), attempt)
            if waited + wait > RATE_LIMIT_BUDGET or attempt >= RATE_LIMIT_RETRIES or not replayable:
                raise errors.HttpRefused(429, "HTTP 429: %s: the platform is rate limiting this team's calls and kept "
                                              "refusing this one (%d tries, %.0f s waited); it was not taken: run "
                                              "again later, or with fewer forks" % (text, attempt + 1, waited))
            log.info("session %s: %s %s answered 429 (%s): sending it again in %.1f s", self.label, method,
                     path.split("?")[0], text, wait)
            if call is None:
                self.sleep(wait)
            elif call.cancelled.wait(wait):  # a cancelled call stops waiting at once
                raise ConnectionAbortedError("the call was cancelled")
            waited += wait
            attempt += 1
            if start is not None:
                body.seek(start)  # type: ignore[union-attr]  # a file body is read again from where it began

    def json_call(self, method: str, path: str, doc: dict | None = None, limit: int = 1024 * 1024) -> dict:
        """A JSON call's answer object (at most `limit` bytes of it)."""
        body = None if doc is None else json.dumps(doc).encode()
        conn, resp = self.send(method, path, body, None if doc is None else {"Content-Type": "application/json"})
        try:
            answer = json.loads(resp.read(limit).decode("utf-8") or "{}")
        except BaseException:
            conn.close()
            raise
        self.release(conn, resp)
        if not isinstance(answer, dict):
            raise errors.SandboxError("the data plane answered %s %s with %r, not an object" % (method, path, str(answer)[:200]))
        return answer

    def presigned(self, method: str, url: str,
                  body: bytes | FileBody | None = None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """(connection, response) of a presigned object-storage URL: never the API token, its own credential."""
        parts = urllib.parse.urlsplit(str(url))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise errors.SandboxError("the data plane gave a presigned URL that is not http(s): %r" % str(url)[:200])
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=TRANSFER_STALL,
                                               context=self.context or ssl.create_default_context(), blocksize=COPY_CHUNK)
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TRANSFER_STALL, blocksize=COPY_CHUNK)
        headers = {"User-Agent": USER_AGENT}
        if body is not None:
            headers.update({"Content-Length": str(len(body)), "Content-Type": "application/octet-stream"})
        try:
            request(conn, method, parts.path + ("?" + parts.query if parts.query else ""), body, headers)
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise


def request(conn: http.client.HTTPConnection, method: str, url: str, body: bytes | BinaryIO | FileBody | None,
            headers: dict, stall: float | None = None) -> None:
    """Send one request; a FileBody goes after the head, straight on the socket (its Content-Length is in headers).
    With `stall`, the connection (made within its connect timeout) then waits at most that long for the other side."""
    if stall is not None:
        if conn.sock is None:
            conn.connect()
        conn.sock.settimeout(stall)
    if not isinstance(body, FileBody):
        conn.request(method, url, body=body, headers=headers)
        return
    conn.request(method, url, headers=headers)  # the head alone: no body was given to http.client
    body.send(conn.sock)


def _file_start(body: bytes | BinaryIO | FileBody | None) -> int | None:
    """Where a file body starts (it is sent again from there after a 429); None when it is no seekable file."""
    if body is None or isinstance(body, (bytes, bytearray, FileBody)):
        return None  # a FileBody starts at its offset at each send
    try:
        return body.tell() if body.seekable() else None
    except (AttributeError, OSError, ValueError):
        return None


def rate_limit_wait(retry_after: str | None, attempt: int) -> float:
    """Seconds to wait before sending a call the platform answered 429: its Retry-After, else a short backoff."""
    asked = retry_after_seconds(retry_after, time.time())
    if asked is not None:
        return min(asked, RATE_LIMIT_WAIT_MAX)
    base = min(RATE_LIMIT_BACKOFF * (2 ** attempt), RATE_LIMIT_WAIT_MAX)
    return base / 2 + random.uniform(0, base / 2)  # jitter: parallel hosts told the same do not return in step


def too_large(method: str, path: str, body: bytes | BinaryIO | FileBody | None, headers: dict, text: str) -> str:
    """A 413's message: the request's size, the documented bounds the road keeps, and what to do."""
    size = len(body) if isinstance(body, (bytes, bytearray)) else headers.get("Content-Length", "an unknown number of")
    return ("HTTP 413: %s: the platform refused %s %s of %s bytes as too large; nothing was taken. The api road keeps "
            "to the documented bounds (1 MiB a JSON body, so a command's one-shot stdin past 512 KiB is staged as a "
            "file; 500 MiB a streaming upload, bigger files go staged), so this platform's bound is lower: send a "
            "smaller stdin or file, or use transport agent for this task" % (text, method, path.split("?")[0], size))


class Call:
    """One command on the api road as exec_stream hands it out: cancel() marks it and hangs up the call in flight
    (an event stream stops its command; a buffered exec's job is then stopped by the road, api_exec.py)."""

    def __init__(self, argv: list, workdir: str, timeout: int, hold_stdin: bool) -> None:
        self.argv = argv
        self.workdir = workdir
        self.timeout = timeout
        self.hold_stdin = hold_stdin
        self.conn: http.client.HTTPConnection | None = None
        self.exec_id = ""
        self.output_limit = 0  # a job printing more is stopped without its output being moved (api_exec.Jobs.run)
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()
        conn = self.conn
        if conn is not None and conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
