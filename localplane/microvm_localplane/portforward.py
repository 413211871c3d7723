"""The port-forward WebSocket: one WebSocket per TCP connection to a guest port.

The guest is dialled before the upgrade, so every refusal is a plain HTTP
status. After the upgrade, binary frames are raw bytes both ways and text
frames are ignored. There is no half-close: whichever side closes first
closes the other, with the platform's close codes.
"""
import asyncio
import logging

from aiohttp import WSMsgType, web

from . import contract
from .httputil import ApiFailure

log = logging.getLogger("microvm_localplane.portforward")
READ_CHUNK = 1024 * 1024


def parse_port(text):
    try:
        port = int(text)
    except (TypeError, ValueError) as e:
        raise ApiFailure(400, "port %r is not a number: use a guest port between %d and %d" % (
            text, contract.MIN_FORWARD_PORT, contract.MAX_FORWARD_PORT)) from e
    if not contract.MIN_FORWARD_PORT <= port <= contract.MAX_FORWARD_PORT or str(port) != text:
        raise ApiFailure(400, "port %s is out of range: use a guest port between %d and %d" % (
            text, contract.MIN_FORWARD_PORT, contract.MAX_FORWARD_PORT))
    return port


async def dial(guest, port):
    from .guests import DialError
    try:
        return await guest.dial(port)
    except DialError as e:
        raise ApiFailure(502, "could not reach guest port %d: %s" % (port, e)) from e
    except OSError as e:
        raise ApiFailure(502, "could not reach guest port %d: %s" % (port, e)) from e


class Connection:
    """One forwarded connection; `kill` closes it with a platform close code."""

    def __init__(self, ws, reader, writer, session_id, activity):
        self.ws = ws
        self.reader = reader
        self.writer = writer
        self.session_id = session_id
        self.activity = activity
        self.close_code = None
        self.close_reason = ""
        self.tasks = []

    def kill(self, code, reason):
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason
        for task in self.tasks:
            task.cancel()

    def _finish(self, code, reason):
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason

    async def ws_to_guest(self):
        try:
            async for msg in self.ws:
                if msg.type == WSMsgType.BINARY:
                    self.activity.touch(self.session_id)
                    self.writer.write(msg.data)
                    await self.writer.drain()
                elif msg.type == WSMsgType.TEXT:
                    continue  # ignored, as on the platform
                elif msg.type == WSMsgType.ERROR:
                    self._finish(contract.CLOSE_UPSTREAM_ERROR, "websocket error")
                    return
            # The client closed: no half-close, the guest side goes too.
            self._finish(contract.CLOSE_GUEST_HUNG_UP, "")
        except (ConnectionError, OSError) as e:
            self._finish(contract.CLOSE_UPSTREAM_ERROR, "guest connection error: %s" % e)

    async def guest_to_ws(self):
        try:
            while True:
                data = await self.reader.read(READ_CHUNK)
                if not data:
                    self._finish(contract.CLOSE_GUEST_HUNG_UP, "guest closed the connection")
                    return
                self.activity.touch(self.session_id)
                await self.ws.send_bytes(data)
        except (ConnectionError, OSError) as e:
            self._finish(contract.CLOSE_UPSTREAM_ERROR, "guest connection error: %s" % e)

    async def run(self):
        self.tasks = [asyncio.ensure_future(self.ws_to_guest()), asyncio.ensure_future(self.guest_to_ws())]
        await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        try:
            self.writer.close()
        except Exception:
            pass
        if not self.ws.closed:
            code = self.close_code or contract.CLOSE_GUEST_HUNG_UP
            try:
                await self.ws.close(code=code, message=self.close_reason.encode()[:120])
            except Exception:
                pass


async def handle(request, sessions, session_id, port_text):
    port = parse_port(port_text)
    rec = sessions.get(session_id)
    guest = await sessions.usable_guest(rec, "open a port-forward")
    reader, writer = await dial(guest, port)
    sid = rec["session_id"]
    # No permessage-deflate: the bytes are opaque (often already compressed) and zlib would cap throughput.
    ws = web.WebSocketResponse(protocols=(), autoping=True, heartbeat=None, max_msg_size=contract.WS_MAX_FRAME,
                               compress=False)
    try:
        await ws.prepare(request)
    except Exception:
        writer.close()
        raise
    conn = Connection(ws, reader, writer, sid, sessions.activity)
    sessions.activity.add(sid, conn)
    try:
        await conn.run()
    finally:
        sessions.activity.remove(sid, conn)
    return ws
