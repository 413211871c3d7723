# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The small framed protocol between a task worker and the controller's shared multiplexer.

Stdlib only, on purpose: every task runs in a freshly forked worker that
imports the connection plugin anew, so nothing heavy (grpc, websockets,
requests) may be imported on the worker side.

A frame is a 5-byte header (4-byte big-endian payload length, 1-byte kind)
followed by the payload. Control messages carry UTF-8 JSON; data frames carry
raw bytes. A worker opens one unix-socket connection per task, binds it to
its session with "attach" (the session's configuration, API token included:
the socket is reachable only by its user), then sends one request at a time:

    worker -> REQUEST {"op": "attach", "session": {...}}
    mux    -> ACK, RESULT {"label", "session_id", "pid", "generation"} or ERROR

    worker -> REQUEST {"op": "exec", ...}, STDIN*, STDIN_EOF
    mux    -> ACK, STDOUT* / STDERR* (as they arrive), then EXIT or ERROR

    worker -> REQUEST {"op": "warm", "interpreter", "env", "run", "core"}, STDIN*, STDIN_EOF
    mux    -> ACK, then STDOUT* / STDERR*, EXIT, or ERROR (kind warm_refused: run it cold)

    worker -> REQUEST {"op": "tmp", "tmp": {...}, "run"}, STDIN_EOF   (a task tmp dir command, core_compat.tmp_op)
    mux    -> ACK, then STDOUT* / STDERR*, EXIT, or ERROR (kind warm_refused: run the command in a shell)

    worker -> REQUEST {"op": "tmp", "tmp": {...}, "run", "nowait": true, "argv": [...]}, STDIN_EOF   (version 6)
    mux    -> nothing at all, not even the ACK: the worker does not wait for it (a task tmp dir's rm at the task's
              end). The mux serves it in order after the connection's earlier requests, in a shell (argv) when no
              runner takes it, and logs a failure (the session's next attach shows it as "tmp_warnings").

    worker -> REQUEST {"op": "put" | "fetch" | "put_archive", ...}
    mux    -> ACK, RESULT or ERROR
              (version 6: a put's "ahead", [{"op": tmp op, "argv": core's command}], done first; the first that
              fails is answered RESULT {"ahead_failed": {"index", "rc", "stdout", "stderr"}}, nothing written)

    worker -> REQUEST {"op": "hello"}                 (no attach needed)
    mux    -> ACK, RESULT {"pid", "version", "sessions", "served": {how: count}, "served_by_session": {id: {...}}}
              where `how` is what each op was served as: "exec", "warm", "warm_refused", "tmp", "tmp_nowait", "put", ...

    worker -> REQUEST {"op": "reset", "key": <session key>}   (meta: reset_connection; no attach needed)
    mux    -> ACK, RESULT {"reset": true|false}

The worker always ends stdin with STDIN_EOF, even after the EXIT, so the
connection stays in step for the next request.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
from typing import Any

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

# 3: the "tmp" op; a worker uses it only with a mux that says 3 or more. 4: muxes live in versioned dirs
# (_shared/config.py process_dir): a worker only ever talks to a mux of its own protocol. 5: a "warm" request's
# "before" (task tmp dir ops the runner does ahead of the module, in the same request). 6: a request with "nowait"
# gets no answer at all (a task tmp dir's rm); the attach RESULT's "tmp_warnings".
PROTOCOL_VERSION = 6
TMP_OP_VERSION = 3
NOWAIT_VERSION = 6

HEADER = struct.Struct("!IB")
MAX_FRAME = 64 * 1024 * 1024  # a worker never needs more; refuse garbage early

REQUEST = 1
STDIN = 2
STDIN_EOF = 3
STDOUT = 4
STDERR = 5
EXIT = 6
RESULT = 7
ERROR = 8
ACK = 9  # "request taken": before it, a hang-up means the request never reached a mux and is safe to retry

JSON_KINDS = frozenset([REQUEST, EXIT, RESULT, ERROR])

# The error kinds of ERROR frames and the exceptions that carry them are defined once, in _shared/errors.py;
# they are named here too because every user of the frames needs them.
ERR_UNREACHABLE = errors.ERR_UNREACHABLE
ERR_LOST = errors.ERR_LOST
ERR_GONE = errors.ERR_GONE
ERR_NOT_FOUND = errors.ERR_NOT_FOUND
ERR_DENIED = errors.ERR_DENIED
ERR_PATH = errors.ERR_PATH
ERR_FAILED = errors.ERR_FAILED
ERR_PROTOCOL = errors.ERR_PROTOCOL
ERR_WARM = errors.ERR_WARM

SOCKET_NAME = "mux.sock"
PID_NAME = "mux.pid"
LOG_NAME = "mux.log"
LOCK_NAME = "start.lock"


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame, or hung up mid-frame: the connection is broken.

    Like an OSError of the socket, never an error a task sees as such (the worker reports the mux as lost).
    """


class NotAccepted(Exception):
    """The mux hung up before acknowledging a request: it never ran, so it may be retried.

    A signal between the worker's own functions, never an error a task sees (not a SandboxError).
    """


# -- framing -------------------------------------------------------------------

def encode(kind: int, payload: Any = b"") -> bytes:
    if kind in JSON_KINDS and not isinstance(payload, (bytes, bytearray)):
        payload = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    return HEADER.pack(len(payload), kind) + bytes(payload)


def send_frame(sock: socket.socket, kind: int, payload: Any = b"") -> None:
    if kind in JSON_KINDS and not isinstance(payload, (bytes, bytearray)):
        payload = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    header = HEADER.pack(len(payload), kind)
    if len(payload) <= 65536:
        sock.sendall(header + bytes(payload))
    else:  # avoid copying big data frames just to prepend 5 bytes
        sock.sendall(header)
        sock.sendall(payload)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ProtocolError("connection closed after %d of %d bytes" % (got, size))
        got += n
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, Any] | None:
    """Read one frame: (kind, payload). JSON kinds are decoded. None at a clean EOF."""
    first = sock.recv(HEADER.size)
    if not first:
        return None
    if len(first) < HEADER.size:
        first += recv_exact(sock, HEADER.size - len(first))
    length, kind = HEADER.unpack(first)
    if length > MAX_FRAME:
        raise ProtocolError("frame of %d bytes is larger than the limit of %d" % (length, MAX_FRAME))
    payload = recv_exact(sock, length) if length else b""
    if kind in JSON_KINDS:
        try:
            return kind, json.loads(payload.decode("utf-8")) if payload else {}
        except ValueError as e:
            raise ProtocolError("bad JSON in frame kind %d: %s" % (kind, e)) from e
    return kind, payload


# -- where a mux lives ---------------------------------------------------------

def link_key(api_url: str, prefix: str, session: str, agent_port: int | str, token: str | None) -> str:
    """The key of a session's link in the user's muxes: one per (api_url, prefix, session, agent port, token).

    The token's digest is part of the key, so a run with another token never rides on a channel
    opened with this one (and the token itself is never shown: the key is a digest).
    """
    token_digest = hashlib.sha256((token or "").encode("utf-8")).hexdigest()
    text = "\0".join([api_url.rstrip("/"), prefix, session, str(agent_port), token_digest])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def pool_slot(key: str, pool_size: int | str) -> int:
    """Which of the user's `pool_size` mux processes serves the session `key`."""
    return int(key, 16) % max(1, int(pool_size))


def process_start_time(pid: int | str) -> int | None:
    """The start time (clock ticks since boot) of a local process, or None when it is gone.

    With the pid it names one process for good: a pid reused later has another start time.
    """
    try:
        with open("/proc/%d/stat" % int(pid), "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    # the command name may contain spaces and parentheses: split after the last ')'
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int | str, start: int | str | None) -> bool:
    """Whether process `pid` still runs and is the one that started at `start` (when given)."""
    current = process_start_time(pid)
    return current is not None and (not start or str(current) == str(start))


# sun_path holds 108 bytes: a socket whose path is longer is bound and reached through an opened descriptor of
# its directory (/proc/self/fd/<fd>/<name>, Linux), never through a short shared name another user could take first.
SUN_PATH_MAX = 100
PROC_FD = "/proc/self/fd"
FIX_DIR = "set the connection option mux_dir (env MICROVM_MUX_DIR) to a directory of your own"


def _refuse(path: str, why: str) -> errors.UnusableDirectory:
    return errors.UnusableDirectory("the connection multiplexer cannot use %s: %s; remove it, or %s" % (path, why, FIX_DIR))


def _check_private(path: str, st: os.stat_result) -> None:
    """Refuse a directory that is not this user's own: a symlink, a file, another owner, a mode other than 0700."""
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "it is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory")
    if st.st_uid != os.getuid():
        raise _refuse(path, "it is owned by uid %d, not by this user (uid %d)" % (st.st_uid, os.getuid()))
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise _refuse(path, "its mode is %04o, not 0700" % stat.S_IMODE(st.st_mode))


def private_dir(path: str) -> str:
    """Create (or tighten to 0700) a directory only this user can use; anything else is an UnusableDirectory."""
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise _refuse(path, "it cannot be created (%s)" % (e.strerror or e)) from e
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
        try:
            os.chmod(path, 0o700, follow_symlinks=False)
        except OSError as e:
            raise _refuse(path, "its mode %04o cannot be made 0700 (%s)" % (stat.S_IMODE(st.st_mode), e.strerror or e)) from e
        st = os.lstat(path)
    _check_private(path, st)
    return path


class SocketDir:
    """An opened private directory (checked through the descriptor itself): where its sockets are bound and reached.

    On Linux a socket's address goes through the descriptor (/proc/self/fd/<fd>/<name>), so it is short whatever
    the directory's path and names exactly the directory that was checked. The address stays valid while the
    SocketDir is open: close it only after the socket's last bind or connect. FileNotFoundError when the
    directory does not exist.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd: int | None = os.open(path, flags)
        except FileNotFoundError:
            raise
        except OSError as e:  # ELOOP: a symlink; ENOTDIR: a file
            raise _refuse(path, "it cannot be opened as a directory of its own (%s)" % (e.strerror or e)) from e
        try:
            _check_private(path, os.fstat(self.fd))
        except errors.UnusableDirectory:
            self.close()
            raise

    def address(self, name: str) -> str:
        """The address to bind or connect the socket `name` of this directory with."""
        if self.fd is None:
            raise ValueError("the directory %s is closed" % self.path)
        if os.path.isdir(PROC_FD):
            return "%s/%d/%s" % (PROC_FD, self.fd, name)
        path = os.path.join(self.path, name)
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            raise errors.UnusableDirectory("the socket path %s is too long for a unix socket (%d bytes, at most %d "
                                           "here); %s with a shorter path" % (path, len(os.fsencode(path)), SUN_PATH_MAX, FIX_DIR))
        return path

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> SocketDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def connect(path: str, timeout: float | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    sock.settimeout(None)
    return sock


def connect_in(directory: str, name: str = SOCKET_NAME, timeout: float | None = None) -> socket.socket:
    """Connect to the socket `name` of the private `directory` (checked first; FileNotFoundError if either is missing)."""
    with SocketDir(directory) as d:
        return connect(d.address(name), timeout)


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED), or None where unsupported."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
