# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The warm module runner: a Python program that runs INSIDE the guest (experimental).

The mux starts it once per (session, interpreter) with one long-lived Exec
(`<python> -c <this file's source> microvm-warm-runner`) and speaks a small
framed protocol over its stdin/stdout. It never imports anything from the
controller: on the first module payload it puts that payload's own AnsiballZ
zip on sys.path and imports its module_utils (basic, the AnsiballZ loader), so
every later payload runs in a fresh fork() with those imports already done.

A payload is only run warm when every file it embeds that was preloaded is
byte-identical to the preloaded one; otherwise (and for anything else the
runner does not support) it answers REFUSE before running anything, and the
task runs cold as a plain pipelined exec.

Frames: 9-byte header (4-byte length, 4-byte request id, 1-byte kind) + payload.
    mux -> runner: RUN   (4-byte JSON length, JSON {"env": {...}}, module payload)
                   KILL  (kill the request's process group)
    runner -> mux: READY (id 0, JSON {"python": "3.x.y"}), STARTED, OUT, ERR,
                   EXIT (JSON {"rc": n}), REFUSE (JSON {"reason": "..."})
Stdlib only; Python 3.6+.
"""

import base64
import hashlib
import io
import json
import os
import re
import selectors
import shutil
import signal
import struct
import sys
import tempfile
import zipfile

HEADER = struct.Struct("!IIB")
RUN, KILL = 1, 2
READY, STARTED, OUT, ERR, EXIT, REFUSE = 10, 11, 12, 13, 14, 15
MARKER = "microvm-warm-runner"
PRELOAD = ("ansible.module_utils.basic", "ansible.module_utils._internal._ansiballz._loader")
# Variables read when an interpreter starts: a task that changes them runs cold.
STARTUP_VARS = re.compile(r"^(PYTHON.*|LANG|LANGUAGE|LC_.*)$")
ZIPDATA = re.compile(rb"^zip_data='([A-Za-z0-9+/=]*)',$", re.M)


def payload_zip(payload):
    if b"_ANSIBALLZ_WRAPPER = True" not in payload:
        return None
    found = ZIPDATA.search(payload)
    if not found:
        return None
    return base64.b64decode(found.group(1))


class Runner:
    def __init__(self, proto_in, proto_out):
        self.proto_in = proto_in
        self.proto_out = proto_out
        self.sel = selectors.DefaultSelector()
        self.buf = b""
        self.children = {}        # pid -> request id
        self.pipes = {}           # fd -> (request id, kind)
        self.open_pipes = {}      # request id -> open pipe count
        self.status = {}          # request id -> rc once reaped
        self.pids = {}            # request id -> pid
        self.preload_dir = None
        self.preload_zip = None
        self.preloaded = None     # arcname -> sha256 of the preloaded files
        self.preload_error = None
        self.base_env = dict(os.environ)
        self.cwd = os.getcwd()

    def send(self, rid, kind, payload=b""):
        if not isinstance(payload, bytes):
            payload = json.dumps(payload).encode("utf-8")
        data = HEADER.pack(len(payload), rid, kind) + payload
        view = memoryview(data)
        while view:
            n = os.write(self.proto_out, view)
            view = view[n:]

    # -- preloading ------------------------------------------------------------------
    def preload(self, zip_bytes):
        self.preload_dir = tempfile.mkdtemp(prefix="microvm-warm-")
        self.preload_zip = os.path.join(self.preload_dir, "preload.zip")
        with open(self.preload_zip, "wb") as f:
            f.write(zip_bytes)
        sys.path.insert(0, self.preload_zip)
        try:
            for name in PRELOAD:
                __import__(name)
        except Exception as e:  # the payload's module_utils cannot be preloaded: every run goes cold
            self.preload_error = "cannot preload the payload's module_utils: %s: %s" % (type(e).__name__, e)
            return
        prefix = self.preload_zip + os.sep
        zf = zipfile.ZipFile(io.BytesIO(zip_bytes))
        names = set(zf.namelist())
        self.preloaded = {}
        for mod in list(sys.modules.values()):
            path = getattr(mod, "__file__", None) or ""
            if path.startswith(prefix):
                arc = path[len(prefix):].replace(os.sep, "/")
                if arc in names:
                    self.preloaded[arc] = hashlib.sha256(zf.read(arc)).hexdigest()

    def refusal(self, env, zip_bytes):
        """Why this payload cannot run warm, or None."""
        if zip_bytes is None:
            return "not an AnsiballZ Python module payload"
        for key, value in env.items():
            if STARTUP_VARS.match(key) and self.base_env.get(key) != value:
                return "the task sets %s, which the interpreter reads at start-up" % key
        if self.preloaded is None and self.preload_error is None:
            self.preload(zip_bytes)
        if self.preload_error:
            return self.preload_error
        zf = zipfile.ZipFile(io.BytesIO(zip_bytes))
        for arc in zf.namelist():
            digest = self.preloaded.get(arc)
            if digest is not None and hashlib.sha256(zf.read(arc)).hexdigest() != digest:
                return "its module_utils differ from the preloaded ones (%s)" % arc
        return None

    # -- running ---------------------------------------------------------------------
    def run(self, rid, env, payload):
        zip_bytes = payload_zip(payload)
        try:
            reason = self.refusal(env, zip_bytes)
        except Exception as e:
            reason = "cannot inspect the payload: %s: %s" % (type(e).__name__, e)
        if reason:
            self.send(rid, REFUSE, {"reason": reason})
            return
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            self.child(env, payload, zip_bytes, out_w, err_w, (out_r, err_r))
        os.close(out_w)
        os.close(err_w)
        self.children[pid] = rid
        self.pids[rid] = pid
        self.open_pipes[rid] = 2
        for fd, kind in ((out_r, OUT), (err_r, ERR)):
            self.pipes[fd] = (rid, kind)
            self.sel.register(fd, selectors.EVENT_READ, "pipe")
        self.send(rid, STARTED)

    def child(self, env, payload, zip_bytes, out_w, err_w, close):
        rc = 1
        try:
            os.setpgid(0, 0)  # a KILL stops the module and what it started
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (devnull, out_w, err_w, self.proto_in, self.proto_out) + tuple(close):
                os.close(fd)
            os.environ.clear()
            os.environ.update(self.base_env)
            os.environ.update(env)
            tempfile.tempdir = None
            os.chdir(self.cwd)
            # Packages preloaded from the first payload's zip now look in this payload's zip first,
            # so its own module (and module_utils that were not preloaded) are imported from it.
            own_dir = tempfile.mkdtemp(prefix="ansible_warm_")
            own_zip = os.path.join(own_dir, "payload.zip")
            with open(own_zip, "wb") as f:
                f.write(zip_bytes)
            old = self.preload_zip
            for mod in list(sys.modules.values()):
                path = getattr(mod, "__path__", None)
                if isinstance(path, list) and any(p == old or p.startswith(old + os.sep) for p in path):
                    path[:0] = [own_zip + p[len(old):] for p in path if p == old or p.startswith(old + os.sep)]
            sys.path_importer_cache.clear()
            sys.argv = [""]
            main = type(sys)("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            code = compile(payload, "<stdin>", "exec")
            try:
                try:
                    exec(code, main.__dict__)
                    rc = 0
                except SystemExit as e:
                    rc = exit_code(e)
                except BaseException:
                    kind, value, tb = sys.exc_info()
                    tb = tb.tb_next if tb is not None else tb  # the runner's own frame is not the module's
                    sys.excepthook(kind, value.with_traceback(tb), tb)
                    rc = 1
                run_atexit()
            finally:
                shutil.rmtree(own_dir, ignore_errors=True)
        except BaseException as e:  # the runner's own set-up failed: say so on the task's stderr
            try:
                os.write(2, ("microvm warm runner: %s: %s\n" % (type(e).__name__, e)).encode("utf-8", "replace"))
            except OSError:
                pass
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(rc)

    def kill(self, rid):
        pid = self.pids.get(rid)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def reap(self):
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rid = self.children.pop(pid, None)
            if rid is None:
                continue
            if os.WIFSIGNALED(status):
                self.status[rid] = -os.WTERMSIG(status)
            else:
                self.status[rid] = os.WEXITSTATUS(status)
            self.finish(rid)

    def finish(self, rid):
        if self.open_pipes.get(rid) == 0 and rid in self.status:
            self.send(rid, EXIT, {"rc": self.status.pop(rid)})
            self.open_pipes.pop(rid, None)
            self.pids.pop(rid, None)

    def on_pipe(self, fd):
        rid, kind = self.pipes[fd]
        data = os.read(fd, 65536)
        if data:
            self.send(rid, kind, data)
            return
        self.sel.unregister(fd)
        os.close(fd)
        del self.pipes[fd]
        self.open_pipes[rid] -= 1
        if self.open_pipes[rid] == 0:
            # the pipes close when the child (and anything it left behind) exits: reap it now
            pid = self.pids.get(rid)
            if pid and pid in self.children:
                status = os.waitpid(pid, 0)[1]
                self.children.pop(pid, None)
                self.status[rid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        self.finish(rid)

    def on_input(self):
        data = os.read(self.proto_in, 1 << 20)
        if not data:
            return False
        self.buf += data
        while len(self.buf) >= HEADER.size:
            length, rid, kind = HEADER.unpack_from(self.buf)
            if len(self.buf) < HEADER.size + length:
                break
            body = self.buf[HEADER.size:HEADER.size + length]
            self.buf = self.buf[HEADER.size + length:]
            if kind == RUN:
                jlen = struct.unpack("!I", body[:4])[0]
                req = json.loads(body[4:4 + jlen].decode("utf-8"))
                self.run(rid, req.get("env") or {}, body[4 + jlen:])
            elif kind == KILL:
                self.kill(rid)
        return True

    def serve(self):
        self.sel.register(self.proto_in, selectors.EVENT_READ, "input")
        self.send(0, READY, {"python": "%d.%d.%d" % sys.version_info[:3], "pid": os.getpid()})
        reading = True
        try:
            while reading or self.pipes:
                for key, _events in self.sel.select(timeout=1.0):
                    if key.data == "input":
                        if not self.on_input():
                            reading = False
                            self.sel.unregister(self.proto_in)
                    else:
                        self.on_pipe(key.fd)
                self.reap()
        finally:
            for pid in list(self.children):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            if self.preload_dir:
                shutil.rmtree(self.preload_dir, ignore_errors=True)


def exit_code(e):
    """The exit status Python gives an uncaught SystemExit."""
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write("%s\n" % (code,))
    except Exception:
        pass
    return 1


def run_atexit():
    import atexit
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()


def main():
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # nothing but frames on the protocol fd
    Runner(proto_in, proto_out).serve()


if __name__ == "__main__":
    main()
