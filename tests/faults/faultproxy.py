"""A fault-injecting HTTP + WebSocket proxy between the client stack and a control plane (tests only).

    proxy = FaultProxy(plane.url).start()      # proxy.url replaces plane.url for the client
    proxy.fail_next(503, count=3, methods=("GET",), path=r"/sessions")   # canned answers, upstream never sees them
    proxy.fail_next(429, count=2, retry_after=0)
    proxy.fail_next(429, headers={"ratelimit-reset": "1700000000"})   # extra answer headers
    proxy.slow_answers(5, methods=("POST",), path=r"/checkpoints$")  # forward, then hold the answer 5 s
    proxy.lose_answers(504, methods=("POST",), path=r"/fork$")  # forward, then answer 504 (an edge timeout)
    proxy.cut_ws(up=200_000)                   # abort the first WebSocket to pass 200 kB client->plane
    proxy.cut_ws(down=64_000)                  # ... or 64 kB plane->client (one cut per call)
    proxy.stall_ws(); proxy.release_ws()       # hold all WebSocket traffic, then let it flow again
    proxy.cut_all_ws()                         # abort every open WebSocket now
    proxy.set_upstream(new_url)                # after the plane restarted on another port
    proxy.stop()

Everything is driven by Python methods from the test's thread; the proxy runs
an aiohttp server on its own event loop in a daemon thread. `proxy.log` lists
(method, path, status, faulted) for every HTTP request seen, so tests can
count what the client really sent.
"""
import asyncio
import re
import threading

import aiohttp
from aiohttp import web

HOP = {"host", "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
       "transfer-encoding", "upgrade", "content-length", "sec-websocket-key", "sec-websocket-version",
       "sec-websocket-extensions", "sec-websocket-accept", "content-encoding"}


async def cancel_and_wait(tasks):
    """Cancel tasks and wait until they have really ended, so none is left pending when the loop stops."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class FaultProxy:
    def __init__(self, upstream):
        self.upstream = upstream.rstrip("/")
        self.url = None
        self.log = []
        self.ws_log = []          # (path, bytes_up, bytes_down, how it ended), once the handler is done
        self.cuts = []            # "cut-up" / "cut-down" / "cut", recorded before the connection is dropped
        self._rules = []
        self._ws_cuts = []        # pending {"up": n, "down": n}
        self._open_ws = set()
        self._lock = threading.Lock()
        self._loop = None
        self._runner = None
        self._gate = None         # asyncio.Event; cleared = stalled

    # -- control (any thread) -------------------------------------------------
    def fail_next(self, status, count=1, methods=None, path=None, retry_after=None, body=None, headers=None):
        """Answer the next `count` matching requests with `status` without forwarding them."""
        with self._lock:
            self._rules.append({"status": status, "count": count, "methods": set(methods) if methods else None,
                                "path": re.compile(path) if path else None, "retry_after": retry_after,
                                "headers": dict(headers or {}),
                                "body": body or '{"id": "fault", "message": "injected by the fault proxy"}'})

    def slow_answers(self, seconds, count=1, methods=None, path=None):
        """Forward the next `count` matching requests, then hold the plane's answer `seconds` before passing it on.

        The plane does the work at once; a client with a shorter timeout sees no answer (a slow platform).
        """
        with self._lock:
            self._rules.append({"delay": float(seconds), "count": count,
                                "methods": set(methods) if methods else None, "path": re.compile(path) if path else None})

    def lose_answers(self, status, count=1, methods=None, path=None, body=None):
        """Forward the next `count` matching requests, let the plane do the work, then answer `status` instead.

        What a gateway does when it gives up on a slow upstream (a 504) or loses it (a 502): the work happened,
        the client only hears the gateway.
        """
        with self._lock:
            self._rules.append({"lose": status, "count": count, "methods": set(methods) if methods else None,
                                "path": re.compile(path) if path else None,
                                "body": body or '{"id": "gateway_timeout", "message": "upstream request timeout"}'})

    def cut_ws(self, up=None, down=None):
        """Abort the first WebSocket that passes `up` bytes to the plane or `down` bytes back (once).

        The limit is claimed when a WebSocket passes it, not when it opens, so short-lived
        WebSockets (probes, gRPC reconnects) never take it."""
        with self._lock:
            self._ws_cuts.append({"up": up, "down": down})

    def stall_ws(self):
        self._loop.call_soon_threadsafe(self._gate.clear)

    def release_ws(self):
        self._loop.call_soon_threadsafe(self._gate.set)

    def cut_all_ws(self):
        fut = asyncio.run_coroutine_threadsafe(self._abort_all(), self._loop)
        fut.result(10)

    def set_upstream(self, url):
        with self._lock:
            self.upstream = url.rstrip("/")

    def requests(self, method=None, path=None):
        with self._lock:
            return [e for e in self.log if (method is None or e[0] == method) and (path is None or re.search(path, e[1]))]

    # -- life cycle -----------------------------------------------------------
    def start(self):
        ready = threading.Event()

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._gate = asyncio.Event()
            self._gate.set()
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.url = "http://127.0.0.1:%d" % port
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())

        self._thread = threading.Thread(target=run, name="faultproxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self):
        if self._loop is None:
            return

        async def shutdown():
            await self._abort_all()
            await self._runner.cleanup()
            await cancel_and_wait([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        self._loop = None

    # -- the proxy ------------------------------------------------------------
    async def _abort_all(self):
        for item in list(self._open_ws):
            item()

    def _claim(self, cut, key, total):
        """Give this WebSocket the first pending cut whose `key` limit it is about to pass."""
        with self._lock:
            for i, pending in enumerate(self._ws_cuts):
                if pending[key] is not None and total > pending[key]:
                    cut.update(self._ws_cuts.pop(i))
                    return

    def _match(self, request):
        with self._lock:
            for rule in self._rules:
                if rule["count"] <= 0:
                    continue
                if rule["methods"] and request.method not in rule["methods"]:
                    continue
                if rule["path"] and not rule["path"].search(request.path):
                    continue
                rule["count"] -= 1
                return rule
        return None

    async def _handle(self, request):
        rule = self._match(request)
        if rule is not None and "delay" in rule:
            return await self._forward(request, delay=rule["delay"])
        if rule is not None and "lose" in rule:
            return await self._forward(request, lose=rule)
        if rule is not None:
            headers = {"Content-Type": "application/json"}
            if rule["retry_after"] is not None:
                headers["Retry-After"] = str(rule["retry_after"])
            headers.update(rule["headers"])
            with self._lock:
                self.log.append((request.method, request.path, rule["status"], True))
            await request.read()
            return web.Response(status=rule["status"], text=rule["body"], headers=headers)
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._websocket(request)
        return await self._forward(request)

    def _headers(self, request):
        return {k: v for k, v in request.headers.items() if k.lower() not in HOP}

    async def _forward(self, request, delay=0.0, lose=None):
        body = await request.read()
        with self._lock:
            target = self.upstream + request.path_qs
        try:
            async with aiohttp.ClientSession(auto_decompress=False) as s:
                async with s.request(request.method, target, headers=self._headers(request), data=body or None,
                                     allow_redirects=False) as r:
                    data = await r.read()
                    headers = {k: v for k, v in r.headers.items() if k.lower() not in HOP}
                    status = r.status
        except aiohttp.ClientError as e:
            with self._lock:
                self.log.append((request.method, request.path, 502, True))
            return web.Response(status=502, text='{"id": "bad_gateway", "message": "proxy: %s"}' % type(e).__name__,
                                content_type="application/json")
        if lose is not None:
            # The plane did the work; the client hears only the gateway (logged once, as faulted).
            with self._lock:
                self.log.append((request.method, request.path, lose["lose"], True))
            return web.Response(status=lose["lose"], text=lose["body"], content_type="application/json")
        with self._lock:
            self.log.append((request.method, request.path, status, False))
        if delay:
            await asyncio.sleep(delay)  # the client may have given up by now: that is the point
        return web.Response(status=status, body=data, headers=headers)

    async def _websocket(self, request):
        with self._lock:
            target = self.upstream.replace("http", "ws", 1) + request.path_qs
            cut = {"up": None, "down": None}   # claimed from _ws_cuts by the first WebSocket to pass a limit
        session = aiohttp.ClientSession()
        try:
            upstream = await session.ws_connect(target, headers=self._headers(request), autoping=True)
        except aiohttp.WSServerHandshakeError as e:
            await session.close()
            with self._lock:
                self.log.append((request.method, request.path, e.status, False))
            return web.Response(status=e.status, text='{"id": "upstream", "message": "%s"}' % e.message)
        except aiohttp.ClientError:
            await session.close()
            return web.Response(status=502, text='{"id": "bad_gateway", "message": "proxy could not reach the plane"}')
        with self._lock:
            self.log.append((request.method, request.path, 101, False))
        client = web.WebSocketResponse(autoping=True)
        await client.prepare(request)
        counts = {"up": 0, "down": 0, "end": "closed"}
        done = asyncio.get_running_loop().create_future()

        def abort(how="cut"):
            if done.done():
                return
            counts["end"] = how
            with self._lock:
                self.cuts.append(how)
            if request.transport is not None:
                request.transport.abort()       # no close frame: like a dropped connection
            done.set_result(None)

        self._open_ws.add(abort)

        async def pump(src, dst, key):
            async for msg in src:
                await self._gate.wait()
                if msg.type == aiohttp.WSMsgType.BINARY:
                    if cut[key] is None:
                        self._claim(cut, key, counts[key] + len(msg.data))
                    limit = cut[key]
                    if limit is not None and counts[key] + len(msg.data) > limit:
                        keep = max(0, limit - counts[key])
                        if keep:
                            await dst.send_bytes(msg.data[:keep])
                            counts[key] += keep
                        abort("cut-%s" % key)
                        return
                    counts[key] += len(msg.data)
                    await dst.send_bytes(msg.data)
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    await dst.send_str(msg.data)
                else:
                    break

        tasks = [asyncio.ensure_future(pump(client, upstream, "up")),
                 asyncio.ensure_future(pump(upstream, client, "down"))]
        try:
            await asyncio.wait(tasks + [done], return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._open_ws.discard(abort)
            await cancel_and_wait(tasks)
            code = upstream.close_code
            await upstream.close()
            await session.close()
            if not client.closed and counts["end"] == "closed":
                await client.close(code=code or 1000)
            with self._lock:
                self.ws_log.append((request.path, counts["up"], counts["down"], counts["end"]))
        return client
