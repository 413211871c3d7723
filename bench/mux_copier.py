"""Copies through a shared mux started by a given Python, for bench/connection_bench.py.

MuxClient starts its mux with the Python it runs on (sys.executable) and the environment it runs in, so a mux on
another venv's Python (the newest ansible-core's) or with another environment (MICROVM_MUX_BULK=off) is started by
running this script with that Python and that environment: `MuxCopier` (the bench's side) starts it as a child;
`main()` (the child's side) attaches a MuxClient to the session and does each copy asked for, timing it itself.

The wire, one JSON object a line: first the bench sends {mux_dir, session, api_url, token} (the token on stdin,
never in argv or the environment) and the child answers {ok, python, ansible_core, mux_pid}; then requests
{op: put|fetch, local, remote} -> {ok, seconds, reply} (reply: the mux's answer as it came, e.g. "via" once the
bulk path lands) and {op: rm, paths} -> {ok, rc}. An error is {ok: false, error}.
"""
import json
import os
import subprocess
import sys
import time
from typing import Any


class MuxCopier:
    """A child process on `python` with `env` whose MuxClient (and so whose mux) copies to and from one session."""

    def __init__(self, python: str, env: dict[str, str], mux_dir: str, session: str, api_url: str, token: str) -> None:
        self.mux_dir = mux_dir
        self.python = python
        self.proc = subprocess.Popen([python, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        self.hello = self._call({"mux_dir": mux_dir, "session": session, "api_url": api_url, "token": token})

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the mux copier on %s ended (exit %s); its mux's log is under %s"
                               % (self.python, self.proc.wait(), self.mux_dir))
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError("mux copier (%s): %s" % (request.get("op", "start"), answer.get("error")))
        return answer

    def put(self, local: str, remote: str) -> dict[str, Any]:
        """{seconds, reply} of one upload, timed in the child around the mux's request alone."""
        return self._call({"op": "put", "local": local, "remote": remote})

    def fetch(self, remote: str, local: str) -> dict[str, Any]:
        return self._call({"op": "fetch", "local": local, "remote": remote})

    def remove(self, paths: list[str]) -> None:
        """rm -f the guest's `paths` (outside any timed copy)."""
        if self._call({"op": "rm", "paths": paths})["rc"] != 0:
            raise RuntimeError("could not remove %s in the guest" % " ".join(paths))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> None:
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient

    def answer(payload: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()

    start = json.loads(sys.stdin.readline())
    try:
        from ansible.release import __version__ as core
    except ImportError:
        core = ""
    mux = MuxClient(start["mux_dir"], LinkConfig(session=start["session"], token=start["token"], api_url=start["api_url"],
                                                 persist=300, transport="agent")).connect()
    attached = mux.attached or {}
    answer({"ok": True, "python": sys.version.split()[0], "ansible_core": core, "mux_pid": attached.get("pid")})
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "rm":
                rc = mux.exec(["rm", "-f", "--"] + req["paths"])[0]
                answer({"ok": True, "rc": rc})
                continue
            began = time.perf_counter()
            reply = mux.put(req["local"], req["remote"]) if req["op"] == "put" else mux.fetch(req["remote"], req["local"])
            answer({"ok": True, "seconds": time.perf_counter() - began, "reply": reply})
        except Exception as e:  # the bench reports it and stops
            answer({"ok": False, "error": "%s: %s" % (type(e).__name__, e)})
    mux.close()


if __name__ == "__main__":
    main()
