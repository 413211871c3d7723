"""Expose a guest port on a local unix socket, so ordinary clients (grpc channels) can reach it.

Every connection accepted on the socket is piped to a fresh Guest.dial(port).
A refused dial closes the accepted connection at once.

    async with guest_port_socket(guest, 8443) as path:
        channel = grpc.aio.insecure_channel("unix:" + path)

(The tests' ThreadedLoop, tests/support/microvm_threaded_loop.py, wraps this
for synchronous code.)
"""
import asyncio
import contextlib
import os
import shutil
import tempfile
import uuid

PIPE_CHUNK = 256 * 1024


async def pipe(reader, writer, chunk=PIPE_CHUNK):
    """Copy reader to writer until EOF or a connection error, then close writer."""
    try:
        while True:
            data = await reader.read(chunk)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


class PortBridge:
    """A unix socket whose connections go to one port of one guest."""

    def __init__(self, guest, port, path=None):
        self.guest = guest
        self.port = port
        self._tmpdir = None
        if path is None:
            # Unix socket paths are limited to 107 bytes: keep them short.
            self._tmpdir = tempfile.mkdtemp(prefix="mvlp-bridge-")
            path = os.path.join(self._tmpdir, uuid.uuid4().hex[:12] + ".sock")
        self.path = path
        self._server = None
        self._tasks = set()

    async def start(self):
        self._server = await asyncio.start_unix_server(self._on_connect, self.path)
        os.chmod(self.path, 0o600)
        return self.path

    async def _on_connect(self, reader, writer):
        try:
            g_reader, g_writer = await self.guest.dial(self.port)
        except Exception:
            writer.close()
            return
        for task in (asyncio.ensure_future(pipe(reader, g_writer)), asyncio.ensure_future(pipe(g_reader, writer))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self):
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def guest_port_socket(guest, port, path=None):
    bridge = PortBridge(guest, port, path)
    await bridge.start()
    try:
        yield bridge.path
    finally:
        await bridge.close()
