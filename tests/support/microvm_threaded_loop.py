"""An asyncio loop in a daemon thread, for synchronous tests and tools that drive guests.

`ThreadedLoop.bridge(guest, port)` returns the path of a unix socket bridged to
a guest port (microvm_localplane.bridge.PortBridge).
"""
import asyncio
import contextlib
import threading

from microvm_localplane.bridge import PortBridge


class ThreadedLoop:
    """An asyncio loop in a daemon thread: run coroutines from synchronous code."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="guest-loop")
        self._thread.start()
        self._bridges = []

    def run(self, coro, timeout=None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def bridge(self, guest, port):
        """-> path of a unix socket bridged to the guest port (closed by close())."""
        bridge = PortBridge(guest, port)
        self.run(bridge.start())
        self._bridges.append(bridge)
        return bridge.path

    def close(self):
        if self.loop.is_closed():
            return
        for bridge in self._bridges:
            with contextlib.suppress(Exception):
                self.run(bridge.close(), timeout=10)

        async def cancel_rest():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            self.run(cancel_rest(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()
