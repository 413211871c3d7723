"""A warm agent process that forks a ready agent into a booting guest.

Why: a fresh Python that imports grpc and the stubs takes ~0.3 s on this kind
of machine, longer than the whole create-to-READY budget, and 50 idle agents
would each hold their own copy of those modules. The zygote imports them once
(no gRPC core, no threads), then for each guest forks a child that

1. joins the guest's cgroups (so freeze, memory and stop reach it),
2. enters the guest's namespaces (user-visible: uts, ipc, net, cgroup, pid,
   mount; the mount namespace last, which also moves its root and cwd to the
   guest's root),
3. forks twice more so the agent is a member of the guest's PID namespace
   and a child of the guest's PID 1 (see spawn()),
4. drops to the guest's capability set (the same as bubblewrap gives guest
   processes), sets no_new_privs and its own session, points stdio at
   /run/localplane/agent.log *inside* the guest, and serves.

From then on the agent sees only guest paths, exactly like one started by the
guest's PID 1 (which still starts one itself if this path fails, see
guest_init --external-agent).

Protocol on stdin/stdout: one JSON line per request
{"init_pid"} -> one JSON line {"ok": true, "pid"} or {"ok": false, "error"}.
No session data ever passes through the zygote: every agent is a copy of its
memory, so whatever it held would be readable in the next session's guest.
The agent reads the session's env from its own guest's run dir.
"""
import ctypes
import json
import os
import sys

from . import agent

# What grpc.server() imports on first use: import it here once, not in every agent.
import concurrent.futures.thread  # noqa: E402,F401
import queue  # noqa: E402,F401

import grpc._server  # noqa: E402,F401
from .rootfs import GUEST_CAPS, GUEST_RUN_DIR

# Referenced so that linters see the pre-imports above as used: they exist only to be
# loaded in the zygote's memory before it forks, so no agent child pays for them.
_PRELOADED = (concurrent.futures.thread, queue, grpc._server)

NAMESPACES = (("uts", 0x04000000), ("ipc", 0x08000000), ("net", 0x40000000), ("cgroup", 0x02000000),
              ("pid", 0x20000000), ("mnt", 0x00020000))
PR_SET_NAME = 15
CGROUP_CONTROLLERS = ("freezer", "memory")
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 47, 2
CAP_VERSION_3 = 0x20080522
CAP_NUMBERS = {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_FSETID": 4, "CAP_KILL": 5,
               "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_RAW": 13,
               "CAP_SYS_CHROOT": 18, "CAP_AUDIT_WRITE": 29, "CAP_SETFCAP": 31}

libc = ctypes.CDLL(None, use_errno=True)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def drop_capabilities(keep):
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    kept = [CAP_NUMBERS[c] for c in keep]
    for cap in range(last + 1):
        if cap not in kept:
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability %d" % cap)
    mask = sum(1 << c for c in kept)
    data = (CapData * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = mask & 0xFFFFFFFF
    data[1].effective = data[1].permitted = data[1].inheritable = mask >> 32
    _check(libc.capset(ctypes.byref(CapHeader(CAP_VERSION_3, 0)), data), "capset")
    for cap in kept:  # ambient: programs the agent runs keep the same set, as under bubblewrap
        _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0), "ambient capability %d" % cap)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def guest_cgroups(init_pid):
    """cgroup.procs of the freezer and memory groups the guest's PID 1 is in (read, not told:
    nothing about other sessions needs to pass through the zygote)."""
    paths = []
    with open("/proc/%d/cgroup" % init_pid) as f:
        for line in f:
            _hierarchy_id, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                if c in CGROUP_CONTROLLERS:
                    paths.append(os.path.join("/sys/fs/cgroup", c, path.lstrip("/"), "cgroup.procs"))
    return paths


def enter_guest(init_pid):
    """In the forked child: join cgroups and namespaces of the guest whose PID 1 is init_pid (host pid)."""
    for path in guest_cgroups(init_pid):
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    fds = [(os.open("/proc/%d/ns/%s" % (init_pid, name), os.O_RDONLY), flag) for name, flag in NAMESPACES]
    try:
        for fd, flag in fds:
            _check(libc.setns(fd, flag), "setns %#x" % flag)
    finally:
        for fd, _events in fds:
            os.close(fd)


def become_agent():
    """In the grandchild, a member of the guest: detach, confine, serve. Never returns."""
    code = 0
    try:
        os.setsid()
        os.chdir("/")
        log = os.open(os.path.join(GUEST_RUN_DIR, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, 65536)
        drop_capabilities(GUEST_CAPS)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(b"sandbox-agent"), 0, 0, 0)
        agent.serve()
    except BaseException as e:  # noqa: B036 - a forked child must never return into the zygote's loop
        try:
            sys.stderr.write("agent (zygote child) failed: %s\n" % e)
            sys.stderr.flush()
        except Exception:
            pass
        code = 1
    finally:
        os._exit(code)


def spawn(request):
    """Fork the agent into a guest; -> {"ok": True, "pid": <agent pid in the guest>} or an error.

    zygote -> A (enters the namespaces; its own pid stays a host pid) -> B (the
    first process in the guest's PID namespace) -> C, the agent. B exits at
    once, so the kernel hands C to the guest's PID 1, which reaps and watches
    it like any orphan of the guest (and nothing is left for the zygote).
    """
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        status = 1
        try:
            os.close(r)
            enter_guest(int(request["init_pid"]))
            b = os.fork()
            if b == 0:
                agent_pid = os.fork()
                if agent_pid == 0:
                    os.close(w)
                    become_agent()
                os.write(w, json.dumps({"ok": True, "pid": agent_pid}).encode())
                os._exit(0)
            status = 0 if os.waitpid(b, 0)[1] == 0 else 1
        except BaseException as e:  # noqa: B036 - a forked child must never return into the zygote's loop
            try:
                os.write(w, json.dumps({"ok": False, "error": str(e)}).encode())
            except OSError:
                pass
        finally:
            os._exit(status)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read()
    os.waitpid(child, 0)
    return json.loads(answer or b'{"ok": false, "error": "zygote child died"}')


def main():
    stdin = sys.stdin.buffer
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    buf = b""
    while True:
        data = os.read(stdin.fileno(), 65536)
        if not data:
            return  # the manager is gone; the agents we placed live on
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                answer = spawn(json.loads(line))
            except Exception as e:
                answer = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
            out.write(json.dumps(answer) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
