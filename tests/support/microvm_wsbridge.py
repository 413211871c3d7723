"""A loopback TCP listener whose connections each ride their own port-forward WebSocket (client side).

For synchronous callers (contract tests, benchmarks) that want to point an
ordinary TCP client, such as a grpc channel, at a guest port through the
plane's (or the platform's) port-forward:

    bridge = TcpOverWebSocket(plane.ws_url(sid, 8443), plane.auth_headers)
    channel = grpc.insecure_channel("127.0.0.1:%d" % bridge.local_port)
    ...
    channel.close()
    bridge.close()

Binary frames are the TCP bytes; text frames are ignored. When either side
ends, the other is closed. The event loop runs in a daemon thread; `close()`
cancels and awaits every connection, then stops and closes the loop.
"""
import asyncio
import contextlib
import threading

CHUNK = 65536


class TcpOverWebSocket:
    """Loopback TCP -> one port-forward WebSocket per accepted connection (a thread with its own loop)."""

    def __init__(self, url, headers=None, **connect_kwargs):
        self.url = url
        self.headers = dict(headers or {})
        self.connect_kwargs = connect_kwargs
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ws-bridge", daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.local_port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _handle(self, reader, writer):
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed
        try:
            async with connect(self.url, additional_headers=self.headers, max_size=None, **self.connect_kwargs) as ws:
                async def up():
                    while data := await reader.read(CHUNK):
                        await ws.send(data)
                    await ws.close()

                async def down():
                    with contextlib.suppress(ConnectionClosed):
                        async for msg in ws:
                            if isinstance(msg, bytes):
                                writer.write(msg)
                                await writer.drain()
                tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
                try:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
        except (Exception, asyncio.CancelledError):  # noqa: B014 - a cancelled handler ends quietly (Python 3.11 streams)
            pass
        finally:
            writer.close()

    def close(self):
        if self.loop.is_closed():
            return

        async def shutdown():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()
