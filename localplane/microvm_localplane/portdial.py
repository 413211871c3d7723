"""The host side of the port bridge: the listening socket PID 1 serves, and dialling a guest port.

See guest_init.py for the guest side. The socket lives in the session's
host-only dir, so the host never follows a path the guest controls.
"""
import asyncio
import contextlib
import os
import socket

from .errors import DialError

DIAL_TIMEOUT = 3.0         # the guest answers at once unless it is frozen or wedged
BRIDGE_NAME = "bridge.sock"


async def _recv_fd(loop, sock):
    """Wait for one message from a non-blocking unix socket; -> (bytes, [fds])."""
    fut = loop.create_future()

    def on_readable():
        if fut.done():
            return
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 256, 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            fut.set_exception(e)
            return
        fut.set_result((msg, fds))

    loop.add_reader(sock.fileno(), on_readable)
    try:
        return await fut
    finally:
        loop.remove_reader(sock.fileno())


def _short_path(dir_fd, name):
    # Unix socket paths are limited to 107 bytes; the state dir may be deep, so go through a dir fd.
    return "/proc/self/fd/%d/%s" % (dir_fd, name)


def listen_bridge(layout):
    """The guest's bridge socket, created by the host in its host-only dir; -> listening socket."""
    path = os.path.join(layout.host, layout.bridge_name)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    dir_fd = os.open(layout.host, os.O_PATH | os.O_DIRECTORY)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_short_path(dir_fd, layout.bridge_name))
        os.chmod(path, 0o600)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dir_fd)
    return sock


async def dial_bridge(host_dir, port, timeout=DIAL_TIMEOUT):
    """Ask the guest's PID 1 (through <host_dir>/bridge.sock) for a socket connected to guest port."""
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise DialError("invalid port: %r" % (port,))
    loop = asyncio.get_running_loop()
    try:
        dir_fd = os.open(host_dir, os.O_PATH | os.O_DIRECTORY)
    except OSError as e:
        raise DialError("guest is not running") from e
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        try:
            await loop.sock_connect(sock, _short_path(dir_fd, BRIDGE_NAME))
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise DialError("guest is not running") from e
        finally:
            os.close(dir_fd)
        try:
            await loop.sock_sendall(sock, b"port %d\n" % port)
            msg, fds = await asyncio.wait_for(_recv_fd(loop, sock), timeout)
        except asyncio.TimeoutError as e:
            raise DialError("guest did not answer within %.0f s (paused or overloaded)" % timeout) from e
        except OSError as e:
            raise DialError("guest bridge failed: %s" % e) from e
    finally:
        sock.close()
    if msg.startswith(b"OK") and fds:
        for extra in fds[1:]:
            os.close(extra)
        return socket.socket(fileno=fds[0])
    for fd in fds:
        os.close(fd)
    reason = msg[4:].decode(errors="replace").strip() if msg.startswith(b"ERR") else "guest closed the bridge"
    raise DialError(reason or "dial failed")
