"""The warm module runner (plugins/plugin_utils/_guest/module_runner.py) driven locally, as the mux drives it in a guest."""
import json
import os
import queue
import struct
import subprocess
import sys

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr


class LocalRunner:
    """A runner started with this Python and this core's runner config, in `workdir`; speaks its frames."""

    def __init__(self, workdir, env=None):
        self.proc = subprocess.Popen(module_runners.runner_python_argv(sys.executable),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=str(workdir),
                                     env=env or {"PATH": os.environ["PATH"], "TMPDIR": str(workdir)})
        kind, body = self.frame()[1:]
        assert kind == wr.READY, body

    def frame(self):
        head = self.proc.stdout.read(wr.HEADER.size)
        length, rid, kind = wr.HEADER.unpack(head)
        return rid, kind, self.proc.stdout.read(length)

    def send(self, rid, kind, body=b""):
        self.proc.stdin.write(wr.HEADER.pack(len(body), rid, kind) + body)
        self.proc.stdin.flush()

    def run(self, rid, run_env, data, before=None, hops=False):
        """Run a module payload (after the tmp ops `before`): (rc, stdout, stderr), or ("refused", reason, b"").

        `hops`: ask for the runner's timestamps; the EXIT's JSON is kept in self.last_exit."""
        meta = json.dumps(dict({"env": run_env}, **({"before": before} if before else {}),
                               **({"hops": 1} if hops else {}))).encode()
        self.send(rid, wr.RUN, struct.pack("!I", len(meta)) + meta + data)
        out, err = b"", b""
        while True:
            got, kind, body = self.frame()
            assert got == rid
            if kind == wr.REFUSE:
                return "refused", json.loads(body)["reason"], b""
            if kind == wr.OUT:
                out += body
            elif kind == wr.ERR:
                err += body
            elif kind == wr.EXIT:
                self.last_exit = json.loads(body)
                return self.last_exit["rc"], out, err

    def tmp(self, rid, op):
        """A task tmp dir op: the DONE answer ({"rc", "stdout", "stderr"}), or ("refused", reason)."""
        self.send(rid, wr.TMP, json.dumps(op).encode())
        got, kind, body = self.frame()
        assert got == rid
        if kind == wr.REFUSE:
            return "refused", json.loads(body)["reason"]
        assert kind == wr.DONE, kind
        return json.loads(body)

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=10) == 0


def fed_runner():
    """The mux's side of a warm runner with no stream: what it would send goes to `.feed` (unit tests)."""
    r = module_runners.ModuleRunner(client=None, interpreter="/usr/bin/python3")
    r.feed = queue.Queue()
    r.alive = True
    return r
