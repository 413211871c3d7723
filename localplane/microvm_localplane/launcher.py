"""A warm launcher that starts guests with one exec (bwrap) instead of six.

The shell path (`unshare` + `sh` + three `mount` + `bwrap`) costs an exec and a
dynamic link of each tool: ~0.05 s of a boot on a busy 2-core machine. This
process (standard library + ctypes, no session data kept) forks one child per
guest, which does the same work with system calls and execs bwrap:

1. own session; joins the guest's cgroups (everything it starts is in them),
2. a private mount namespace with the overlay mounts (never visible on the host),
3. the bridge socket bound in the session's host-only dir, passed to PID 1,
4. stdio to the guest log, bwrap's --info-fd on fd 3, then exec bwrap.

The launcher reaps its children (bwrap's monitor process). Its own memory
never reaches a guest: every child execs at once.

Protocol on stdin/stdout, one JSON line each way:
{"argv", "env", "cgroup_procs", "mounts": [[lowerdir_opts, target]], "log", "info", "bridge"}
-> {"ok": true, "pid"} or {"ok": false, "error"}.
"""
import ctypes
import json
import os
import select
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
BRIDGE_FD_PLACEHOLDER = "{bridge_fd}"

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _bind_bridge(path):
    """Listening unix socket at path (through a dir fd: the 107-byte limit)."""
    dir_fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
    try:
        short = "/proc/self/fd/%d/%s" % (dir_fd, os.path.basename(path))
        try:
            os.unlink(short)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(short)
        os.chmod(path, 0o600)
        sock.listen(128)
        return sock
    finally:
        os.close(dir_fd)


def start_guest(req):
    """In the forked child: prepare everything, exec bwrap. Never returns."""
    try:
        os.setsid()
        for path in req["cgroup_procs"]:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        _check(libc.unshare(CLONE_NEWNS), "unshare")
        _check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        for opts, target in req["mounts"]:
            _check(libc.mount(b"overlay", target.encode(), b"overlay", 0, opts.encode()), "mount overlay on %s" % target)
        bridge = _bind_bridge(req["bridge"])
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        info = os.open(req["info"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(info, 3)
        bridge_fd = os.dup2(bridge.fileno(), 4)
        os.closerange(5, 65536)
        os.set_inheritable(3, True)
        os.set_inheritable(bridge_fd, True)
        argv = [str(bridge_fd) if a == BRIDGE_FD_PLACEHOLDER else a for a in req["argv"]]
        os.execve(argv[0], argv, req["env"])
    except BaseException as e:  # noqa: B036 - a forked child must never return into the launcher's loop
        try:
            os.write(2, ("launcher: cannot start the guest: %s\n" % e).encode())
        finally:
            os._exit(127)


def launch(req):
    pid = os.fork()
    if pid == 0:
        start_guest(req)
    return {"ok": True, "pid": pid}


def reap():
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main():
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_signal_args: None)
    stdin = sys.stdin.buffer.fileno()
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    buf = b""
    while True:
        ready, _writable, _exceptional = select.select([stdin, wake_r], [], [])
        if wake_r in ready:
            try:
                os.read(wake_r, 512)
            except BlockingIOError:
                pass
            reap()
        if stdin not in ready:
            continue
        data = os.read(stdin, 65536)
        if not data:
            return  # the manager is gone; guests live on (and are adopted by the next one)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                answer = launch(json.loads(line))
            except Exception as e:
                answer = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
