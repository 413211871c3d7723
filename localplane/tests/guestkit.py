"""Helpers for the guest and agent tests: real guests, real gRPC over Guest.dial."""
import contextlib
import hashlib
import ipaddress
import os
import queue
import shutil
import socket
import subprocess
import sys
import time
import uuid

import grpc

from microvm_localplane import baseimage, idmap
from microvm_localplane.guests import GuestManager, RootfsSpec
from microvm_localplane.pb import pb2, pb2_grpc
from microvm_plane_testing import localplane_cache
from microvm_threaded_loop import ThreadedLoop

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 16 << 20), ("grpc.max_send_message_length", 16 << 20)]


# One cache for every plane the tests start: the base template's Debian rootfs is built once (per machine: the
# shared cache of every clone, as the Makefile's MICROVM_LOCALPLANE_CACHE).
os.environ.setdefault(baseimage.CACHE_ENV, localplane_cache())


def guests_supported():
    try:
        idmap.plane_ranges()
    except idmap.IdmapError:
        return False
    return os.geteuid() == 0 and bool(shutil.which("runc"))


class Plane:
    """A GuestManager driven from synchronous tests through a background event loop."""

    def __init__(self, state_dir):
        self.loop = ThreadedLoop()
        self.state_dir = state_dir
        self.manager = GuestManager(state_dir)
        self.channels = []

    def run(self, coro, timeout=120):
        return self.loop.run(coro, timeout)

    def boot(self, session_id, hostname=None, env=None, rootfs=None, egress=None, size=None):
        return self.run(self.manager.boot(session_id, "sb-" + session_id, rootfs or RootfsSpec("base"), env or {},
                                          egress, hostname or session_id, size=size))

    def stub(self, guest):
        channel = grpc.insecure_channel("unix:" + self.loop.bridge(guest, 8443), options=CHANNEL_OPTIONS)
        self.channels.append(channel)
        return pb2_grpc.SandboxAgentServiceStub(channel)

    def close(self, stop_guests=True):
        for channel in self.channels:
            channel.close()
        self.run(self.manager.shutdown(stop_guests))
        self.loop.close()


class ExecResult:
    def __init__(self, frames):
        self.frames = frames
        self.stdout = b"".join(f.stdout for f in frames if f.WhichOneof("output") == "stdout")
        self.stderr = b"".join(f.stderr for f in frames if f.WhichOneof("output") == "stderr")
        exits = [f.exit for f in frames if f.WhichOneof("output") == "exit"]
        self.exit_count = len(exits)
        self.exit = exits[-1] if exits else None
        self.exit_is_last = bool(frames) and frames[-1].WhichOneof("output") == "exit"

    @property
    def code(self):
        return self.exit.exit_code


def start(argv, **kw):
    return pb2.ExecRequest(start=pb2.ExecStart(argv=argv, **kw))


def run(stub, argv, stdin_frames=(), **kw):
    requests = [start(argv, **kw)] + [pb2.ExecRequest(stdin=s) for s in stdin_frames]
    return ExecResult(list(stub.Exec(iter(requests))))


def sh(stub, script, **kw):
    return run(stub, ["sh", "-c", script], **kw)


class Interactive:
    """An Exec stream whose requests the test sends one by one (None = half-close)."""

    def __init__(self, stub, argv, **kw):
        self.requests = queue.Queue()
        self.requests.put(start(argv, **kw))
        self.call = stub.Exec(iter(self.requests.get, None))

    def send_stdin(self, data):
        self.requests.put(pb2.ExecRequest(stdin=data))

    def send_signal(self, sig):
        self.requests.put(pb2.ExecRequest(signal=pb2.ExecSignal(signal=sig)))

    def half_close(self):
        self.requests.put(None)

    def next_frame(self):
        return next(self.call)

    def rest(self):
        return list(self.call)


def upload(stub, path, data, mode=0, sha=None, is_archive=False, chunk=64 * 1024, end=True):
    requests = [pb2.UploadRequest(header=pb2.UploadHeader(path=path, mode=mode, is_archive=is_archive))]
    requests += [pb2.UploadRequest(chunk=data[i:i + chunk]) for i in range(0, len(data), chunk)]
    if end:
        digest = hashlib.sha256(data).hexdigest() if sha is None else sha
        requests.append(pb2.UploadRequest(end=pb2.UploadEnd(sha256=digest)))
    return stub.Upload(iter(requests))


def download(stub, path, as_archive=False, chunk_size=0):
    frames = list(stub.Download(pb2.DownloadRequest(path=path, as_archive=as_archive, chunk_size_bytes=chunk_size)))
    kinds = [f.WhichOneof("output") for f in frames]
    assert kinds[0] == "header" and kinds[-1] == "end" and set(kinds[1:-1]) <= {"chunk"}, kinds
    data = b"".join(f.chunk for f in frames[1:-1])
    assert frames[-1].end.sha256 == hashlib.sha256(data).hexdigest()
    return frames[0].header, data, [len(f.chunk) for f in frames[1:-1]]


def rpc_error(fn, *args, **kw):
    """Call fn, expecting a gRPC error; -> (code, details)."""
    try:
        result = fn(*args, **kw)
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            list(result)
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("expected a gRPC error, got success")


def wait_until(predicate, limit=30.0, step=0.05):
    """Poll predicate until true; the limit only bounds a hang, it is not what is tested."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def pid_alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


# ------------------------------------------------------------------ network probes

CONNECT = ("import socket,sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()\n"
           "    print('connected')\nexcept OSError as e:\n    print('failed', e)\n")

# The guest's default gateway, from /proc (the base template has no iproute2).
GATEWAY = ("python3 -c \"import socket, struct; print(*[socket.inet_ntoa(struct.pack('<L', int(f[2], 16))) for f in "
           "(l.split() for l in open('/proc/net/route')) if f[1] == '00000000'])\"")


def connect(stub, host, port):
    """A TCP connection from inside the guest: 'connected' or 'failed <reason>'."""
    return run(stub, ["python3", "-c", CONNECT, host, str(port)], timeout_seconds=30).stdout.decode().strip()


def host_addresses():
    """The host's own global IPv4 addresses, guest links (mvl*) aside."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, check=False,
                         text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines() if not line.split()[1].startswith("mvl")]


@contextlib.contextmanager
def outside_peer(networks, port=8080):
    """A listener of the test's own outside the host: its own network namespace behind a veth pair, routed from the
    host like any outside address. networks: /30 networks; on each the host side takes the first address and the
    peer the second. -> [(host address, peer address)], the peer listening on `port` on all of them."""
    tag = uuid.uuid4().hex[:6]
    ns, host_if = "mvtpeer-%s" % tag, "mvp%s" % tag  # never mvl*: that prefix is a guest's link to the host
    pairs = [tuple(str(a) for a in list(ipaddress.ip_network(n).hosts())[:2]) for n in networks]

    def ip(*argv):
        subprocess.run(["ip"] + list(argv), check=True, capture_output=True)
    ip("netns", "add", ns)
    server = None
    try:
        ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        for (host_ip, peer_ip), net in zip(pairs, networks):
            prefix = ipaddress.ip_network(net).prefixlen
            ip("addr", "add", "%s/%d" % (host_ip, prefix), "dev", host_if)
            ip("-n", ns, "addr", "add", "%s/%d" % (peer_ip, prefix), "dev", "eth0")
        ip("link", "set", host_if, "up")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c",
                                   "import socket,time; s=socket.socket(); s.bind(('0.0.0.0', %d)); s.listen(64);"
                                   " time.sleep(3600)" % port])

        def listening():
            with contextlib.suppress(OSError), socket.create_connection((pairs[0][1], port), timeout=1):
                return True
            return False
        assert wait_until(listening), "the outside peer did not listen"
        yield pairs
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", ns], check=False)
        subprocess.run(["ip", "link", "del", host_if], check=False, capture_output=True)
