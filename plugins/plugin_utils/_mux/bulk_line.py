# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The bulk byte path: one socket to the guest agent, gRPC over HTTP/2 over the port-forward's WebSocket.

A big Upload or Download does not cross grpcio's threads and the tunnel's unix socket (tunnel.py): the
calling mux thread owns one TCP (or TLS, through `ssl`) socket, speaks the WebSocket with websockets'
sans-I/O ClientProtocol (handshake, control frames, the inbound budget) and HTTP/2 with h2 (settings,
HPACK headers and trailers, pings, resets, GOAWAY), and carries gRPC's 5-byte length-prefixed messages.

The DATA frames of the call are framed here, not by h2: the agent allows 16 KiB frames, and h2 spends
about 1.2 ms of CPU per MiB making them (more than the whole budget of a transfer), and formats every
received frame for its trace log, a hex dump of the payload, even with logging off. So this module keeps
the call's flow-control windows itself: WINDOW_UPDATE frames and the call's plain DATA frames never
reach h2 (its windows stay as they began, unused); everything else does (a DATA frame h2 must see, padded
or ending the stream, counts against CONTROL_MAX, which bounds its hex dump too). Client frames carry a fresh
random mask key each, as RFC 6455 requires.

Everything the guest sends is hostile and has a budget: a WebSocket message over WS_MESSAGE_MAX (the
tunnel's), an HTTP/2 frame over FRAME_MAX, a gRPC message over MESSAGE_MAX, more than CONTROL_MAX of
non-DATA frames in one call, DATA past the window we gave, or silence longer than the read timeout once a
transfer has started: each closes that line with an error naming the limit. One line carries one call
at a time; the pool (AgentClient) keeps a few idle lines per session.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from urllib.parse import unquote_to_bytes, urlsplit

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import tunnel
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

BULK_IMPORT_ERROR: ImportError | None = None
try:
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
    import h2.settings
    from websockets.client import ClientProtocol
    from websockets.exceptions import InvalidStatus
    from websockets.uri import parse_uri
except ImportError as e:  # the bulk path is then off: transfers take the gRPC channel (AgentClient)
    BULK_IMPORT_ERROR = e
try:
    from websockets.speedups import apply_mask
except ImportError:  # websockets without its C extension: the same function in Python
    try:
        from websockets.utils import apply_mask
    except ImportError as e:
        BULK_IMPORT_ERROR = e

log = logging.getLogger("microvm.mux")
# websockets logs frames with their first bytes at DEBUG: never on this path (a put may carry credentials).
_WS_LOGGER = logging.getLogger("microvm.mux.bulk.websocket")
_WS_LOGGER.setLevel(logging.WARNING)

SWITCH = "MICROVM_MUX_BULK"       # "off": every transfer takes the gRPC channel (for diagnosis)
WS_MESSAGE_MAX = tunnel.WS_MESSAGE_MAX
WS_SEND_MAX = 256 * 1024    # our messages: the local plane relayed 1 MiB ones at twice the CPU per MiB
FRAME_MAX = 1024 * 1024           # SETTINGS_MAX_FRAME_SIZE we advertise
WINDOW = 16 * 1024 * 1024         # the receive window we give the agent, per call and per connection
HEADER_LIST_MAX = 64 * 1024       # SETTINGS_MAX_HEADER_LIST_SIZE
MESSAGE_MAX = 4 * 1024 * 1024 + 1024  # the agent's largest chunk (4 MiB) and its message's framing
CONTROL_MAX = 1024 * 1024         # non-DATA frame bytes one call may receive (settings, pings, headers...)
READ_TIMEOUT = 60.0               # silence allowed while bytes are moving
VERDICT_TIMEOUT = 600.0           # silence allowed after the request ended (the agent checks, writes, renames)
IDLE_REUSE = 20.0                 # an idle line older than this is closed, not reused (edges cut idle sockets)
RECV_SIZE = 1024 * 1024
USER_AGENT = tunnel.USER_AGENT
AUTHORITY = b"sandbox-agent"
PREFACE_TIMEOUT = 30.0

_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY, _WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
_END_STREAM, _PADDED = 0x1, 0x8
_FRAME_HEAD = struct.Struct(">BHBBI")   # length as 1 + 2 bytes, type, flags, stream id
_UPDATE = struct.Struct(">I")
_IOV_MAX = 512   # buffers per sendmsg (the kernel takes 1024)


def enabled() -> bool:
    """Whether transfers may take the bulk path (the switch, and h2 and websockets importable)."""
    return BULK_IMPORT_ERROR is None and os.environ.get(SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


class CallFailed(Exception):
    """The call ended with a gRPC status other than OK (the agent's refusal): code (int) and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__("gRPC status %d: %s" % (code, message))
        self.code = code
        self.message = message


class LineBroken(Exception):
    """The line failed under the call. `answered`: some of the call's response had arrived (never retry then)."""

    def __init__(self, error: errors.SandboxError, answered: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.answered = answered


class Sink(Protocol):
    """Where a call's response messages go, piece by piece: begin(length), piece(bytes) until length, end().

    A piece is a view of the line's receive buffer, valid only during the call: keep a copy, never the view.
    """

    def begin(self, length: int) -> None: ...
    def piece(self, data: memoryview) -> None: ...
    def end(self) -> None: ...


class Target:
    """Where and how to dial: the port-forward's URL, the token (never shown), TLS, the session's label."""

    def __init__(self, url: str, token: str, ssl_context: ssl.SSLContext | None, connect_timeout: float, label: str,
                 port: int) -> None:
        self.url = url
        self._token = token
        self.ssl_context = ssl_context
        self.connect_timeout = connect_timeout
        self.label = label
        self.port = port

    def __repr__(self) -> str:
        return "Target(%r, token=<hidden>)" % self.url

    def authorization(self) -> str:
        return "Bearer " + self._token


def _frame_head(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return _FRAME_HEAD.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)


class Line:
    """One WebSocket to the agent's port and one HTTP/2 connection over it; one call at a time."""

    def __init__(self, sock: socket.socket, ws: Any, target: Target) -> None:
        self._sock = sock
        self._ws = ws
        self.target = target
        self.label = target.label
        self._recv_buf = bytearray(RECV_SIZE)
        self._h2_head = bytearray()    # an HTTP/2 frame header arriving in pieces
        self._h2_frame = bytearray()   # a frame gathered whole (not the call's DATA), header included
        self._h2_left = 0              # payload bytes of the current frame still to come
        self._h2_direct = False        # the current frame is the call's DATA: its payload goes straight to the call
        self._rx_call: _Call | None = None  # the call the bytes being received belong to
        self._conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self._conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: FRAME_MAX,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: HEADER_LIST_MAX,
        })
        # h2 reads these three from its settings only when they change: ours are set from the start
        self._conn.max_inbound_frame_size = FRAME_MAX
        self._conn.incoming_buffer.max_frame_size = FRAME_MAX
        self._conn.decoder.max_header_list_size = HEADER_LIST_MAX
        self._conn.initiate_connection()
        self._conn.increment_flow_control_window(WINDOW - 65535)
        self._conn_recv_window = WINDOW        # what the agent may still send on the connection
        self._conn_send_window = 65535         # what we may still send (the peer's WINDOW_UPDATEs add to it)
        self._peer_initial_window = 65535
        self._peer_frame_max = 16384
        self._settings_seen = False
        self._ws_binary = True               # the kind of the WebSocket message being received
        self._ws_message: int | None = None  # its size so far, while it is fragmented
        self._ws_head = bytearray()          # a frame header arriving in pieces
        self._ws_kind = ""                   # the frame being received: "data", "skip" (text), "control", "" (none)
        self._ws_left = 0                    # its payload bytes still to come
        self._ws_control = bytearray()       # a control frame, whole, for websockets
        self._closed = False
        self.reusable = True
        self.idle_since = time.monotonic()
        self._call: _Call | None = None
        self._flush_h2()

    # -- dialing --------------------------------------------------------------------------------
    @classmethod
    def dial(cls, target: Target) -> Line:
        """Open the port-forward's WebSocket (the tunnel's statuses and close codes mean the same here) and HTTP/2."""
        parts = urlsplit(target.url)
        secure = parts.scheme == "wss"
        try:
            sock = socket.create_connection((parts.hostname, parts.port or (443 if secure else 80)),
                                            timeout=target.connect_timeout)
        except OSError as e:
            raise errors.TunnelFailure("cannot open the port-forward to session %s at %s: %s"
                                       % (target.label, target.url, e.strerror or e)) from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if secure:
                context = target.ssl_context or ssl.create_default_context()
                sock = context.wrap_socket(sock, server_hostname=parts.hostname)
            ws = ClientProtocol(parse_uri(target.url), max_size=WS_MESSAGE_MAX, logger=_WS_LOGGER)
            request = ws.connect()
            request.headers["Authorization"] = target.authorization()
            request.headers["User-Agent"] = USER_AGENT
            ws.send_request(request)
            sock.sendall(b"".join(ws.data_to_send()))
            deadline = time.monotonic() + target.connect_timeout
            answer = bytearray()
            while b"\r\n\r\n" not in answer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("no answer to the WebSocket upgrade")
                if len(answer) > 65536:
                    raise ConnectionError("the answer to the WebSocket upgrade is over 64 KiB")
                sock.settimeout(left)
                data = sock.recv(65536)
                if not data:
                    ws.receive_eof()
                    raise ConnectionError("the connection closed during the WebSocket upgrade")
                answer += data
            # websockets reads the answer's head only: the frames after it (the agent's first HTTP/2 bytes may come
            # in the same read) are this line's to parse, from their first byte
            end = answer.index(b"\r\n\r\n") + 4
            if not answer.startswith(b"HTTP/1.1 101 "):  # a refusal: websockets reads it to the end of its body
                ws.receive_data(bytes(answer))
                while ws.handshake_exc is None and time.monotonic() < deadline:
                    sock.settimeout(max(deadline - time.monotonic(), 0.01))
                    data = sock.recv(65536)
                    if not data:
                        ws.receive_eof()
                        break
                    ws.receive_data(data)
                raise ws.handshake_exc or ConnectionError("the WebSocket upgrade was refused: %r"
                                                          % bytes(answer[:min(end, 80)]))
            ws.receive_data(bytes(answer[:end]))
            ws.events_received()
            if ws.handshake_exc is not None:
                raise ws.handshake_exc
            line = cls(sock, ws, target)
            line._take_in(memoryview(bytes(answer[end:])))
            line._wait_settings(deadline)
            return line
        except InvalidStatus as e:
            sock.close()
            raise tunnel.status_error(e.response.status_code, target.label, target.port) from e
        except errors.SandboxError:
            sock.close()
            raise
        except Exception as e:  # OSError, ssl.SSLError, and websockets' handshake errors (they vary by version)
            sock.close()
            raise errors.TunnelFailure("cannot open the port-forward to session %s at %s: %s"
                                       % (target.label, target.url, str(e) or type(e).__name__)) from e

    def _wait_settings(self, deadline: float) -> None:
        """The agent speaks first in HTTP/2 with its SETTINGS (its frame size and window): wait for them."""
        while not self._settings_seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.TunnelFailure("the guest agent of session %s sent no HTTP/2 settings within %g s on the "
                                           "bulk line" % (self.label, PREFACE_TIMEOUT))
            self._receive(min(left, PREFACE_TIMEOUT), budget=None)

    # -- the socket and the WebSocket -------------------------------------------------------------
    def _send_message(self, payload: bytes | bytearray | memoryview) -> None:
        """One binary WebSocket message, masked with a fresh key."""
        self._send_parts([payload], len(payload))

    def _send_parts(self, parts: list[bytes | bytearray | memoryview], size: int) -> None:
        """One binary WebSocket message made of `parts` (`size` bytes in all), masked with a fresh key part by part
        (the key turned to each part's offset), so the parts are never joined: one copy, the masking's own."""
        if size < 126:
            head = bytes((0x82, 0x80 | size))
        elif size < 65536:
            head = struct.pack(">BBH", 0x82, 0xFE, size)
        else:
            head = struct.pack(">BBQ", 0x82, 0xFF, size)
        key = secrets.token_bytes(4)
        buffers: list[bytes | memoryview] = [head + key]
        offset = 0
        for part in parts:
            turn = offset & 3
            buffers.append(apply_mask(part, key[turn:] + key[:turn]))
            offset += len(part)
        self._sock.settimeout(READ_TIMEOUT)
        try:
            if isinstance(self._sock, ssl.SSLSocket):
                for buffer in buffers:
                    self._sock.sendall(buffer)
                return
            while buffers:  # a partial send goes on from where it stopped, without joining the buffers
                sent = self._sock.sendmsg(buffers[:_IOV_MAX])
                while sent and buffers:
                    if sent >= len(buffers[0]):
                        sent -= len(buffers.pop(0))
                    else:
                        buffers[0] = memoryview(buffers[0])[sent:]
                        sent = 0
        except socket.timeout as e:
            raise self._broken("the agent took no bytes for %g s" % READ_TIMEOUT) from e
        except OSError as e:
            raise self._broken("the connection broke while sending: %s" % (e.strerror or e)) from e

    def _flush_h2(self) -> None:
        """What h2 has to send (settings, headers, acks), in messages of at most WS_SEND_MAX."""
        while True:
            out = self._conn.data_to_send(WS_SEND_MAX)
            if not out:
                return
            self._send_message(out)

    def _flush_ws(self) -> None:
        """WebSocket control answers (pong, close) that websockets queued."""
        out = self._ws.data_to_send()
        if out:
            try:
                self._sock.sendall(b"".join(out))
            except OSError:
                pass  # the line is failing anyway; the read side says why

    def _receive(self, timeout: float, budget: _Call | None) -> None:
        """Wait up to `timeout` for bytes; take them through the WebSocket into the HTTP/2 splitter."""
        self._sock.settimeout(timeout)
        self._rx_call = budget
        try:
            n = self._sock.recv_into(self._recv_buf)
        except socket.timeout as e:
            raise self._broken("no byte from the guest agent for %g s, the read timeout of a started transfer" % timeout) from e
        except OSError as e:
            raise self._broken("the connection broke: %s" % (e.strerror or e)) from e
        if n == 0:
            self._ws.receive_eof()
        with memoryview(self._recv_buf) as view:
            self._take_in(view[:n], eof=n == 0)

    def _take_in(self, data: memoryview, eof: bool = False) -> None:
        """Received bytes through the WebSocket into HTTP/2; then a close (or the end of the stream) fails the line."""
        self._ws_frames(data)  # what came before a close counts (an answer begun, its words)
        self._flush_ws()
        if eof or self._ws.close_rcvd is not None or self._ws.close_sent is not None:
            self.reusable = False
            self._closed = True
            raise self._broken(self._close_words())

    def _ws_frames(self, data: memoryview) -> None:
        """Server frames, parsed here as they arrive: a binary payload goes straight into the HTTP/2 inbox (one copy;
        websockets' reader costs 0.4 ms of CPU per MiB in copies); control frames go whole to websockets, which
        answers pings and closes. Text frames are skipped (the contract ignores them)."""
        at, n = 0, len(data)
        while at < n:
            if self._ws_left == 0 and self._ws_kind == "":
                need = self._ws_head_size() - len(self._ws_head)
                self._ws_head += data[at:at + need]
                at += min(need, n - at)
                if len(self._ws_head) < self._ws_head_size():
                    continue  # the extended length comes next (or with the next read)
                self._ws_start_frame()
                if self._ws_left == 0:
                    self._ws_end_frame()
                continue
            take = min(self._ws_left, n - at)
            if self._ws_kind == "data":
                self._h2_bytes(data[at:at + take], self._rx_call)
            elif self._ws_kind == "control":
                self._ws_control += data[at:at + take]
            at += take
            self._ws_left -= take
            if self._ws_left == 0:
                self._ws_end_frame()

    def _ws_head_size(self) -> int:
        head = self._ws_head
        if len(head) < 2:
            return 2
        size = head[1] & 0x7F
        return 2 + (2 if size == 126 else 8 if size == 127 else 0) + (4 if head[1] & 0x80 else 0)

    def _ws_start_frame(self) -> None:
        head = bytes(self._ws_head)
        self._ws_head.clear()
        first, second = head[0], head[1]
        opcode, size = first & 0x0F, second & 0x7F
        if size == 126:
            size = struct.unpack_from(">H", head, 2)[0]
        elif size == 127:
            size = struct.unpack_from(">Q", head, 2)[0]
        if second & 0x80 or first & 0x70:
            raise self._ws_refuse(1002, "a masked or extended WebSocket frame from the server")
        if opcode >= 0x8:  # close, ping, pong: whole, to websockets
            if size > 125 or not first & 0x80 or opcode > 0xA:
                raise self._ws_refuse(1002, "a malformed WebSocket control frame")
            self._ws_kind, self._ws_control = "control", bytearray(head)
        elif opcode in (0x1, 0x2) or (opcode == 0x0 and self._ws_message is not None):
            if opcode != 0x0:
                if self._ws_message is not None:
                    raise self._ws_refuse(1002, "a new WebSocket message inside a fragmented one")
                self._ws_message = 0
                self._ws_binary = opcode == 0x2
            self._ws_message = (self._ws_message or 0) + size
            if self._ws_message > WS_MESSAGE_MAX:
                raise self._ws_refuse(1009, "a WebSocket message over %d MiB, the most one bulk line takes (close code 1009)"
                                      % (WS_MESSAGE_MAX >> 20))
            self._ws_kind = "data" if self._ws_binary else "skip"
            if first & 0x80:
                self._ws_message = None
        else:
            raise self._ws_refuse(1002, "a WebSocket frame with opcode %d" % opcode)
        self._ws_left = size

    def _ws_end_frame(self) -> None:
        if self._ws_kind == "control":
            self._ws.receive_data(bytes(self._ws_control))
            self._ws.events_received()  # websockets queued the pong or the closing answer; nothing to read
            self._ws_control = bytearray()
        self._ws_kind = ""

    def _ws_refuse(self, code: int, words: str) -> LineBroken:
        try:
            self._ws.send_close(code, "")
            self._flush_ws()
        except Exception:  # best effort: the line is closed either way
            pass
        return self._refuse(words)

    def _close_words(self) -> str:
        sent, rcvd = self._ws.close_sent, self._ws.close_rcvd
        if sent is not None and sent.code == 1009:
            return ("the port-forward sent a WebSocket message over %d MiB, the most one bulk line takes (close code 1009)"
                    % (WS_MESSAGE_MAX >> 20))
        if rcvd is not None:
            failure = tunnel.close_error(rcvd.code, rcvd.reason or "", self.label, self.target.port)
            return str(failure) if failure is not None else "the guest agent closed the connection (WebSocket close %d)" % rcvd.code
        if sent is not None:
            return "the port-forward's WebSocket broke its protocol (we closed it with %d: %s)" % (sent.code, sent.reason)
        return "the connection closed"

    def _broken(self, words: str) -> LineBroken:
        self.reusable = False
        call = self._call
        answered = call is not None and call.answered
        return LineBroken(errors.GuestUnavailable("the bulk transfer on session %s failed: %s" % (self.label, words)), answered)

    def _refuse(self, words: str) -> LineBroken:
        """A budget or protocol breach by the guest: the line is closed and the transfer fails naming the limit."""
        self.reusable = False
        self.close()
        return LineBroken(errors.SandboxError("the guest agent of session %s broke the bulk transfer's rules: %s; the "
                                              "transfer was stopped" % (self.label, words)), answered=True)

    # -- HTTP/2 frames ------------------------------------------------------------------------------
    def _h2_bytes(self, data: memoryview, call: _Call | None) -> None:
        """HTTP/2 bytes as they arrive: the payload of the call's plain DATA frames goes to the call as it comes (no
        copy); WINDOW_UPDATE frames are counted here; every other frame is gathered whole and given to h2."""
        at, n = 0, len(data)
        while at < n:
            if self._h2_left:
                take = min(self._h2_left, n - at)
                if self._h2_direct:
                    if call is not None:
                        call.feed(data[at:at + take])
                else:
                    self._h2_frame += data[at:at + take]
                at += take
                self._h2_left -= take
                if not self._h2_left and not self._h2_direct:
                    self._h2_frame_done(call)
                continue
            need = 9 - len(self._h2_head)
            self._h2_head += data[at:at + need]
            at += min(need, n - at)
            if len(self._h2_head) == 9:
                self._h2_start_frame(call)

    def _h2_start_frame(self, call: _Call | None) -> None:
        head = bytes(self._h2_head)
        self._h2_head.clear()
        high, low, kind, flags, stream_id = _FRAME_HEAD.unpack(head)
        length = (high << 16) | low
        stream_id &= 0x7FFFFFFF
        if length > FRAME_MAX:
            raise self._refuse("an HTTP/2 frame of %d bytes, over the %d KiB we allow (SETTINGS_MAX_FRAME_SIZE)"
                               % (length, FRAME_MAX >> 10))
        self._h2_left = length
        self._h2_direct = (kind == _DATA and not flags & (_PADDED | _END_STREAM) and call is not None
                           and stream_id == call.stream_id)
        if self._h2_direct:
            self._take_data(call, length)
            return
        if call is not None and (kind != _WINDOW_UPDATE or not call.sending):  # window updates: many, while we send
            call.control += 9 + length
            if call.control > CONTROL_MAX:
                raise self._refuse("%d bytes of frames other than data in one transfer, over the %d KiB allowed"
                                   % (call.control, CONTROL_MAX >> 10))
        if kind == _DATA:
            self._take_data(call, length, stream_id)
        self._h2_frame = bytearray(head)
        if not length:
            self._h2_frame_done(call)

    def _h2_frame_done(self, call: _Call | None) -> None:
        frame, self._h2_frame = self._h2_frame, bytearray()
        if frame[3] == _WINDOW_UPDATE and len(frame) == 13:
            stream_id = int.from_bytes(frame[5:9], "big") & 0x7FFFFFFF
            self._window_update(stream_id, _UPDATE.unpack_from(frame, 9)[0] & 0x7FFFFFFF, call)
        else:
            self._to_h2(bytes(frame), call)

    def _take_data(self, call: _Call | None, length: int, stream_id: int | None = None) -> None:
        """Count DATA against the windows we gave; give them back once half is used."""
        self._conn_recv_window -= length
        if self._conn_recv_window < 0:
            raise self._refuse("data past the connection's flow-control window (%d MiB)" % (WINDOW >> 20))
        if call is not None and (stream_id is None or stream_id == call.stream_id):
            call.recv_window -= length
            if call.recv_window < 0:
                raise self._refuse("data past the transfer's flow-control window (%d MiB)" % (WINDOW >> 20))
        updates = []
        if self._conn_recv_window <= WINDOW // 2:
            updates.append(_frame_head(4, _WINDOW_UPDATE, 0, 0) + _UPDATE.pack(WINDOW - self._conn_recv_window))
            self._conn_recv_window = WINDOW
        if call is not None and not call.ended and call.recv_window <= WINDOW // 2:
            updates.append(_frame_head(4, _WINDOW_UPDATE, 0, call.stream_id) + _UPDATE.pack(WINDOW - call.recv_window))
            call.recv_window = WINDOW
        if updates:
            self._send_message(b"".join(updates))

    def _window_update(self, stream_id: int, increment: int, call: _Call | None) -> None:
        if increment == 0:
            raise self._refuse("a WINDOW_UPDATE of 0")
        if stream_id == 0:
            self._conn_send_window += increment
            if self._conn_send_window > 0x7FFFFFFF:
                raise self._refuse("a connection window over 2^31-1")
        elif call is not None and stream_id == call.stream_id:
            call.send_window += increment
            if call.send_window > 0x7FFFFFFF:
                raise self._refuse("a stream window over 2^31-1")

    def _to_h2(self, data: bytes, call: _Call | None) -> None:
        try:
            events = self._conn.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            raise self._refuse("HTTP/2: %s" % e) from e
        for event in events:
            if isinstance(event, h2.events.RemoteSettingsChanged):
                self._settings_seen = True
                changed = event.changed_settings
                if h2.settings.SettingCodes.INITIAL_WINDOW_SIZE in changed:
                    new = changed[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE].new_value
                    if call is not None:
                        call.send_window += new - self._peer_initial_window
                    self._peer_initial_window = new
                if h2.settings.SettingCodes.MAX_FRAME_SIZE in changed:
                    self._peer_frame_max = changed[h2.settings.SettingCodes.MAX_FRAME_SIZE].new_value
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.reusable = False
                if call is not None and not call.ended and (event.error_code or (event.last_stream_id or 0) < call.stream_id):
                    raise self._broken("the agent ended the connection (GOAWAY, error %s)" % event.error_code)
            elif call is None:
                continue
            elif isinstance(event, h2.events.ResponseReceived) and event.stream_id == call.stream_id:
                call.response_headers(event.headers, self)
            elif isinstance(event, h2.events.TrailersReceived) and event.stream_id == call.stream_id:
                call.trailers(event.headers)
            elif isinstance(event, h2.events.DataReceived) and event.stream_id == call.stream_id:
                # counted in our windows by _h2_start_frame (never acknowledged to h2: its window updates would add to ours)
                call.feed(memoryview(event.data))
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id == call.stream_id:
                call.ended = True
            elif isinstance(event, h2.events.StreamReset) and event.stream_id == call.stream_id:
                call.ended = True
                call.reset = event.error_code
        self._flush_h2()

    # -- one call -----------------------------------------------------------------------------------
    def call(self, path: str, messages: Iterable[list[bytes | bytearray | memoryview]], sink: Sink) -> None:
        """One gRPC call: send each message (its pieces, concatenated), end, and feed the response to `sink`.

        Raises CallFailed for a status other than OK, LineBroken when the line fails under it.
        """
        stream_id = self._conn.get_next_available_stream_id()
        call = self._call = _Call(stream_id, sink, self._peer_initial_window)
        try:
            self._conn.send_headers(stream_id, [
                (b":method", b"POST"), (b":scheme", b"https" if self.target.url.startswith("wss") else b"http"),
                (b":path", path.encode()), (b":authority", AUTHORITY), (b"content-type", b"application/grpc"),
                (b"te", b"trailers"), (b"user-agent", USER_AGENT.encode())])
            self._flush_h2()
            for message in messages:
                if call.ended:
                    break  # the agent answered early (a refusal): stop sending, read its verdict
                size = sum(len(p) for p in message)
                self._send_data(call, [b"\x00" + size.to_bytes(4, "big")] + list(message))
            if not call.ended:
                self._conn.end_stream(stream_id)
                self._flush_h2()
            else:
                self.reusable = False  # our half of the stream is still open: this line carries nothing more
            call.sending = False
            while not call.ended:
                self._receive(VERDICT_TIMEOUT if not call.answered else READ_TIMEOUT, call)
            call.finish()
        finally:
            self._call = None
            self.idle_since = time.monotonic()
            if not call.ended:
                self.reusable = False

    def _send_data(self, call: _Call, pieces: list[bytes | bytearray | memoryview]) -> None:
        """The pieces as DATA frames of the call within both send windows, in WebSocket messages of WS_SEND_MAX.

        A message is a list of frame heads and views of the pieces: nothing is copied before the masking.
        """
        parts: list[bytes | bytearray | memoryview] = []
        size = 0
        for piece in pieces:
            view = memoryview(piece)
            at, n = 0, len(view)
            while at < n:
                if call.ended:
                    return
                room = min(call.send_window, self._conn_send_window)
                if room <= 0:
                    if parts:
                        self._send_parts(parts, size)
                        parts, size = [], 0
                    self._receive(READ_TIMEOUT, call)
                    continue
                take = min(n - at, room, self._peer_frame_max, WS_SEND_MAX - 9 - size)
                if take <= 0:
                    self._send_parts(parts, size)
                    parts, size = [], 0
                    continue
                parts.append(_frame_head(take, _DATA, 0, call.stream_id))
                parts.append(view[at:at + take])
                size += 9 + take
                at += take
                call.send_window -= take
                self._conn_send_window -= take
                if size >= WS_SEND_MAX - 9 or len(parts) >= _IOV_MAX - 2:
                    self._send_parts(parts, size)
                    parts, size = [], 0
                    self._poll(call)
        if parts:
            self._send_parts(parts, size)
            self._poll(call)

    def _poll(self, call: _Call) -> None:
        """Take in what already arrived (window updates, pings, an early refusal) without waiting."""
        while not self._closed and select.select([self._sock], [], [], 0)[0]:
            self._receive(READ_TIMEOUT, call)
            if isinstance(self._sock, ssl.SSLSocket) and not self._sock.pending():
                break

    # -- the pool's view ----------------------------------------------------------------------------
    def fresh_enough(self) -> bool:
        """Whether an idle line may carry another call: not too old, nothing closed or pending on it."""
        if not self.reusable or self._closed or time.monotonic() - self.idle_since > IDLE_REUSE:
            return False
        try:
            while select.select([self._sock], [], [], 0)[0]:
                self._receive(1.0, None)  # a ping, settings or a GOAWAY; a close or EOF raises
        except LineBroken:
            return False
        return self.reusable

    def close(self) -> None:
        if self._sock.fileno() < 0:
            return
        try:
            if not self._closed and self._ws.close_code is None:
                self._ws.send_close(1000)
                self._flush_ws()
        except Exception:  # best effort: the peer may be gone
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        self._closed = True


class _Call:
    """The state of one call on a line: its windows, the gRPC message deframer and the outcome."""

    __slots__ = ("stream_id", "sink", "send_window", "recv_window", "ended", "reset", "answered", "sending",
                 "control", "status", "message", "_head", "_left", "_in_message")

    def __init__(self, stream_id: int, sink: Sink, send_window: int) -> None:
        self.stream_id = stream_id
        self.sink = sink
        self.send_window = send_window
        self.recv_window = WINDOW
        self.ended = False
        self.reset: int | None = None
        self.answered = False
        self.sending = True
        self.control = 0
        self.status: int | None = None
        self.message = ""
        self._head = bytearray()   # a message's 5-byte prefix while it arrives in pieces
        self._left = 0             # bytes of the current message still to come
        self._in_message = False

    def response_headers(self, headers: list[tuple[bytes, bytes]], line: Line) -> None:
        self.answered = True
        fields = dict(headers)
        status = fields.get(b":status", b"")
        if status != b"200":
            raise line._refuse("an HTTP status %s instead of 200" % status.decode("ascii", "replace")[:8])
        if not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            raise line._refuse("a response that is not gRPC (content-type %r)" % fields.get(b"content-type", b"")[:40])
        self.trailers(headers)  # a trailers-only answer (a refusal before any message) carries its status here

    def trailers(self, headers: list[tuple[bytes, bytes]]) -> None:
        fields = dict(headers)
        if b"grpc-status" in fields:
            try:
                self.status = int(fields[b"grpc-status"])
            except ValueError:
                self.status = 2  # UNKNOWN: a status that is not a number
            self.message = _percent_decoded(fields.get(b"grpc-message", b""))[:2000]

    def feed(self, data: memoryview) -> None:
        """Response stream bytes -> whole messages' pieces for the sink, each bounded by MESSAGE_MAX."""
        self.answered = True
        at, n = 0, len(data)
        while at < n:
            if not self._in_message:
                need = 5 - len(self._head)
                self._head += data[at:at + need]
                at += min(need, n - at)
                if len(self._head) < 5:
                    return
                if self._head[0] != 0:
                    raise BudgetBreach("a compressed gRPC message (none was asked for)")
                length = int.from_bytes(self._head[1:5], "big")
                if length > MESSAGE_MAX:
                    raise BudgetBreach("a gRPC message of %d bytes, over the %d MiB one transfer message may hold"
                                       % (length, MESSAGE_MAX >> 20))
                self._head.clear()
                self._in_message = True
                self._left = length
                self.sink.begin(length)
            take = min(self._left, n - at)
            if take:
                self.sink.piece(data[at:at + take])
            at += take
            self._left -= take
            if self._left == 0:
                self._in_message = False
                self.sink.end()

    def finish(self) -> None:
        if self._in_message or self._head:
            raise CallFailed(15, "the response ended inside a message")  # DATA_LOSS
        if self.reset is not None and self.status is None:
            raise CallFailed(14, "the agent reset the stream (HTTP/2 error %d)" % self.reset)  # UNAVAILABLE
        if self.status is None:
            raise CallFailed(14, "the response ended without a gRPC status")
        if self.status != 0:
            raise CallFailed(self.status, self.message)


class BudgetBreach(Exception):
    """Raised by the deframer or a sink (no line at hand); run_call turns it into a refusal naming the limit."""


def _percent_decoded(raw: bytes) -> str:
    return unquote_to_bytes(raw).decode("utf-8", "replace")


def run_call(line: Line, path: str, messages: Iterable[list[bytes | bytearray | memoryview]], sink: Sink) -> None:
    """Line.call, with a deframer's budget breach closing the line like any other (its words kept)."""
    try:
        line.call(path, messages, sink)
    except BudgetBreach as e:
        raise line._refuse(str(e)) from e


class Pool:
    """Idle lines of one session, reused for the next transfer; at most KEEP kept, each closed after IDLE_REUSE."""

    KEEP = 2

    def __init__(self, dial: Callable[[], Line]) -> None:
        self._dial = dial
        self._idle: list[Line] = []
        self._lock = threading.Lock()
        self._closed = False
        self.dials = 0

    def take(self) -> tuple[Line, bool]:
        """(a line, whether it was reused): an idle one that is still fine, else a fresh dial."""
        while True:
            with self._lock:
                line = self._idle.pop() if self._idle else None
            if line is None:
                break
            if line.fresh_enough():
                return line, True
            line.close()
        self.dials += 1
        return self._dial(), False

    def has_idle(self) -> bool:
        with self._lock:
            return bool(self._idle)

    def give_back(self, line: Line) -> None:
        if not line.reusable:
            line.close()
            return
        with self._lock:
            if not self._closed and len(self._idle) < self.KEEP:
                self._idle.append(line)
                return
        line.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for line in idle:
            line.close()
