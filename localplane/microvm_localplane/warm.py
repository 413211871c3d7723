"""Processes the guest runtime keeps track of: warm helpers (zygote, launcher) and launched guests."""
import contextlib
import json
import os
import signal
import subprocess
import threading
import time

from .errors import GuestError


def proc_start_time(pid, zombies=False):
    """Kernel start time of pid (field 22 of /proc/pid/stat), None if gone (or a zombie, unless zombies)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    fields = data[data.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X") and not zombies:
        return None
    return int(fields[19])


def exe_name(pid):
    try:
        return os.path.basename(os.readlink("/proc/%d/exe" % pid))
    except OSError:
        return None


class WarmProcess:
    """Client of a warm helper process (zygote.py, launcher.py): one JSON line each way."""

    def __init__(self, code, module, log_path):
        self._code = code
        self._module = module
        self._log_path = log_path
        self._proc = None
        self._lock = threading.Lock()

    def _start(self):
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen([self._code.python, "-m", self._module],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                                               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": self._code.pythonpath()},
                                          start_new_session=True, close_fds=True)
        if not self._proc.stdout.readline():
            raise GuestError("%s did not start (see %s)" % (self._module, self._log_path))

    def warm(self):
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()

    def request(self, message):
        """Blocking: one request, one answer dict (a dead helper is restarted once)."""
        line = json.dumps(message).encode() + b"\n"
        with self._lock:
            for _attempt in (1, 2):
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                try:
                    self._proc.stdin.write(line)
                    self._proc.stdin.flush()
                    answer = self._proc.stdout.readline()
                except (BrokenPipeError, OSError):
                    answer = b""
                if answer:
                    return json.loads(answer)
                self._stop_locked()
            return {"ok": False, "error": "%s died" % self._module}

    def _stop_locked(self):
        if self._proc is not None:
            with contextlib.suppress(Exception):
                self._proc.stdin.close()
            with contextlib.suppress(Exception):
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self):
        with self._lock:
            self._stop_locked()


class Launched:
    """The process that becomes the guest's bwrap monitor: our child (shell path) or the launcher's."""

    def __init__(self, popen=None, pid=None):
        self.popen = popen
        self.pid = popen.pid if popen is not None else pid
        self.start = proc_start_time(self.pid)

    def running(self):
        if self.popen is not None:
            return self.popen.poll() is None
        return self.start is not None and proc_start_time(self.pid) == self.start

    def kill(self):
        if self.popen is not None:
            with contextlib.suppress(Exception):
                self.popen.kill()
            self.popen.wait()
            return
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        # the launcher reaps it; wait for that so that nothing, not even a zombie, is left
        deadline = time.monotonic() + 5
        while self.start is not None and proc_start_time(self.pid, zombies=True) == self.start:
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
