"""The sandbox agent: SandboxAgentService (contract section 3) served on 0.0.0.0:8443 inside a guest.

It runs inside the guest, so every path it touches is a real guest path:
`..` and symlinks are resolved as the guest's own realpath would, one held
directory fd per component (beneath.py), before the /workspace confinement
check, and the write happens through those very fds: nothing can move it
elsewhere between the check and the write. Archives are checked whole before
anything is extracted (agentarchive.py).

Decisions the contract leaves open live in this module's constants and in
`confine()`; keep them here so they are easy to change:
- a command killed by signal N reports exit code 128+N (shell convention);
- a program that cannot be started ends with 127 (not found) or 126 (not
  executable, bad workdir) and the reason on stderr;
- timeouts send SIGTERM to the process group, then SIGKILL after KILL_GRACE;
- an Upload checksum mismatch is INVALID_ARGUMENT (REST answers 400 for it);
- a directory Download without as_archive, or of a non-regular file, is
  FAILED_PRECONDITION; Download archives are the directory's contents
  (member names relative to it), the same shape Upload(is_archive) extracts.
"""
import errno
import functools
import hashlib
import inspect
import json
import os
import pwd
import select
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
from concurrent import futures

# The agent never uses Python's ssl module (gRPC is plaintext and brings its own TLS);
# asyncio imports it when present, which costs ~80 ms of every guest boot.
if "ssl" not in sys.modules:
    sys.modules["ssl"] = None

import grpc  # noqa: E402

from . import agentarchive  # noqa: E402
from .agentarchive import tar_stream  # noqa: E402
from .baseimage import ACCOUNT_PASSWORD_VARS  # noqa: E402
from .beneath import DIR, MISSING, Outside, TooLong, Walk, check_lengths, open_beneath  # noqa: E402
from .pb import pb2, pb2_grpc  # noqa: E402

WORKSPACE = "/workspace"
WORKSPACE_NAMES = ("workspace",)
RUN_DIR = "/run/localplane"
HOME = "/workspace/home"
LISTEN = "0.0.0.0:8443"
BASELINE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": HOME,
    "LANG": "C.UTF-8",
    "USER": "root",
    "LOGNAME": "root",
    "SHELL": "/bin/sh",
}
SESSION_ENV_FILE = "session-env.json"   # in RUN_DIR, written by the host at every boot
EXIT_NOT_FOUND, EXIT_CANNOT_EXECUTE = 127, 126
KILL_GRACE = 2.0            # seconds between SIGTERM and SIGKILL on timeout
DRAIN_GRACE = 1.0           # how long to keep relaying output after the command exits (background children holding the pipe)
READ_SIZE = 64 * 1024
CHUNK_DEFAULT, CHUNK_MIN, CHUNK_MAX = 256 * 1024, 1024, 4 * 1024 * 1024
MAX_MESSAGE = 16 * 1024 * 1024
SHA256_HEX = set("0123456789abcdef")


class Refusal(Exception):
    """A request the agent refuses: carries the gRPC status code and message."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(msg):
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, msg)


def oserror_refusal(e, path):
    """Map a filesystem error on a guest path to a status with a clear message."""
    reason = e.strerror or str(e)
    code = {
        errno.ENOENT: grpc.StatusCode.NOT_FOUND,
        errno.ENOTDIR: grpc.StatusCode.FAILED_PRECONDITION,
        errno.EISDIR: grpc.StatusCode.FAILED_PRECONDITION,
        errno.EEXIST: grpc.StatusCode.FAILED_PRECONDITION,
        errno.ENOSPC: grpc.StatusCode.RESOURCE_EXHAUSTED,
        errno.EDQUOT: grpc.StatusCode.RESOURCE_EXHAUSTED,
        errno.EACCES: grpc.StatusCode.PERMISSION_DENIED,
        errno.EPERM: grpc.StatusCode.PERMISSION_DENIED,
        errno.EROFS: grpc.StatusCode.FAILED_PRECONDITION,
        errno.ELOOP: grpc.StatusCode.FAILED_PRECONDITION,
        errno.ENAMETOOLONG: grpc.StatusCode.INVALID_ARGUMENT,
    }.get(e.errno, grpc.StatusCode.INTERNAL)
    return Refusal(code, '%s: "%s"' % (reason, path))


def check_path(path):
    """The syntactic checks of a transfer path (contract section 3, Confinement)."""
    if not path:
        raise invalid("path is required")
    if "\0" in path:
        raise invalid("path contains a NUL byte")
    if not path.startswith("/"):
        raise invalid('path must be absolute: "%s"' % path)


def outside(path):
    return Refusal(grpc.StatusCode.PERMISSION_DENIED, 'path outside workspace: "%s"' % path)


def confine(walk, path, follow_last=True):
    """Resolve path like the guest does, one held directory fd per component -> beneath.Resolved under /workspace.

    The fds of the result are what later writes use, so nothing can move the write elsewhere after this check.
    """
    check_path(path)
    try:
        check_lengths(path, walk.name_max)
        resolved = walk.resolve(path, follow_last)
        if not resolved.within(WORKSPACE_NAMES):
            raise Outside(path)
        check_lengths(resolved.logical, walk.name_max)  # what the links lead to must be addressable too
    except Outside as e:
        raise outside(path) from e
    except TooLong as e:
        raise invalid('%s ("%s" is refused, nothing was created)' % (e, path[:200])) from e
    except OSError as e:
        raise oserror_refusal(e, path) from e
    return resolved


def check_sha256(expected, actual):
    if not expected:
        return
    if len(expected) != 64 or not set(expected.lower()) <= SHA256_HEX:
        raise invalid("sha256 must be 64 hex digits, got %r" % expected[:80])
    if expected.lower() != actual:
        raise invalid("sha256 mismatch: expected %s, received data has %s" % (expected.lower(), actual))


def refusing(handler):
    """Turn Refusal and stray errors into gRPC statuses (works for unary and streaming handlers)."""
    if inspect.isgeneratorfunction(handler):
        @functools.wraps(handler)
        def gen_wrapper(self, request, context):
            try:
                yield from handler(self, request, context)
            except Refusal as r:
                context.abort(r.code, r.message)
            except grpc.RpcError:
                raise
            except Exception as e:  # never let a client crash the agent
                if context.is_active():
                    context.abort(grpc.StatusCode.INTERNAL, "%s: %s" % (type(e).__name__, e))
        return gen_wrapper

    @functools.wraps(handler)
    def wrapper(self, request, context):
        try:
            return handler(self, request, context)
        except Refusal as r:
            context.abort(r.code, r.message)
        except grpc.RpcError:
            raise
        except Exception as e:
            context.abort(grpc.StatusCode.INTERNAL, "%s: %s" % (type(e).__name__, e))
    return wrapper


# ---------------------------------------------------------------- Exec

def validate_start(start):
    argv = list(start.argv)
    if not argv:
        raise invalid("ExecStart.argv is empty")
    if any("\0" in a for a in argv):
        raise invalid("ExecStart.argv contains a NUL byte")
    workdir = start.workdir or WORKSPACE
    if "\0" in workdir or not workdir.startswith("/"):
        raise invalid('ExecStart.workdir must be an absolute path: "%s"' % workdir)
    if start.timeout_seconds < 0:
        raise invalid("ExecStart.timeout_seconds must not be negative")
    for k, v in start.env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise invalid("ExecStart.env has an invalid entry: %r" % k)
    return argv, workdir


def exit_code_of(returncode):
    return 128 - returncode if returncode < 0 else returncode


def exit_frame(code, started, timed_out=False):
    return pb2.ExecOutput(exit=pb2.ExecExit(exit_code=code, duration_ms=int((time.monotonic() - started) * 1000),
                                            timed_out=timed_out))


def kill_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class StdinFeeder(threading.Thread):
    """Consumes the rest of the request stream: stdin in order, half-close = EOF, signals to the group."""

    def __init__(self, requests, proc):
        super().__init__(daemon=True)
        self.requests = requests
        self.proc = proc

    def run(self):
        stdin = self.proc.stdin
        try:
            for req in self.requests:
                kind = req.WhichOneof("request")
                if kind == "stdin":
                    if stdin is not None and req.stdin:
                        try:
                            stdin.write(req.stdin)
                            stdin.flush()
                        except (BrokenPipeError, OSError, ValueError):
                            stdin = self._close(stdin)  # the command closed its stdin; keep reading for signals
                elif kind == "signal":
                    sig = req.signal.signal
                    if 1 <= sig < signal.NSIG:
                        kill_group(self.proc.pid, sig)
                # A second `start` is ignored: one command per stream.
        except Exception:
            pass  # the client went away; the handler sees it too
        finally:
            self._close(stdin)

    @staticmethod
    def _close(stdin):
        if stdin is not None:
            try:
                stdin.close()
            except OSError:
                pass
        return None


def set_passwords(env, done):
    """Give the guest's users the passwords the session sets (ACCOUNT_PASSWORD_VARS), with the guest's
    own chpasswd, then set `done`. Runs beside the server (hashing takes tens of ms): commands wait for it."""
    try:
        lines = []
        for var, user in ACCOUNT_PASSWORD_VARS:
            password = env.get(var)
            if not password:
                continue
            if "\n" in password or "\r" in password:
                sys.stderr.write("agent: %s holds more than one line: %s's password not set\n" % (var, user))
                continue
            try:
                pwd.getpwnam(user)
            except KeyError:
                sys.stderr.write("agent: %s is set but this guest has no user %s\n" % (var, user))
                continue
            lines.append("%s:%s\n" % (user, password))
        if lines:
            try:
                proc = subprocess.run(["chpasswd"], input="".join(lines).encode(), env=BASELINE_ENV,
                                      capture_output=True, timeout=60, check=False)
                if proc.returncode != 0:  # its message names the user, never the password
                    sys.stderr.write("agent: chpasswd failed: %s\n" % proc.stderr.decode(errors="replace").strip())
            except (OSError, subprocess.SubprocessError) as e:
                sys.stderr.write("agent: cannot set the session's passwords: %s\n" % e)
    finally:
        done.set()


class AgentService(pb2_grpc.SandboxAgentServiceServicer):
    def __init__(self, session_env=None, accounts_ready=None):
        self.baseline_env = dict(BASELINE_ENV)
        self.baseline_env.update(session_env or {})
        self.accounts_ready = accounts_ready

    @refusing
    def Exec(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("request") != "start":
            raise invalid("the first ExecRequest must be start")
        argv, workdir = validate_start(first.start)
        if self.accounts_ready is not None:
            self.accounts_ready.wait(60)  # a become right after boot needs the session's passwords in place
        env = dict(self.baseline_env)
        env.update(first.start.env)
        timeout = first.start.timeout_seconds
        started = time.monotonic()

        if not os.path.isdir(workdir):
            yield pb2.ExecOutput(stderr=('workdir "%s": not a directory or does not exist\n' % workdir).encode())
            yield exit_frame(EXIT_CANNOT_EXECUTE, started)
            return
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, bufsize=0)
        except OSError as e:
            code = EXIT_NOT_FOUND if e.errno == errno.ENOENT else EXIT_CANNOT_EXECUTE
            yield pb2.ExecOutput(stderr=('exec "%s": %s\n' % (argv[0], e.strerror or e)).encode())
            yield exit_frame(code, started)
            return

        done = threading.Event()

        def on_rpc_end():
            # Client cancelled or the stream broke before the command ended: kill its group.
            if not done.is_set() and proc.poll() is None:
                kill_group(proc.pid, signal.SIGKILL)

        context.add_callback(on_rpc_end)
        StdinFeeder(request_iterator, proc).start()
        try:
            yield from self._relay(proc, timeout, started)
        finally:
            done.set()
            if proc.poll() is None:  # the generator was closed early (cancel)
                kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
            for f in (proc.stdout, proc.stderr):
                f.close()

    def _relay(self, proc, timeout, started):
        """Stream stdout/stderr as produced; the exit frame last, exactly once."""
        streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        pidfd = os.pidfd_open(proc.pid)
        poller = select.poll()  # not select(): no limit on fd numbers
        for fd in (*streams, pidfd):
            poller.register(fd, select.POLLIN)
        deadline = started + timeout if timeout > 0 else None
        timed_out = False
        kill_at = None
        exited_at = None
        try:
            while True:
                now = time.monotonic()
                if exited_at is None:
                    if deadline is not None and not timed_out and now >= deadline:
                        timed_out = True
                        kill_group(proc.pid, signal.SIGTERM)
                        kill_at = now + KILL_GRACE
                    if kill_at is not None and now >= kill_at:
                        kill_group(proc.pid, signal.SIGKILL)
                        kill_at = None
                elif not streams or now - exited_at >= DRAIN_GRACE:
                    break
                waits = [t for t in (None if timed_out else deadline, kill_at,
                                     exited_at + DRAIN_GRACE if exited_at is not None else None) if t is not None]
                wait_ms = max(0, int((min(waits) - now) * 1000) + 1) if waits else None
                for fd, _events in poller.poll(wait_ms):
                    if fd == pidfd:
                        proc.wait()
                        exited_at = time.monotonic()
                        poller.unregister(pidfd)
                        if timed_out:
                            # the leader is gone; whatever it left in its group goes too
                            kill_group(proc.pid, signal.SIGKILL)
                        continue
                    data = os.read(fd, READ_SIZE)
                    if not data:
                        poller.unregister(fd)
                        del streams[fd]
                    elif streams[fd] == "stdout":
                        yield pb2.ExecOutput(stdout=data)
                    else:
                        yield pb2.ExecOutput(stderr=data)
        finally:
            os.close(pidfd)
        yield exit_frame(exit_code_of(proc.returncode), started, timed_out)

    # ------------------------------------------------------------ Upload

    @refusing
    def Upload(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("request") != "header":
            raise invalid("the first UploadRequest must be header")
        header = first.header
        with Walk() as walk:
            target = confine(walk, header.path)
            if header.is_archive:
                written = self._upload_archive(request_iterator, walk, header.path, target)
            else:
                written = self._upload_file(request_iterator, walk, header, target)
        return pb2.UploadResponse(path=header.path, bytes_written=written)

    def _receive(self, request_iterator, out):
        """Write chunks to `out` until UploadEnd; -> bytes written. Refuses a stream without an end."""
        digest = hashlib.sha256()
        size = 0
        for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "chunk":
                chunk = req.chunk  # each attribute access copies the bytes: take them once
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            elif kind == "end":
                check_sha256(req.end.sha256, digest.hexdigest())
                return size
            else:
                raise invalid("UploadRequest.%s after the header" % kind)
        raise invalid("upload stream ended without UploadEnd")

    def _upload_file(self, request_iterator, walk, header, target):
        mode = (header.mode & 0o7777) or 0o644
        if target.final.kind == DIR:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, 'is a directory: "%s"' % header.path)
        name = target.final.name
        try:
            parent = walk.parent_fd(target)
            tmp = ".%s.upload-%s" % (name[:100], os.urandom(6).hex())
            fd = open_beneath(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, parent, 0o600)
        except OSError as e:
            raise oserror_refusal(e, header.path) from e
        try:
            with os.fdopen(fd, "wb") as out:
                size = self._receive(request_iterator, out)
                out.flush()
                if os.fstat(out.fileno()).st_size != size:
                    raise Refusal(grpc.StatusCode.DATA_LOSS, "short write to %s" % header.path)
                os.fchmod(out.fileno(), mode)
            # Renamed within the directory fd that was checked: a swapped name cannot redirect it.
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            return size
        except OSError as e:
            self._remove(tmp, parent)
            raise oserror_refusal(e, header.path) from e
        except BaseException:
            self._remove(tmp, parent)
            raise

    def _upload_archive(self, request_iterator, walk, given, target):
        # Spool first (constant memory, unlinked at once so nothing is left even if the agent dies), verify the
        # checksum, check every member, then extract: a bad or refused archive creates nothing. The spool lives
        # in the nearest existing directory so it is on the workspace filesystem.
        if target.final.kind not in (DIR, MISSING):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, 'not a directory: "%s"' % given)
        spool_dir = [e.fd for e in target.entries if e.kind == DIR and e.fd is not None][-1]
        try:
            tmp = ".upload-archive-%s" % os.urandom(6).hex()
            fd = open_beneath(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, spool_dir, 0o600)
            os.unlink(tmp, dir_fd=spool_dir)
        except OSError as e:
            raise oserror_refusal(e, given) from e
        try:
            with os.fdopen(fd, "w+b") as spool:
                size = self._receive(request_iterator, spool)
                spool.seek(0)
                extract_archive(spool, target, given, walk)
            return size
        except OSError as e:
            raise oserror_refusal(e, given) from e

    @staticmethod
    def _remove(name, dir_fd):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass

    # ------------------------------------------------------------ Download

    @refusing
    def Download(self, request, context):
        chunk_size = request.chunk_size_bytes or CHUNK_DEFAULT
        with Walk() as walk:
            target = confine(walk, request.path)
            if not CHUNK_MIN <= chunk_size <= CHUNK_MAX:
                raise invalid("chunk_size_bytes must be between %d and %d, got %d" % (CHUNK_MIN, CHUNK_MAX, chunk_size))
            if target.final.kind == MISSING:
                raise Refusal(grpc.StatusCode.NOT_FOUND, 'path "%s" does not exist' % request.path)
            digest = hashlib.sha256()
            if request.as_archive:
                if target.final.kind != DIR:
                    raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, 'not a directory: "%s"' % request.path)
                try:
                    dir_fd = walk.open_readable_dir(target)
                except OSError as e:
                    raise oserror_refusal(e, request.path) from e
                yield pb2.DownloadChunk(header=pb2.DownloadHeader(size_bytes=-1, is_archive=True))
                source = rechunk(tar_stream(dir_fd), chunk_size)
            else:
                if target.final.kind == DIR:
                    raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                                  'is a directory (use as_archive): "%s"' % request.path)
                try:
                    # O_NOFOLLOW: the name checked is the file read; O_NONBLOCK: a FIFO cannot hang the agent.
                    fd = open_beneath(target.final.name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC,
                                      walk.parent_fd_existing(target))
                except OSError as e:
                    raise oserror_refusal(e, request.path) from e
                f = os.fdopen(fd, "rb")
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    f.close()
                    what = "a directory (use as_archive)" if stat.S_ISDIR(st.st_mode) else "not a regular file"
                    raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, 'is %s: "%s"' % (what, request.path))
                yield pb2.DownloadChunk(header=pb2.DownloadHeader(size_bytes=st.st_size, is_archive=False))
                source = read_chunks(f, chunk_size)
            for chunk in source:
                digest.update(chunk)
                yield pb2.DownloadChunk(chunk=chunk)
            yield pb2.DownloadChunk(end=pb2.DownloadEnd(sha256=digest.hexdigest()))


# ---------------------------------------------------------------- archives

def read_chunks(f, size):
    with f:
        while True:
            data = f.read(size)
            if not data:
                return
            yield data


def rechunk(pieces, size):
    """Regroup a stream of byte strings into chunks of exactly `size` (the last may be shorter)."""
    buf = bytearray()
    for piece in pieces:
        buf += piece
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


ARCHIVE_STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "escape": grpc.StatusCode.PERMISSION_DENIED,
                  "conflict": grpc.StatusCode.FAILED_PRECONDITION, "limit": grpc.StatusCode.INVALID_ARGUMENT}


def extract_archive(fileobj, target, given, walk, run_dir=RUN_DIR):
    """Check the whole archive first (agentarchive.plan), then extract it under target; nothing escapes it."""
    try:
        tar = tarfile.open(fileobj=fileobj, mode="r:*")
    except tarfile.TarError as e:
        raise invalid("not a tar archive: %s" % e) from e
    with tar:
        try:
            members = agentarchive.plan(tar, target, given, agentarchive.load_limits(run_dir), walk)
            agentarchive.extract(tar, members, target, given, walk)
        except agentarchive.ArchiveRefused as e:
            raise Refusal(ARCHIVE_STATUS[e.kind], e.message) from e
        except tarfile.TarError as e:
            raise invalid("cannot extract archive: %s" % e) from e


# ---------------------------------------------------------------- server

def session_env(run_dir=RUN_DIR):
    """The session's env (create body `env`), part of every command's baseline."""
    try:
        with open(os.path.join(run_dir, SESSION_ENV_FILE)) as f:
            env = json.load(f)
        return {str(k): str(v) for k, v in env.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def build_server(listen=LISTEN, env=None, workers=64, accounts_ready=None):
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agent"),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
                 ("grpc.so_reuseport", 0)],
    )
    pb2_grpc.add_SandboxAgentServiceServicer_to_server(AgentService(env, accounts_ready), server)
    if server.add_insecure_port(listen) == 0:
        raise RuntimeError("cannot listen on %s" % listen)
    return server


def record_pid(run_dir=RUN_DIR):
    """Tell the guest's PID 1 which process is the agent (it watches an agent it did not start)."""
    try:
        tmp = os.path.join(run_dir, "agent.pid.tmp")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(run_dir, "agent.pid"))
    except OSError:
        pass


def split_passwords(env: dict) -> tuple:
    """The session env -> (the commands' part, the account passwords). The passwords are consumed at boot
    (set_passwords) and never reach a command's environment: a command run as the unprivileged user would
    otherwise read root's password there, and `su` would make it root."""
    passwords = {var: env[var] for var, _user in ACCOUNT_PASSWORD_VARS if var in env}
    return {k: v for k, v in env.items() if k not in passwords}, passwords


def serve(listen=LISTEN):
    env, passwords = split_passwords(session_env())
    try:
        os.makedirs(HOME, exist_ok=True)
    except OSError:
        pass  # the guest may have replaced its home with anything; commands still run
    accounts_ready = threading.Event()
    if any(passwords.values()):
        threading.Thread(target=set_passwords, args=(passwords, accounts_ready), daemon=True).start()
    else:
        accounts_ready.set()
    server = build_server(listen, env, accounts_ready=accounts_ready)
    server.start()
    record_pid()
    server.wait_for_termination()


if __name__ == "__main__":
    serve()
