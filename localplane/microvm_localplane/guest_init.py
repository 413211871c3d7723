"""PID 1 of a guest: reaps orphans, keeps the agent running, and bridges ports to the host.

Runs inside the guest (runc's PID 1) with the guest's Python and the standard
library only, started with `python -I -S` and few imports, so it is up in a few
milliseconds.

Port bridge: the host creates a listening unix socket in a host-only directory
and passes it to this process (`--bridge-fd N`): the guest can neither see nor
replace the socket file, so the host never follows a path the guest controls.
The host connects to it and sends one line `port N\\n`. PID 1
connects to 127.0.0.1:N inside the guest's network namespace and answers
`OK\\n` with the connected socket attached (SCM_RIGHTS), or `ERR <reason>\\n`.
The socket keeps its namespace, so the host then talks to the guest port
directly: no bytes pass through this process.
"""
import os
import select
import signal
import socket
import sys
import threading
import time

REQUEST_MAX = 64
REQUEST_TIMEOUT = 5.0
CONNECT_TIMEOUT = 5.0
RESPAWN_MIN, RESPAWN_MAX = 0.2, 5.0
# PID 1's name in /proc/1/comm, which tools read to tell the init system (ansible's service_mgr fact); without it
# the name is that of the dynamic loader the plane's Python is started through ("ld-linux-x86-64").
PID1_NAME = "guest_init"


def log(msg):
    try:
        sys.stderr.write("guest_init: %s\n" % msg)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # the console is on the guest's disk, which the guest may have filled: PID 1 carries on


def parse_request(data):
    """b'port 8443\\n' -> 8443; ValueError with a reason otherwise."""
    line = data.split(b"\n", 1)[0].strip()
    parts = line.split()
    if len(parts) != 2 or parts[0] != b"port" or not parts[1].isdigit():
        raise ValueError("bad request (expected 'port N')")
    port = int(parts[1])
    if not 1 <= port <= 65535:
        raise ValueError("port out of range: %d" % port)
    return port


def read_request(conn):
    conn.settimeout(REQUEST_TIMEOUT)
    data = b""
    while b"\n" not in data and len(data) < REQUEST_MAX:
        chunk = conn.recv(REQUEST_MAX - len(data))
        if not chunk:
            break
        data += chunk
    return data


def handle_bridge(conn):
    tcp = None
    try:
        try:
            port = parse_request(read_request(conn))
        except (ValueError, OSError) as e:
            conn.sendall(b"ERR %s\n" % str(e).encode())
            return
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.settimeout(CONNECT_TIMEOUT)
        try:
            tcp.connect(("127.0.0.1", port))
        except OSError as e:
            reason = "connection refused" if isinstance(e, ConnectionRefusedError) else (e.strerror or str(e))
            conn.sendall(b"ERR guest port %d: %s\n" % (port, reason.encode()))
            return
        tcp.settimeout(None)
        socket.send_fds(conn, [b"OK\n"], [tcp.fileno()])
    except OSError:
        pass  # the host went away mid-request: nothing to answer
    finally:
        if tcp is not None:
            tcp.close()
        conn.close()


class Supervisor:
    """Keeps one agent running and reaps every orphan in the guest."""

    def __init__(self, agent_argv):
        self.agent_argv = agent_argv
        self.agent_pid = None
        self.agent_started = 0.0
        self.backoff = RESPAWN_MIN
        self.respawn_at = None

    def start_agent(self):
        try:
            self.agent_pid = os.posix_spawn(self.agent_argv[0], self.agent_argv, os.environ)
            self.agent_started = time.monotonic()
        except OSError as e:
            log("cannot start the agent: %s" % e)
            self.schedule_respawn()

    def schedule_respawn(self):
        if time.monotonic() - self.agent_started > 10:
            self.backoff = RESPAWN_MIN
        self.respawn_at = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, RESPAWN_MAX)

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.agent_pid:
                log("agent (pid %d) exited with status %d; restarting" % (pid, status))
                self.agent_pid = None
                self.schedule_respawn()

    def tick(self):
        if self.respawn_at is not None and time.monotonic() >= self.respawn_at:
            self.respawn_at = None
            self.start_agent()

    def next_timeout(self):
        if self.respawn_at is None:
            return None
        return max(0.0, self.respawn_at - time.monotonic())


def name_self(name=PID1_NAME):
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass  # a name is a courtesy: PID 1 works without it


def inherited_listener(fd):
    sock = socket.socket(fileno=fd)
    os.set_inheritable(fd, False)  # nothing PID 1 starts may hold the bridge
    return sock


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    bridge_fd = None
    while argv and argv[0].startswith("--"):
        opt = argv.pop(0)
        if opt == "--run-dir":
            argv.pop(0)  # the agent finds its run dir on its own
        elif opt == "--bridge-fd":
            bridge_fd = int(argv.pop(0))
        elif opt == "--":
            break
    agent_argv = argv or [sys.executable, "-m", "microvm_localplane.agent"]
    name_self()

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_signal_args: None)
    # PID 1 ignores signals it has no handler for; stop on SIGTERM like an init would.
    signal.signal(signal.SIGTERM, lambda *_signal_args: sys.exit(0))

    if bridge_fd is None:
        log("--bridge-fd is required")
        sys.exit(2)
    server = inherited_listener(bridge_fd)
    supervisor = Supervisor(agent_argv)
    supervisor.start_agent()

    while True:
        try:
            ready, _writable, _exceptional = select.select([server, wake_r], [], [], supervisor.next_timeout())
        except InterruptedError:
            ready = []
        if wake_r in ready:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
            supervisor.reap()
        if server in ready:
            try:
                conn, _peer = server.accept()
            except OSError:
                conn = None
            if conn is not None:
                threading.Thread(target=handle_bridge, args=(conn,), daemon=True).start()
        supervisor.tick()


if __name__ == "__main__":
    main()
