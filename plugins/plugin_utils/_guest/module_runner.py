# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The warm module runner: a Python program that runs INSIDE the guest (on by default, option warm_runner).

The shared mux starts it once per (session, interpreter) with one long-lived Exec
(`<python> -c <this file's source> microvm-warm-runner <config JSON>`) and speaks a small
framed protocol over its stdin/stdout. The config is what the runner must know about
ansible-core's payloads (core_compat.runner_config(): the AnsiballZ marker, the zip_data
line, the module_utils to preload): it lives with the controller's other core assumptions. It never imports anything from the
controller: on the first module payload it puts that payload's own AnsiballZ
zip on sys.path and imports its module_utils (basic, the AnsiballZ loader), so
every later payload runs in a fresh fork() with those imports already done.
After a module ran cleanly, the runner also imports the module_utils that run
imported from its zip, so the next run of that module (or of one sharing them)
finds them loaded too. A verified zip is kept on disk by its sha256, so a
payload seen before is neither re-checked nor re-written.

A payload is only run warm when every file it embeds that was preloaded is
byte-identical to the preloaded one; otherwise (and for anything else the
runner does not support) it answers REFUSE before running anything, and the
task runs cold as a plain pipelined exec.

On the api road (no stream with stdin: the platform's buffered exec) the runner is started detached, with a
fifth argument, the path of a unix socket it listens on (`<python> -c <source> microvm-warm-runner <config>
<work root> <socket>`). Each task's exec is the small client _guest/warm_client.py, which connects, sends
the task's frames and brings back the answers: request ids are per connection (the runner maps them to its
own), a client that goes away has its modules killed, every connection is first sent READY, and the runner
stops once its socket file is removed or replaced (the link closes, or a later link sweeps a gone mux's dir).

Frames: 9-byte header (4-byte length, 4-byte request id, 1-byte kind) + payload.
    mux -> runner: RUN   (4-byte JSON length, JSON {"env": {...}, "before": [tmp ops]}, module payload;
                          the TMP ops in "before", if any, done first: one refused, the run is REFUSEd)
                   RUNREF (4-byte JSON length, JSON {"env": {...}, "zip": key}, the payload without
                          its zip: split_payload's source), for a zip the runner already holds
                   KILL  (kill the request's process group)
                   TMP   (JSON core_compat.tmp_op(): a task tmp dir's mkdtemp, chmod or rm, done in
                          the runner itself, no process started)
    runner -> mux: READY (id 0, JSON {"python": "3.x.y"}), STARTED, OUT, ERR,
                   EXIT (JSON {"rc": n}, and {"hops": {name: ns}} when the RUN's JSON asked with "hops": the
                   runner's timestamps for bench/hops_bench.py), REFUSE (JSON {"reason": "..."}),
                   MISS (a RUNREF's zip is not held: send the whole RUN),
                   DONE (a TMP op's JSON {"rc", "stdout", "stderr"}: what the shell command prints)
    child -> runner (its own pipe, never forwarded): the module_utils it imported and what it compiled
Stdlib only; Python 3.6+.
"""

import __future__
import base64
import collections
import hashlib
import io
import json
import os
import re
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
import warnings
import zipfile
import zipimport
from typing import Any, Container, Dict, Iterable, List, NoReturn, Optional, Tuple

HEADER = struct.Struct("!IIB")
RUN, KILL, RUNREF, TMP = 1, 2, 3, 4
READY, STARTED, OUT, ERR, EXIT, REFUSE, MISS, DONE = 10, 11, 12, 13, 14, 15, 16, 17
LAST = (EXIT, REFUSE, MISS, DONE)  # a request's last frame (after MISS the mux sends a new RUN)
IMPORTS = "imports"  # the child's report pipe
MARKER = "microvm-warm-runner"
TMP_PREFIX = "microvm-warm-"   # + "<pid>-": a runner killed with its mux never removes its dir; the next one does
OWN_DIR = re.compile(r"^microvm-warm-(\d+)-")
# Variables read when an interpreter starts: a task that changes them runs cold.
STARTUP_VARS = re.compile(r"^(PYTHON.*|LANG|LANGUAGE|LC_.*)$")
ZIP_CACHE = 32  # verified zips kept on disk (about 130-300 KiB each)


def now_ns() -> int:
    """The clock of the mux's stamps (time.time_ns, the host's realtime clock); on Python 3.6, from time.time()."""
    return time.time_ns() if hasattr(time, "time_ns") else int(time.time() * 1e9)


class CoreConfig:
    """What the runner knows about ansible-core's payloads, as core_compat.runner_config() gives it."""

    def __init__(self, config: "Dict[str, Any]") -> None:
        self.marker = config["marker"].encode("ascii")
        self.zip_data = re.compile(config["zip_data"].encode("ascii"), re.M)
        self.preload = tuple(config["preload"])
        self.module_utils = re.compile(config["module_utils"])
        self.task_tmp = re.compile(config["task_tmp"])  # the only dirs a TMP op creates or removes
        self.wrapper_call = config.get("wrapper_call", "").encode("ascii")  # where the task's own call begins


def split_payload(payload: bytes, core: CoreConfig) -> "Optional[Tuple[bytes, str]]":
    """(wrapper source with the zip literal replaced by a name, the zip's base64), or None.

    Compiling the wrapper with its zip as a literal costs several ms a run; the
    name is bound to the same string in the module's globals instead.
    """
    if core.marker not in payload:
        return None
    found = core.zip_data.search(payload)
    if not found:
        return None
    source = payload[:found.start(1) - 1] + b"__microvm_zip_data__" + payload[found.end(1) + 1:]
    return source, found.group(1).decode("ascii")


def zip_key(zip_b64: str) -> str:
    """The name both sides give an embedded zip: the sha256 of its base64 text."""
    return hashlib.sha256(zip_b64.encode("ascii")).hexdigest()


FUTURE_FLAGS = 0
for _feature in __future__.all_feature_names:
    FUTURE_FLAGS |= getattr(__future__, _feature).compiler_flag


class WrapperCache:
    """Core's AnsiballZ wrapper code, compiled once in the runner for every fork.

    Each payload is the same wrapper code (per core and interpreter line) followed by one call that carries
    the task's arguments; compiling it whole took 2-3 ms of every module run. The code before the call is
    compiled once (by its sha256), and a run compiles only the call, padded to its own line numbers (the
    same tracebacks) and with the wrapper's __future__ flags (the same compilation).
    """

    KEEP = 8

    def __init__(self, call: bytes) -> None:
        self.call = call
        self.code: "collections.OrderedDict[bytes, Any]" = collections.OrderedDict()

    def split(self, source: bytes) -> "Optional[Tuple[Any, bytes, int]]":
        """(the wrapper code compiled, the call's source padded to its line, compile flags), or None: compile it whole."""
        at = source.rfind(self.call) if self.call else -1
        if at <= 0:
            return None
        head, tail = source[:at], source[at:]
        key = hashlib.sha256(head).digest()
        code = self.code.get(key)
        if code is None:
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                try:
                    code = compile(head, "<stdin>", "exec")
                except (SyntaxError, ValueError):  # the child compiles the whole source and reports the error as before
                    return None
            if warned:  # a compile warning belongs on the task's stderr: the child compiles it whole and prints it
                return None
            self.code[key] = code
            while len(self.code) > self.KEEP:
                self.code.popitem(last=False)
        else:
            self.code.move_to_end(key)
        return code, b"\n" * head.count(b"\n") + tail, code.co_flags & FUTURE_FLAGS


class CodeCache:
    """Compiled code of what forks import from the runner's own zips, kept in the runner for the next forks.

    zipimport compiles a module's source on every import, in every fork (5-10 ms for a module like
    `stat`). The zips are the runner's content-addressed copies, so a (zip, module) names one source:
    after a clean run the runner compiles what that run compiled, with zipimport's own function (the
    same file names, so the same tracebacks), and every later fork finds it compiled. A Python whose
    zipimport is not the pure-Python one (before 3.8) just compiles as before.
    """

    def __init__(self) -> None:
        self.code: "Dict[Tuple[str, str, str], Any]" = {}  # (archive, prefix, fullname) -> zipimport's (code, ispackage, modpath)
        self.compiled: "Optional[List[Tuple[str, str, str]]]" = None  # in a child: the keys it had to compile itself
        self.original: "Any" = getattr(zipimport, "_get_module_code", None)
        if self.original is not None:
            zipimport._get_module_code = self.get  # type: ignore[attr-defined]

    def get(self, importer: Any, fullname: str) -> Any:
        key = (importer.archive, importer.prefix, fullname)
        found = self.code.get(key)
        if found is not None:
            return found
        result = self.original(importer, fullname)
        if self.compiled is not None:
            self.compiled.append(key)
        return result

    def learn(self, keys: "Iterable[Tuple[str, str, str]]", archives: "Container[str]") -> None:
        for archive, prefix, fullname in keys:
            key = (archive, prefix, fullname)
            if archive in archives and key not in self.code:
                importer = zipimport.zipimporter(os.path.join(archive, prefix) if prefix else archive)
                self.code[key] = self.original(importer, fullname)

    def forget(self, archive: str) -> None:
        for key in [k for k in self.code if k[0] == archive]:
            del self.code[key]


class Runner:
    def __init__(self, proto_in: int, proto_out: int, core: CoreConfig, work_root: "Optional[str]" = None,
                 listener: "Optional[socket.socket]" = None) -> None:
        self.listener = listener  # the api road's socket: requests come on its connections, not on proto_in
        self.listener_id: "Optional[Tuple[int, int]]" = None  # its file's (device, inode): gone or replaced, stop
        self.conns: "Dict[int, socket.socket]" = {}  # fd -> a client's connection
        self.conn_buf: "Dict[int, bytes]" = {}
        self.route: "Dict[int, Tuple[int, int]]" = {}  # the runner's request id -> (connection fd, the client's id)
        self.route_of: "Dict[Tuple[int, int], int]" = {}
        self.next_rid = 1
        self.work_root = work_root  # where the preload dir goes (the session's scratch dir); None: the temp dir
        self.core = core
        self.codes = CodeCache()
        self.wrappers = WrapperCache(core.wrapper_call)
        self.proto_in = proto_in
        self.proto_out = proto_out
        self.sel = selectors.DefaultSelector()
        self.buf = b""
        self.children: "Dict[int, int]" = {}  # pid -> request id
        self.pipes: "Dict[int, Tuple[int, Any]]" = {}  # fd -> (request id, kind)
        self.open_pipes: "Dict[int, int]" = {}  # request id -> open pipe count
        self.status: "Dict[int, int]" = {}  # request id -> rc once reaped
        self.pids: "Dict[int, int]" = {}  # request id -> pid
        self.reports: "Dict[int, bytes]" = {}  # request id -> bytes the child reported
        self.zip_of: "Dict[int, Optional[str]]" = {}  # request id -> the zip it ran from
        self.stamps: "Dict[int, Dict[str, int]]" = {}  # request id -> its timestamps, for requests that ask (hops)
        self.preload_dir: "Any" = None  # set by preload(), before any run
        self.preload_zip: "Any" = None
        self.roots: "List[str]" = []  # zips the runner's own packages import from (kept while it lives)
        self.preloaded: "Any" = None  # arcname -> sha256 of the preloaded files (set by preload())
        self.preload_error: "Optional[str]" = None
        self.generation = 0       # grows with self.preloaded: older verifications are stale
        # zip_key -> [path on disk, generation, base64 text]
        self.verified: "collections.OrderedDict[str, List[Any]]" = collections.OrderedDict()
        self.base_env = dict(os.environ)
        self.cwd = os.getcwd()

    def send(self, rid: int, kind: int, payload: Any = b"") -> None:
        if kind in LAST and kind != EXIT and self.stamps:
            self.stamps.pop(rid, None)  # refused or missed: no EXIT carries them (a MISS's new RUN stamps anew)
        if not isinstance(payload, bytes):
            payload = json.dumps(payload).encode("utf-8")
        out = self.proto_out
        if self.listener is not None:
            target = self.route.get(rid)
            if target is None:
                return  # its client went away (its module was killed): nobody reads this
            out, rid = target
            if kind in LAST:
                self.unroute(rid, out)
        data = HEADER.pack(len(payload), rid, kind) + payload
        view = memoryview(data)
        try:
            while view:
                n = os.write(out, view)
                view = view[n:]
        except OSError:
            if self.listener is None:
                raise
            # the client is gone: its connection's end of file (next select) kills what it started

    def unroute(self, client_rid: int, fd: int) -> None:
        rid = self.route_of.pop((fd, client_rid), None)
        if rid is not None:
            self.route.pop(rid, None)

    # -- preloading ------------------------------------------------------------------
    def preload(self, zip_bytes: bytes) -> None:
        self.preload_dir = tempfile.mkdtemp(prefix="%s%d-" % (TMP_PREFIX, os.getpid()), dir=self.work_root)
        self.preload_zip = os.path.join(self.preload_dir, "preload.zip")
        with open(self.preload_zip, "wb") as f:
            f.write(zip_bytes)
        sys.path.insert(0, self.preload_zip)
        self.roots.append(self.preload_zip)
        try:
            for name in self.core.preload:
                __import__(name)
        except Exception as e:  # the payload's module_utils cannot be preloaded: every run goes cold
            self.preload_error = "cannot preload the payload's module_utils: %s: %s" % (type(e).__name__, e)
            return
        self.record_preloaded()

    def root_of(self, path: str) -> "Optional[Tuple[str, str]]":
        """(zip, arcname) when path lies in one of the runner's zips, else None."""
        for root in self.roots:
            if path.startswith(root + os.sep):
                return root, path[len(root) + 1:].replace(os.sep, "/")
        return None

    def record_preloaded(self) -> None:
        """Note the sha256 of every file the runner has imported from its zips."""
        preloaded = {}
        archives = {}
        for mod in list(sys.modules.values()):
            found = self.root_of(getattr(mod, "__file__", None) or "")
            if found:
                root, arc = found
                if root not in archives:
                    archives[root] = zipfile.ZipFile(root)
                try:
                    preloaded[arc] = hashlib.sha256(archives[root].read(arc)).hexdigest()
                except KeyError:
                    pass
        for zf in archives.values():
            zf.close()
        self.preloaded = preloaded
        self.generation += 1

    def extend_preload(self, names: "Iterable[str]", zip_path: str) -> None:
        """Import module_utils a clean run imported from zip_path, so later forks start with them."""
        names = [n for n in names if self.core.module_utils.match(n) and n not in sys.modules]
        if not names or self.preload_error:
            return
        if zip_path not in self.roots:
            # the runner's packages look in this zip after their own: only files missing elsewhere come from it
            for mod in list(sys.modules.values()):
                path = getattr(mod, "__path__", None)
                if isinstance(path, list):
                    for entry in list(path):
                        found = self.root_of(entry) if entry not in self.roots else (entry, "")
                        if found and found[0] == self.preload_zip:
                            extra = os.path.join(zip_path, found[1]) if found[1] else zip_path
                            if extra not in path:
                                path.append(extra)
            self.roots.append(zip_path)
            sys.path.append(zip_path)
            sys.path_importer_cache.clear()
        for name in sorted(names):
            try:
                __import__(name)
            except Exception:  # it imports in a module's run, not here: leave it to the runs
                for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                    sys.modules.pop(key, None)
        self.record_preloaded()

    def verified_zip(self, zip_b64: str, zip_bytes: bytes) -> "Tuple[Optional[str], Optional[str]]":
        """(why this zip cannot run warm or None, its path on disk)."""
        key = zip_key(zip_b64)
        known = self.verified.get(key)
        if known is not None and known[1] == self.generation:
            self.verified.move_to_end(key)
            return None, known[0]
        zf = zipfile.ZipFile(io.BytesIO(zip_bytes))
        for arc in zf.namelist():
            digest = self.preloaded.get(arc)
            if digest is not None and hashlib.sha256(zf.read(arc)).hexdigest() != digest:
                return "its module_utils differ from the preloaded ones (%s)" % arc, None
        if known is None:
            path = os.path.join(self.preload_dir, "payload-%s.zip" % key[:32])
            with open(path, "wb") as f:
                f.write(zip_bytes)
            zipimport.zipimporter(path)  # reads its directory into zipimport's cache, which every fork inherits
        else:
            path = known[0]
        self.verified[key] = [path, self.generation, zip_b64]
        while len(self.verified) > ZIP_CACHE:
            for old_key, (old_path, _gen, _b64) in self.verified.items():
                if old_path not in self.roots:
                    del self.verified[old_key]
                    self.codes.forget(old_path)
                    try:
                        os.unlink(old_path)
                    except OSError:
                        pass
                    break
            else:
                break
        return None, path

    def refusal(self, env: "Dict[str, str]", zip_b64: "Optional[str]") -> "Tuple[Optional[str], Optional[str]]":
        """(why this payload cannot run warm or None, the path of its verified zip)."""
        if zip_b64 is None:
            return "not an AnsiballZ Python module payload", None
        zip_bytes = base64.b64decode(zip_b64)
        for key, value in env.items():
            if STARTUP_VARS.match(key) and self.base_env.get(key) != value:
                return "the task sets %s, which the interpreter reads at start-up" % key, None
        if self.preloaded is None and self.preload_error is None:
            self.preload(zip_bytes)
        if self.preload_error:
            return self.preload_error, None
        return self.verified_zip(zip_b64, zip_bytes)

    # -- running ---------------------------------------------------------------------
    def run(self, rid: int, env: "Dict[str, str]", split: "Optional[Tuple[bytes, str]]", before: "List[Any]") -> None:
        """Run a payload given as split_payload's (source, zip base64), or refuse it (None: not a module).

        The task tmp dir ops in `before` are done once the payload is known to run here, so a refused payload
        leaves them all undone (a mkdtemp among them is not idempotent: the worker then runs them in a shell)."""
        zip_path = None
        try:
            reason, zip_path = self.refusal(env, split[1] if split else None)
        except Exception as e:
            reason = "cannot inspect the payload: %s: %s" % (type(e).__name__, e)
        if reason:
            self.send(rid, REFUSE, {"reason": reason})
            return
        if not self.before(rid, before):
            return
        wrapper = self.wrappers.split(split[0])  # type: ignore[index]  # not refused: split is set
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            self.child(env, split, wrapper, zip_path, out_w, err_w, rep_w, (out_r, err_r, rep_r))  # type: ignore[arg-type]  # not refused: both set
        for fd in (out_w, err_w, rep_w):
            os.close(fd)
        self.children[pid] = rid
        self.pids[rid] = pid
        self.open_pipes[rid] = 3
        self.reports[rid] = b""
        self.zip_of[rid] = zip_path
        if rid in self.stamps:
            self.stamps[rid]["forked"] = now_ns()
        for fd, kind in ((out_r, OUT), (err_r, ERR), (rep_r, IMPORTS)):
            self.pipes[fd] = (rid, kind)
            self.sel.register(fd, selectors.EVENT_READ, "pipe")
        self.send(rid, STARTED)

    def own_path(self, entry: str, own_zip: str) -> "Optional[str]":
        """A package path entry in one of the runner's zips, moved into the payload's zip."""
        found = self.root_of(entry) if entry not in self.roots else (entry, "")
        if not found:
            return None
        return os.path.join(own_zip, found[1]) if found[1] else own_zip

    def child(self, env: "Dict[str, str]", split: "Tuple[bytes, str]", wrapper: "Any", own_zip: str, out_w: int, err_w: int,
              rep_w: int, close: "Tuple[int, int, int]") -> NoReturn:
        rc = 1
        try:
            os.setpgid(0, 0)  # a KILL stops the module and what it started
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (devnull, out_w, err_w) + tuple(close) + self.own_fds():
                os.close(fd)
            os.environ.clear()
            os.environ.update(self.base_env)
            os.environ.update(env)
            tempfile.tempdir = None
            os.chdir(self.cwd)
            self.codes.compiled = []
            # Packages preloaded from the runner's zips now look in this payload's zip first,
            # so its own module (and module_utils that were not preloaded) are imported from it.
            for mod in list(sys.modules.values()):
                path = getattr(mod, "__path__", None)
                if isinstance(path, list):
                    moved = [p for p in (self.own_path(entry, own_zip) for entry in path) if p]
                    path[:0] = [p for i, p in enumerate(moved) if p not in moved[:i]]
            sys.path_importer_cache.clear()
            sys.argv = [""]
            main = type(sys)("__main__")
            main.__dict__["__builtins__"] = __builtins__
            main.__dict__["__microvm_zip_data__"] = split[1]
            sys.modules["__main__"] = main
            codes: "Tuple[Any, ...]"
            if wrapper is not None:  # the wrapper's code compiled by the runner, then the task's own call
                codes = (wrapper[0], compile(wrapper[1], "<stdin>", "exec", wrapper[2]))
            else:
                codes = (compile(split[0], "<stdin>", "exec"),)
            try:
                for code in codes:
                    exec(code, main.__dict__)
                rc = 0
            except SystemExit as e:
                rc = exit_code(e)
            except BaseException as exc:
                tb = exc.__traceback__
                tb = tb.tb_next if tb is not None else tb  # the runner's own frame is not the module's
                sys.excepthook(type(exc), exc.with_traceback(tb), tb)
                rc = 1
            run_atexit()
            prefix = own_zip + os.sep
            report = [name for name, mod in list(sys.modules.items())
                      if self.core.module_utils.match(name) and (getattr(mod, "__file__", None) or "").startswith(prefix)]
            os.write(rep_w, json.dumps({"imports": report, "compiled": self.codes.compiled}).encode("utf-8"))
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

    def kill(self, rid: int) -> None:
        pid = self.pids.get(rid)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def reap(self) -> None:
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

    def finish(self, rid: int) -> None:
        if self.open_pipes.get(rid) == 0 and rid in self.status:
            rc = self.status.pop(rid)
            stamps = self.stamps.pop(rid, None)
            if stamps is not None:
                stamps["exit"] = now_ns()
            self.send(rid, EXIT, {"rc": rc, "hops": stamps} if stamps is not None else {"rc": rc})
            self.open_pipes.pop(rid, None)
            self.pids.pop(rid, None)
            report, zip_path = self.reports.pop(rid, b""), self.zip_of.pop(rid, None)
            if rc == 0 and report and zip_path:
                try:
                    learned = json.loads(report.decode("utf-8"))
                    self.extend_preload(learned["imports"], zip_path)
                    self.codes.learn(learned["compiled"], set(self.roots) | {v[0] for v in self.verified.values()})
                except Exception:  # preloading more is an optimisation: a failure keeps what there is
                    pass

    def on_pipe(self, fd: int) -> None:
        rid, kind = self.pipes[fd]
        data = os.read(fd, 65536)
        if data:
            if kind == IMPORTS:
                self.reports[rid] = self.reports.get(rid, b"") + data
            else:
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

    def own_fds(self) -> "Tuple[int, ...]":
        """The runner's own descriptors, which a module's fork closes."""
        if self.listener is None:
            return (self.proto_in, self.proto_out)
        return (self.listener.fileno(),) + tuple(self.conns)

    def on_input(self) -> bool:
        data = os.read(self.proto_in, 1 << 20)
        if not data:
            return False
        self.buf = self.take_frames(self.buf + data, None)
        return True

    def take_frames(self, buf: bytes, fd: "Optional[int]") -> bytes:
        """Handle every whole frame in buf (from the mux's stream, or from connection fd); the rest is returned."""
        while len(buf) >= HEADER.size:
            length, rid, kind = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + length:
                break
            body = buf[HEADER.size:HEADER.size + length]
            buf = buf[HEADER.size + length:]
            if fd is not None:  # a client's id: the runner's own, per (connection, id)
                key = (fd, rid)
                if key not in self.route_of:
                    if kind == KILL:
                        continue
                    self.route_of[key] = self.next_rid
                    self.route[self.next_rid] = key
                    self.next_rid += 1
                rid = self.route_of[key]
            self.handle(rid, kind, body)
        return buf

    def handle(self, rid: int, kind: int, body: bytes) -> None:
        if kind in (RUN, RUNREF):
            jlen = struct.unpack("!I", body[:4])[0]
            req = json.loads(body[4:4 + jlen].decode("utf-8"))
            rest = body[4 + jlen:]
            if req.get("hops"):
                self.stamps[rid] = {"recv": now_ns()}
            if kind == RUNREF and req.get("zip") not in self.verified:
                self.send(rid, MISS)
            else:
                self.run(rid, req.get("env") or {}, split_payload(rest, self.core) if kind == RUN
                         else (rest, self.verified[req["zip"]][2]), req.get("before") or [])
        elif kind == KILL:
            self.kill(rid)
        elif kind == TMP:
            self.tmp_op(rid, json.loads(body.decode("utf-8")))

    # -- the api road's connections ---------------------------------------------------
    def on_accept(self) -> None:
        try:
            conn, _addr = self.listener.accept()  # type: ignore[union-attr]  # only registered with a listener
        except OSError:
            return
        self.conns[conn.fileno()] = conn
        self.conn_buf[conn.fileno()] = b""
        self.sel.register(conn.fileno(), selectors.EVENT_READ, "conn")
        self.send_ready(conn.fileno())

    def send_ready(self, fd: int) -> None:
        ready = json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "pid": os.getpid()}).encode("utf-8")
        try:
            os.write(fd, HEADER.pack(len(ready), 0, READY) + ready)  # a few dozen bytes: one write
        except OSError:
            pass

    def on_conn(self, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 20)
        except OSError:
            data = b""
        if data:
            self.conn_buf[fd] = self.take_frames(self.conn_buf[fd] + data, fd)
            return
        # the client went away (its task ended, was cancelled or timed out): stop what it started
        for (cfd, client_rid), rid in list(self.route_of.items()):
            if cfd == fd:
                self.kill(rid)
                self.unroute(client_rid, fd)
        self.sel.unregister(fd)
        self.conns.pop(fd).close()
        self.conn_buf.pop(fd, None)

    def listening(self) -> bool:
        """Is the runner's socket file still its own? Removed (the link closed, a sweep) or replaced: stop."""
        try:
            st = os.stat(self.listener.getsockname())  # type: ignore[union-attr]
        except (OSError, TypeError):
            return False
        return (st.st_dev, st.st_ino) == self.listener_id

    # -- a task tmp dir's commands -----------------------------------------------------
    def tmp_op(self, rid: int, req: Any) -> None:
        """Do what core's mkdtemp / chmod / rm command would, in this process; REFUSE on any doubt.

        Each is safe to run again in a shell after a refusal, however far it got: `mkdir -p` and
        chmod are idempotent, rm -f -r finishes what was left, and the dir mkdtemp makes last was
        not made when it refuses.
        """
        try:
            done = TMP_OPS[req.get("op")](self.core, req)
        except (OSError, KeyError, ValueError, TypeError) as e:
            self.send(rid, REFUSE, {"reason": "%s: %s" % (type(e).__name__, e)})
            return
        if done is None:
            self.send(rid, REFUSE, {"reason": "not a task tmp dir operation the runner does"})
            return
        self.send(rid, DONE, {"rc": 0, "stdout": done, "stderr": ""})

    def before(self, rid: int, ops: "List[Any]") -> bool:
        """The task tmp dir commands the worker deferred to its module's request (the task's mkdtemp, the chmod of
        the files it put), done first; False (REFUSE sent, the module not started) if one cannot be: the worker then
        runs them in a shell, which reports their real error, and the module cold. A chmod is safe to run again, and
        a mkdtemp comes alone or first (a put needs its dir, so it is never deferred past one): one that refuses
        made nothing (see tmp_op)."""
        for op in ops:
            try:
                done = TMP_OPS[op.get("op")](self.core, op)
            except (OSError, KeyError, ValueError, TypeError, AttributeError) as e:
                done, why = None, "%s: %s" % (type(e).__name__, e)
            else:
                why = "not a task tmp dir operation the runner does"
            if done is None:
                self.send(rid, REFUSE, {"reason": "the deferred %s before the module: %s" % (op.get("op"), why)})
                return False
        return True

    def serve(self) -> None:
        if self.listener is not None:
            st = os.stat(self.listener.getsockname())
            self.listener_id = (st.st_dev, st.st_ino)
            self.sel.register(self.listener.fileno(), selectors.EVENT_READ, "accept")
        else:
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
                    elif key.data == "accept":
                        self.on_accept()
                    elif key.data == "conn":
                        self.on_conn(key.fd)
                    else:
                        self.on_pipe(key.fd)
                self.reap()
                if self.listener is not None and reading and not self.listening():
                    reading = False
                    self.sel.unregister(self.listener.fileno())
        finally:
            for pid in list(self.children):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            if self.preload_dir:
                shutil.rmtree(self.preload_dir, ignore_errors=True)


def tmp_mkdtemp(core: CoreConfig, req: "Dict[str, Any]") -> "Optional[str]":
    """( umask U && mkdir -p BASE && mkdir BASE/NAME && echo NAME=BASE/NAME )"""
    base, name, mode = req["base"], req["name"], int(req["mode"])
    if not core.task_tmp.match(name) or not base.startswith("/"):
        return None
    path = os.path.join(base, name)
    old = os.umask(0o777 & ~mode)
    try:
        os.makedirs(base, exist_ok=True)
        if not os.path.isdir(base):
            return None
        os.mkdir(path)
    finally:
        os.umask(old)
    return "%s=%s\n" % (name, path)


def tmp_chmod(core: CoreConfig, req: "Dict[str, Any]") -> "Optional[str]":
    """chmod u+[rwx]... PATH... (every path must exist first: a refusal then changed nothing)"""
    mode = req["mode"]
    if not mode.startswith("u+"):
        return None
    bits = sum({"r": 0o400, "w": 0o200, "x": 0o100}[c] for c in set(mode[2:]))
    modes = [(path, os.stat(path).st_mode) for path in req["paths"]]
    for path, st_mode in modes:
        if (st_mode | bits) != st_mode:
            os.chmod(path, (st_mode | bits) & 0o7777)
    return ""


def tmp_rm(core: CoreConfig, req: "Dict[str, Any]") -> "Optional[str]":
    """rm -f -r PATH > /dev/null 2>&1, for a task tmp dir only"""
    path = req["path"]
    bare = path.rstrip("/")
    if not bare.startswith("/") or not core.task_tmp.match(os.path.basename(bare)):
        return None
    if os.path.islink(bare):
        return None  # `rm -r link/` has its own rules: leave it to rm
    if not os.path.lexists(bare):
        return ""
    if not os.path.isdir(bare):
        return None
    shutil.rmtree(bare)
    return ""


TMP_OPS = {"mkdtemp": tmp_mkdtemp, "chmod": tmp_chmod, "rm": tmp_rm}


def exit_code(e: SystemExit) -> int:
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


def run_atexit() -> None:
    import atexit
    run = getattr(atexit, "_run_exitfuncs", None)
    if run is not None:
        run()


def runner_alive(pid: int) -> bool:
    """Is pid a warm runner (its command line carries MARKER)? A reused pid of anything else is not."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return MARKER.encode() in f.read()
    except (OSError, ValueError):
        return False


def sweep_stale_dirs(tmp: "Optional[str]" = None) -> None:
    """Remove the preload dirs of runners that are gone: they die by SIGKILL with their mux, never cleaning up."""
    tmp = tmp or tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        m = OWN_DIR.match(name)
        if m and int(m.group(1)) != os.getpid() and not runner_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def work_root_of(argv: "List[str]") -> "Optional[str]":
    """The dir the mux names for the runner's files (under the session's scratch dir, never /tmp: a checkpoint or a
    fork would keep them there), made if needed; None (the temp dir) when there is none or it cannot be made."""
    if len(argv) < 4 or not argv[3].startswith("/"):
        return None
    try:
        os.makedirs(argv[3], mode=0o700, exist_ok=True)
    except OSError:
        return None
    return argv[3]


def listen(path: str) -> socket.socket:
    """The api road's socket (its dir is the mux's, mode 0700); a file left there by a gone runner is replaced."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    return listener


def main() -> None:
    core = CoreConfig(json.loads(sys.argv[2]))
    work_root = work_root_of(sys.argv)
    sweep_stale_dirs()  # older runners' dirs in the temp dir
    if work_root:
        sweep_stale_dirs(work_root)
    if len(sys.argv) > 4:  # the api road: detached, its requests on a socket
        try:
            os.setsid()  # not in the process group of the exec that started it
        except OSError:
            pass
        listener = listen(sys.argv[4])
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        os.close(devnull)
        Runner(-1, -1, core, work_root, listener).serve()
        return
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)  # nothing but frames on the protocol fd
    Runner(proto_in, proto_out, core, work_root).serve()


if __name__ == "__main__":
    main()
