"""Benchmark of the local control plane (not a timed test).

Measures, against a fresh plane on a temporary state dir:
- create-to-READY: median and p95 over N sequential creates (REST create, then GET polled every 5 ms);
- 50 concurrent sessions: time until all are READY, every one proven usable by a gRPC Exec through
  its port-forward, and the memory per idle guest (the guest's memory cgroup, as Guest.memory_bytes reads it);
- Exec round trip through the port-forward: gRPC Exec `true` over one warm WebSocket tunnel, and the
  first Exec of a fresh tunnel (WebSocket upgrade + guest dial + HTTP/2 handshake);
- keep_warm: create-to-READY median at load 1 and 10 (that many creates in flight at once), with the warm
  pool (keep_warm: true, the pool refilled between rounds) and without it (keep_warm: false, a boot each),
  on the same plane in the same run, and the ratio between them (--keep-warm-only runs just this).

Prints a table and writes bench/results/localplane.json.
Usage: PYTHONPATH=.local/collections:localplane:tests/support .venv/bin/python bench/localplane_bench.py [--creates 20]
       [--concurrent 50] [--keep-warm-only]
"""
import argparse
import asyncio
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import grpc
import requests

import benchlib  # first: it puts the collection and localplane on sys.path
from benchlib import ROOT

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import (
    sandbox_agent_pb2 as pb,
    sandbox_agent_pb2_grpc as pb_grpc,
)
from microvm_localplane.freezer import GuestCgroup
from microvm_localplane.sessions import guest_state_dir
from microvm_plane_testing import start_local_plane, stop_local_plane
from microvm_wsbridge import TcpOverWebSocket


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class Rest:
    def __init__(self, handle):
        self.base = handle.url + "/v2/agents"
        self.http = requests.Session()
        self.http.headers["Authorization"] = "Bearer " + handle.token

    def create(self, name, keep_warm=False):
        r = self.http.post(self.base + "/sessions", data="name: %s\nagent: custom\nidle_timeout: 1h\nkeep_warm: %s\n"
                           % (name, "true" if keep_warm else "false"), headers={"Content-Type": "application/yaml"})
        r.raise_for_status()
        return r.json()["session"]["session_id"]

    def status(self, sid):
        return self.http.get(self.base + "/sessions/" + sid).json()["session"]["status"]

    def wait_ready(self, sid, timeout=300, poll=0.005):
        deadline = time.monotonic() + timeout
        while True:
            s = self.status(sid)
            if s == "SESSION_STATUS_READY":
                return
            if s in ("SESSION_STATUS_FAILED", "SESSION_STATUS_DESTROYED") or time.monotonic() > deadline:
                why = self.http.get(self.base + "/sessions/" + sid).json()["session"].get("error_message")
                raise RuntimeError("session %s is %s: %s" % (sid, s, why))
            time.sleep(poll)

    def delete(self, sid):
        self.http.delete(self.base + "/sessions/" + sid)


def tunnel(handle, sid, port=8443):
    """Loopback TCP -> one port-forward WebSocket per connection (.local_port; close() when done)."""
    return TcpOverWebSocket(handle.ws_url(sid, port), handle.auth_headers)


def grpc_exec(stub, argv):
    def reqs():
        yield pb.ExecRequest(start=pb.ExecStart(argv=argv))
    code = None
    for frame in stub.Exec(reqs(), timeout=60):
        if frame.WhichOneof("output") == "exit":
            code = frame.exit.exit_code
    return code


# A one-connection guest server: "sink" reads N bytes then answers "done"; "source" sends N bytes.
GUEST_PUMP = r"""
import socket, sys
n, mode = int(sys.argv[1]), sys.argv[2]
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", 7400)); s.listen(1)
print("listening", flush=True)
c, addr = s.accept()
if mode == "sink":
    got = 0
    while got < n:
        d = c.recv(1 << 20)
        if not d:
            break
        got += len(d)
    c.sendall(b"done")
else:
    buf = b"x" * (1 << 20)
    for i in range(n >> 20):
        c.sendall(buf)
c.close()
"""


def bench_throughput(handle, rest, mib):
    """Raw bytes through one port-forward WebSocket, each way (the guest side is a Python socket)."""
    from websockets.asyncio.client import connect
    sid = rest.create("bench-throughput")
    rest.wait_ready(sid)
    n = mib << 20
    result = {"mib": mib}
    for mode in ("sink", "source"):
        server = threading.Thread(target=lambda m=mode: rest.http.post(
            rest.base + "/sessions/%s/sandbox/exec" % sid, json={"argv": ["python3", "-c", GUEST_PUMP, str(n), m]}))
        server.start()
        time.sleep(1.0)

        async def pump(mode=mode):
            async with connect(handle.ws_url(sid, 7400), additional_headers=handle.auth_headers, max_size=None,
                               compression=None) as ws:
                start = time.monotonic()
                if mode == "sink":
                    chunk = b"y" * (1 << 20)
                    for _chunk in range(n >> 20):
                        await ws.send(chunk)
                    await ws.recv()
                else:
                    got = 0
                    while got < n:
                        got += len(await ws.recv())
                return time.monotonic() - start
        elapsed = asyncio.run(pump())
        server.join()
        result["to_guest_mib_s" if mode == "sink" else "from_guest_mib_s"] = mib / elapsed
    rest.delete(sid)
    return result


def bench_create(rest, n):
    times = []
    for i in range(n):
        start = time.monotonic()
        sid = rest.create("bench-create-%d" % i)
        rest.wait_ready(sid)
        times.append(time.monotonic() - start)
        rest.delete(sid)
    return {"count": n, "median_ms": statistics.median(times) * 1000, "p95_ms": pct(times, 0.95) * 1000,
            "min_ms": min(times) * 1000, "max_ms": max(times) * 1000}


WARM_KEY = "base/mars-2vcpu-4gb"


def pool_ready(handle):
    try:
        with open(os.path.join(handle.state_dir, "warm-pool.json")) as f:
            return json.load(f)["ready"].get(WARM_KEY, 0)
    except (OSError, ValueError, KeyError):
        return 0


def wait_pool(handle, n, timeout=300):
    deadline = time.monotonic() + timeout
    while pool_ready(handle) < n:
        if time.monotonic() > deadline:
            raise RuntimeError("the warm pool never held %d guests" % n)
        time.sleep(0.1)


def create_round(rest, load, keep_warm, tag):
    """`load` creates at once, each timed from its POST to READY; -> their times, then every session deleted."""
    times, sids, errors = [None] * load, [None] * load, []

    def one(i):
        try:
            start = time.monotonic()
            sids[i] = rest.create("bench-warm-%s-%d" % (tag, i), keep_warm=keep_warm)
            rest.wait_ready(sids[i])
            times[i] = time.monotonic() - start
        except Exception as e:
            errors.append(str(e))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(load)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sid in sids:
        if sid:
            rest.delete(sid)
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return times


def bench_keep_warm(handle, rest, loads=(1, 10), rounds=5):
    """create-to-READY at each load, with the pool (served from pre-booted guests) and without (a boot each)."""
    rest.wait_ready(rest.create("bench-warm-first", keep_warm=True))  # makes base/mars-2vcpu-4gb a warm key
    out = {}
    for load in loads:
        cold, warm = [], []
        for r in range(rounds):
            cold += create_round(rest, load, False, "cold-%d-%d" % (load, r))
            wait_pool(handle, load)
            warm += create_round(rest, load, True, "warm-%d-%d" % (load, r))
        out["load_%d" % load] = {"creates": len(warm), "pool_median_ms": statistics.median(warm) * 1000,
                                 "pool_p95_ms": pct(warm, 0.95) * 1000,
                                 "no_pool_median_ms": statistics.median(cold) * 1000,
                                 "no_pool_p95_ms": pct(cold, 0.95) * 1000,
                                 "pool_over_no_pool": statistics.median(warm) / statistics.median(cold)}
    return out


def keep_warm_rows(k):
    rows = []
    for key, v in sorted(k.items(), key=lambda kv: int(kv[0].split("_")[1])):
        load = key.split("_")[1]
        rows.append(("keep_warm create to READY at load %s: pool / no pool, median" % load,
                     "%.0f / %.0f ms (%.2fx)" % (v["pool_median_ms"], v["no_pool_median_ms"], v["pool_over_no_pool"])))
        rows.append(("keep_warm create to READY at load %s: pool / no pool, p95" % load,
                     "%.0f / %.0f ms" % (v["pool_p95_ms"], v["no_pool_p95_ms"])))
    return rows


def bench_concurrent(handle, rest, n):
    start = time.monotonic()
    sids = [rest.create("bench-many-%d" % i) for i in range(n)]
    created = time.monotonic() - start
    errors = []

    def wait(sid):
        try:
            rest.wait_ready(sid, poll=0.05)
        except Exception as e:
            errors.append(str(e))
    threads = [threading.Thread(target=wait, args=(s,)) for s in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ready = time.monotonic() - start
    usable = 0
    for sid in sids:
        bridge = tunnel(handle, sid)
        channel = grpc.insecure_channel("127.0.0.1:%d" % bridge.local_port)
        try:
            if grpc_exec(pb_grpc.SandboxAgentServiceStub(channel), ["true"]) == 0:
                usable += 1
        except grpc.RpcError as e:
            errors.append("%s: %s" % (sid, e.code()))
        finally:
            channel.close()
            bridge.close()
    time.sleep(2)  # let the guests settle to idle
    scope = hashlib.sha256(os.path.abspath(guest_state_dir(handle.state_dir)).encode()).hexdigest()[:12]
    mem = [GuestCgroup(scope, sid).memory_bytes() for sid in sids]
    mem = [m for m in mem if m]
    result = {"count": n, "submit_s": created, "all_ready_s": all_ready, "usable": usable, "errors": errors[:5],
              "idle_guest_memory_mib_median": statistics.median(mem) / 2**20 if mem else None,
              "idle_guest_memory_mib_max": max(mem) / 2**20 if mem else None}
    for sid in sids:
        rest.delete(sid)
    return result


def bench_exec(handle, rest, n):
    sid = rest.create("bench-exec")
    rest.wait_ready(sid)
    firsts = []
    for _attempt in range(5):
        bridge = tunnel(handle, sid)
        channel = grpc.insecure_channel("127.0.0.1:%d" % bridge.local_port)
        start = time.monotonic()
        grpc_exec(pb_grpc.SandboxAgentServiceStub(channel), ["true"])
        firsts.append(time.monotonic() - start)
        channel.close()
        bridge.close()
    bridge = tunnel(handle, sid)
    channel = grpc.insecure_channel("127.0.0.1:%d" % bridge.local_port)
    stub = pb_grpc.SandboxAgentServiceStub(channel)
    grpc_exec(stub, ["true"])
    warm = []
    for _attempt in range(n):
        start = time.monotonic()
        assert grpc_exec(stub, ["true"]) == 0
        warm.append(time.monotonic() - start)
    channel.close()
    bridge.close()
    rest_times = []
    for _attempt in range(10):
        start = time.monotonic()
        r = rest.http.post(rest.base + "/sessions/%s/sandbox/exec" % sid, json={"argv": ["true"]})
        r.raise_for_status()
        rest_times.append(time.monotonic() - start)
    rest.delete(sid)
    return {"warm_count": n, "warm_median_ms": statistics.median(warm) * 1000, "warm_p95_ms": pct(warm, 0.95) * 1000,
            "first_on_new_tunnel_median_ms": statistics.median(firsts) * 1000,
            "rest_exec_median_ms": statistics.median(rest_times) * 1000}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--concurrent", type=int, default=50)
    parser.add_argument("--execs", type=int, default=100)
    parser.add_argument("--mib", type=int, default=256, help="MiB pushed each way through one port-forward")
    parser.add_argument("--warm-rounds", type=int, default=5, help="rounds of each keep_warm load, each way")
    parser.add_argument("--keep-warm-only", action="store_true", help="only the keep_warm section")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "localplane.json"))
    args = parser.parse_args()
    state = tempfile.mkdtemp(prefix="mvlp-bench-")
    # The pool holds a load-10 round: 10 per key, 12 in all.
    handle = start_local_plane(state, extra_env={"MICROVM_LOCALPLANE_WARM_POOL_SIZE": "10",
                                                 "MICROVM_LOCALPLANE_WARM_POOL_MAX": "12"})
    if args.keep_warm_only:
        try:
            results = {"machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()[0]},
                       "keep_warm": bench_keep_warm(handle, Rest(handle), rounds=args.warm_rounds)}
        finally:
            stop_local_plane(handle)
            shutil.rmtree(state, ignore_errors=True)
        out = args.out.replace("localplane.json", "localplane-keep-warm.json")
        benchlib.save_json(out, results)
        print("local control plane: keep_warm (%d cpus, load %.1f at start)"
              % (os.cpu_count(), results["machine"]["load_at_start"]))
        benchlib.print_rows(keep_warm_rows(results["keep_warm"]), indent="  ")
        print("wrote", out)
        return 0
    try:
        rest = Rest(handle)
        results = {"machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()[0]},
                   "create_to_ready": bench_create(rest, args.creates),
                   "exec_through_port_forward": bench_exec(handle, rest, args.execs),
                   "port_forward_throughput": bench_throughput(handle, rest, args.mib),
                   "concurrent_sessions": bench_concurrent(handle, rest, args.concurrent),
                   "keep_warm": bench_keep_warm(handle, rest, rounds=args.warm_rounds)}
    finally:
        stop_local_plane(handle)
        shutil.rmtree(state, ignore_errors=True)
    benchlib.save_json(args.out, results)
    c, e, m = results["create_to_ready"], results["exec_through_port_forward"], results["concurrent_sessions"]
    t = results["port_forward_throughput"]
    rows = [
        ("create to READY, median (%d creates)" % c["count"], "%.0f ms" % c["median_ms"]),
        ("create to READY, p95", "%.0f ms" % c["p95_ms"]),
        ("gRPC Exec `true`, warm tunnel, median", "%.1f ms" % e["warm_median_ms"]),
        ("gRPC Exec `true`, warm tunnel, p95", "%.1f ms" % e["warm_p95_ms"]),
        ("gRPC Exec on a fresh tunnel (upgrade+dial+h2)", "%.1f ms" % e["first_on_new_tunnel_median_ms"]),
        ("REST exec `true`, median", "%.1f ms" % e["rest_exec_median_ms"]),
        ("port-forward %d MiB to / from the guest" % t["mib"], "%.0f / %.0f MiB/s" % (t["to_guest_mib_s"], t["from_guest_mib_s"])),
        ("%d concurrent sessions: all READY" % m["count"], "%.1f s" % m["all_ready_s"]),
        ("%d concurrent sessions: usable (Exec ok)" % m["count"], "%d/%d" % (m["usable"], m["count"])),
        ("memory per idle guest, median / max",
         "%.1f / %.1f MiB" % (m["idle_guest_memory_mib_median"] or 0, m["idle_guest_memory_mib_max"] or 0)),
    ] + keep_warm_rows(results["keep_warm"])
    print("local control plane benchmark (%d cpus, load %.1f at start)" % (os.cpu_count(), results["machine"]["load_at_start"]))
    benchlib.print_rows(rows, indent="  ")
    print("wrote", args.out)
    return 0 if m["usable"] == m["count"] else 1


if __name__ == "__main__":
    sys.exit(main())
