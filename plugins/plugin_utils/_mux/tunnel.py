# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A local unix socket bridged to the platform's port-forward WebSocket.

Every connection accepted on the local socket gets its own WebSocket to
`<api_url><prefix>/sessions/{id}/port-forward/{port}` (the platform's rule:
one WebSocket per TCP connection). Binary frames carry raw bytes both ways;
text frames are ignored; there is no half-close, so a local EOF closes the
WebSocket. Pings every 30 s keep edges from cutting an idle tunnel.

The bytes of a failed dial never reach the local peer (gRPC just sees a
closed connection), so the tunnel keeps the last failure as a clear
TunnelFailure (_shared/errors.py) naming the session; the caller reads it with `errors_since()`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import ssl
import tempfile
import threading
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

from ansible_collections.microvm.sandbox.plugins.module_utils import advice, profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp

WEBSOCKETS_IMPORT_ERROR: ImportError | None
try:
    from websockets.asyncio.client import connect as ws_connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, WebSocketException
except ImportError as e:  # the mux reports it, naming the package to install
    WEBSOCKETS_IMPORT_ERROR = e
    ConnectionClosed = InvalidHandshake = InvalidStatus = WebSocketException = ()  # type: ignore[misc,assignment]  # match nothing
else:
    WEBSOCKETS_IMPORT_ERROR = None

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

PING_INTERVAL = 30.0
READ_SIZE = 1024 * 1024
# What one port-forward connection may hold in the mux: no page gives the platform's frame size (our reading:
# it relays TCP reads, KiB each), so a message over WS_MESSAGE_MAX is refused (close code 1009) and at most
# WS_QUEUE_MAX messages wait unread; one mux carries every session of its user.
WS_MESSAGE_MAX = 8 * 1024 * 1024
WS_QUEUE_MAX = 8
USER_AGENT = "microvm.sandbox-tunnel/0.1"


def ws_url(api_url: str, prefix: str, session_id: str, port: int) -> str:
    """http(s)://host/base + prefix -> ws(s)://host/base<prefix>/sessions/<id>/port-forward/<port>."""
    parts = urlsplit(api_url.rstrip("/"))
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme.lower())
    if not scheme:
        raise errors.SandboxError("API URL %r must start with http:// or https://" % api_url)
    path = parts.path.rstrip("/") + "/" + prefix.strip("/") + "/sessions/%s/port-forward/%d" % (
        quote(session_id, safe=""), int(port))
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def status_error(status: int, label: str, port: int) -> errors.TunnelFailure:
    """The pre-upgrade HTTP status of a port-forward dial, as a clear error.

    What happened and what to do come from the one table (module_utils/advice.py), so the same
    status reads the same here as in the modules.
    """
    happened, todo = advice.reading(status, "session", label, context="port-forward", port=port)
    if happened is None:
        happened, todo = "the platform refused the port-forward", "Check the session and the API options"
    text = "%s (HTTP %d, opening the port-forward to session %s). %s" % (advice.capitalize(happened), status, label, todo)
    # 404, 401, 403 and other client errors do not go away by trying again; 502 (guest not listening yet), 5xx,
    # 408 and 429 may.
    return errors.TunnelFailure(text, status=status, fatal=400 <= status < 500 and status not in (408, 429))


def port_refused(error: errors.TunnelFailure) -> bool:
    """Whether a port-forward failure is the guest port refusing the platform's dial (nothing listens there).

    The handler dials the guest before upgrading (PORT-FORWARD), so a closed port is a pre-upgrade 502 "could not
    reach guest port" (docs/platform-contract.md, section 2); a dial that fails after the upgrade closes with 4002.
    A 502 also comes from a sandbox that is not running (yet): the caller asks the session's state before it
    believes the port.
    """
    return error.status == 502 or error.close_code == 4002


def close_error(code: int, reason: str, label: str, port: int) -> errors.TunnelFailure | None:
    """A WebSocket close code of the port-forward, as a clear error (None for a normal close)."""
    why = (": " + reason) if reason else ""
    if code == 4001:
        return errors.TunnelFailure("session %s became unavailable (port-forward close code 4001%s): "
                                    "it was paused, deleted or rolled back" % (label, why), close_code=code)
    if code == 4002:
        return errors.TunnelFailure("the platform could not dial guest port %d of session %s (close code 4002%s)"
                                    % (port, label, why), close_code=code)
    if code == 4011:
        return errors.TunnelFailure("the port-forward to session %s failed upstream (close code 4011%s)" % (label, why),
                                    close_code=code)
    if code in (1000, 1001):
        return None  # the guest hung up: an ordinary end of the connection
    if code == 1009:
        return errors.TunnelFailure("the port-forward to session %s sent a message over %d MiB, the most one connection may "
                                    "hold in the mux (close code 1009%s)" % (label, WS_MESSAGE_MAX >> 20, why), close_code=code)
    return errors.TunnelFailure("the port-forward to session %s closed with code %s%s" % (label, code, why), close_code=code)


class Tunnel:
    """Serve a private unix socket whose connections are tunnelled to a guest port."""

    def __init__(self, api_url: str, prefix: str, session_id: str, token: str, port: int = profile.AGENT_PORT, label: str | None = None,
                 connect_timeout: float = 30.0, validate_certs: bool = True, socket_dir: str | None = None) -> None:
        self.url = ws_url(api_url, prefix, session_id, port)
        self.session_id = session_id
        self.port = int(port)
        self.label = label or session_id
        self._token = token
        self.connect_timeout = float(connect_timeout)
        self._ssl = None
        if self.url.startswith("wss:"):
            self._ssl = ssl.create_default_context()
            if not validate_certs:
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        self._own_dir = socket_dir is None
        self._dir = socket_dir or tempfile.mkdtemp(prefix="microvm-tunnel-")  # a fresh name of our own, 0700
        # The socket is reached through the checked dir's descriptor (frames.SocketDir), held until stop(): a long
        # mux dir cannot break the bind. Named after its dir, so an address never reaches another link's socket.
        self._socket_dir = mp.SocketDir(mp.private_dir(self._dir))
        name = os.path.basename(os.path.normpath(self._dir)) + ".sock"
        self.path = os.path.join(self._dir, name)  # where it is, for messages
        self.socket_path = self._socket_dir.address(name)  # what to bind and connect (gRPC's target)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._errors: list[errors.TunnelFailure] = []
        self._lock = threading.Lock()
        self.connections = 0      # WebSockets opened so far
        self.active = 0           # WebSockets open now

    def __repr__(self) -> str:
        return "Tunnel(%r, token=<hidden>)" % self.url

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS settings of the port-forward (None for ws://), for the bulk lines that dial it too."""
        return self._ssl

    # -- life cycle ----------------------------------------------------------
    def start(self) -> str:
        ready = threading.Event()
        failure = []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_unix_server(self._serve, path=self.socket_path, limit=READ_SIZE))
                os.chmod(self.socket_path, 0o600)
            except Exception as e:  # reported to start()'s caller
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        thread = self._thread = threading.Thread(target=run, name="tunnel", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            self._socket_dir.close()
            raise errors.Unreachable("cannot serve the tunnel socket of session %s at %s: %s"
                                     % (self.label, self.path, failure[0])) from failure[0]
        return self.socket_path

    def stop(self) -> None:
        loop = self._loop
        if loop and loop.is_running():
            async def shutdown() -> None:
                if self._server:
                    self._server.close()
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                # wait for them to unwind (closing their WebSockets), or asyncio warns they were destroyed pending
                await asyncio.gather(*tasks, return_exceptions=True)
            try:
                asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
            except Exception:  # best effort at exit
                pass
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:  # set with the loop, by start()
                self._thread.join(5)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._socket_dir.close()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    # -- errors --------------------------------------------------------------
    def _record(self, error: errors.TunnelFailure) -> None:
        with self._lock:
            self._errors.append(error)
            del self._errors[:-20]

    def errors_since(self, since: float) -> list[errors.TunnelFailure]:
        """Failures recorded at or after monotonic time `since`, oldest first."""
        with self._lock:
            return [e for e in self._errors if e.at >= since]

    # -- one local connection = one WebSocket ---------------------------------
    async def _dial(self) -> ClientConnection:
        try:
            return await ws_connect(
                self.url, additional_headers={"Authorization": "Bearer " + self._token},
                user_agent_header=USER_AGENT, compression=None, max_size=WS_MESSAGE_MAX, max_queue=WS_QUEUE_MAX,
                ping_interval=PING_INTERVAL, ping_timeout=PING_INTERVAL, open_timeout=self.connect_timeout,
                close_timeout=2, ssl=self._ssl, write_limit=4 * READ_SIZE)
        except InvalidStatus as e:
            raise status_error(e.response.status_code, self.label, self.port) from e
        except (InvalidHandshake, OSError, asyncio.TimeoutError, WebSocketException) as e:
            raise errors.TunnelFailure("cannot open the port-forward to session %s at %s: %s" % (
                self.label, self.url, str(e) or type(e).__name__)) from e

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve_one(reader, writer)
        except asyncio.CancelledError:
            # stop() cancels every connection. Ending normally here: asyncio's stream callback asks a cancelled
            # task for its exception (Python 3.11), which logs a CancelledError traceback for a clean stop.
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ws = await self._dial()
        except errors.TunnelFailure as e:
            self._record(e)
            writer.close()
            return
        self.connections += 1
        self.active += 1
        try:
            await self._pump(reader, writer, ws)
        finally:
            self.active -= 1

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ws: ClientConnection) -> None:
        async def upstream() -> None:
            while True:
                data = await reader.read(READ_SIZE)
                if not data:
                    return
                await ws.send(data)

        async def downstream() -> None:
            async for message in ws:
                if isinstance(message, bytes):  # text frames are ignored by the contract
                    writer.write(message)
                    await writer.drain()

        up = asyncio.ensure_future(upstream())
        down = asyncio.ensure_future(downstream())
        try:
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)
            try:
                await ws.close()
            except Exception:  # already gone
                pass
            writer.close()
        code, reason = ws.close_code, ws.close_reason or ""
        sent = ws.protocol.close_sent
        if sent is not None and sent.code == 1009:  # our own refusal of an oversized message: no close frame comes back
            code, reason = 1009, ""
        error = close_error(code, reason, self.label, self.port) if code is not None else None
        if error is not None:
            self._record(error)
        for task in (up, down):
            exc = task.exception() if task.done() and not task.cancelled() else None
            if exc is not None and not isinstance(exc, (ConnectionClosed, ConnectionError)):
                self._record(errors.TunnelFailure("the port-forward to session %s broke: %s" % (self.label, exc)))
