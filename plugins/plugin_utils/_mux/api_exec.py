# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Commands on the api road through the documented buffered exec, with nothing cut and no 240 s limit.

`POST .../sandbox/exec` {argv, workdir?, stdin? (base64, one-shot), timeout_seconds?} answers
{exit_code, stdout, stderr, duration_ms} once the command is over, each stream capped at 1 MiB and the
timeout clamped server-side (default 60, maximum 240) (EXEC, DOCTL-EXEC; docs/platform-contract.md, section 0).
Every command runs as a JOB so that neither bound reaches it:

- a small sh script (JOB_SCRIPT, the guest program _guest/api_job.sh; argv has no shell, so it is
  ["/bin/sh", "-c", script, "sh", ...]) keeps the one-shot stdin in a file of the job's dir, starts the
  command in its own session (setsid) with its stdout and stderr in files there, and waits for it at most
  one slice (WAIT_SLICE, under the clamp);
- a command that ends within the slice answers in that same exec, its output inline (base64: the answer's
  text would not carry every byte) when the rest fits well under the cap, else the files are downloaded
  through the documented file API and removed; a cut is never taken for the whole;
- a longer one is polled with short execs (each waits at most one slice, less once STEP new bytes of output
  are there, which it brings), so output flows while it runs; it is stopped (its process group killed) at its
  timeout, when its worker goes away, when the road gives up, or as soon as it has printed more than the
  task's output limit (the worker's max_output_bytes, sent with the exec): the job runs ahead of the road up
  to that limit and reports what it wrote, so output the worker would only drop is never moved;
- stdin bigger than one request body carries is uploaded into the job dir first (staged).

What the script says about the job comes on the last line of stderr, after a marker (TRAILER): `done <rc>
<stdout bytes> <stderr bytes> <kept>`, `running <stdout bytes> <stderr bytes>` (read so far), or `absent`. An
answer without it (the exec was cut by the platform's clamp, say) is followed by a probe of the job; a job that
never started is reported with what the script printed. The truncation headers are OUR READING (no page names
them): TRUNCATED_HEADERS, used only as a second witness beside a stream's length reaching the cap.
"""

from __future__ import annotations

import http.client
import json
import base64
import logging
import os
import posixpath
import tempfile
import time
import uuid
from typing import Any, Callable, Iterator, Mapping, Sequence

from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import script_of
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_http import READ_TIMEOUT, Call, Http
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_transfer import Transfers
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

log = logging.getLogger("microvm.mux")

EXEC_MAX_TIMEOUT = 240                # "Clamped server-side (default 60, maximum 240)" (post_session_sandbox_exec)
STREAM_CAP = 1024 * 1024              # "capped at 1 MiB each"
ONE_SHOT_MAX = 512 * 1024             # stdin bytes sent inline; base64 of more would pass a 1 MiB request body
INLINE_MAX = 640 * 1024               # output bytes the script sends inline at the end: as base64, under the cap
STEP = 512 * 1024                     # output bytes a poll of a running job brings, per stream (base64: under the cap)
BACKLOG = 4 * 1024 * 1024             # output not yet read past which a job is paused (SIGSTOP) until the road catches up
WAIT_SLICE = 20                       # seconds one exec waits for a job: well under idle cuts of proxies on the way
SLICE_MARGIN = 10                     # the exec's timeout_seconds is its slice plus this
STDIN_INLINE, STDIN_STAGED, STDIN_NONE = "0", "1", "2"  # how the job script gets the command's stdin
HELPER_TIMEOUT = 60                   # the documented default, for the road's own short commands
JOBS_DIR = "jobs"                     # under the mux's api dir (run_dirs.api_dir_name), which a later link sweeps
TRAILER = b"@@microvm-api-job@@"
# its last word's shapes: done <rc> <out> <err> <kept>, running <out> <err> [<written>] (the warm client's has
# no <written>), absent
TRAILER_WORDS = {"done": (5,), "running": (3, 4), "absent": (1,)}
# OUR READING: no page names the headers that tell a cut ("truncation is indicated via response headers when
# present"); these are the local plane's. Never the only witness: a stream as long as the cap is taken as cut too.
TRUNCATED_HEADERS = {"stdout": "X-Exec-Stdout-Truncated", "stderr": "X-Exec-Stderr-Truncated"}

JOB_SCRIPT = script_of("api_job.sh", {"TRAILER": TRAILER.decode(), "INLINE": INLINE_MAX, "STEP": STEP, "BACKLOG": BACKLOG})


class Answer:
    """One buffered exec answer, as the pages print it: stdout and stderr are text; `cut` names the streams cut."""

    __slots__ = ("exit_code", "stdout", "stderr", "duration_ms", "cut")

    def __init__(self, exit_code: int, stdout: bytes, stderr: bytes, duration_ms: int, cut: tuple[str, ...]) -> None:
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.duration_ms = duration_ms
        self.cut = cut


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def parse_answer(doc: Any, headers: Mapping[str, str] | http.client.HTTPMessage | None = None) -> Answer:
    """The documented answer {exit_code, stdout, stderr, duration_ms}; a stream is cut when its header says so
    (our reading) or when it is as long as the cap."""
    if not isinstance(doc, dict) or isinstance(doc.get("exit_code"), bool) or not isinstance(doc.get("exit_code"), int):
        raise errors.SandboxError("the data plane answered an exec without an exit_code (%r, not the documented "
                                  "{exit_code, stdout, stderr, duration_ms}): the command may have run, and is not "
                                  "re-run. Check that api_url and route_prefix name the platform's API (a proxy or an "
                                  "older API answers so), or use transport agent" % (str(doc)[:200],))
    streams = {}
    for name in ("stdout", "stderr"):
        value = doc.get(name) or ""
        if not isinstance(value, str):
            raise errors.SandboxError("the data plane answered an exec with a %s that is not text: %r" % (name, str(value)[:100]))
        streams[name] = value.encode("utf-8", "surrogateescape")
    cut = tuple(name for name in ("stdout", "stderr")
                if len(streams[name]) >= STREAM_CAP or _truthy((headers or {}).get(TRUNCATED_HEADERS[name])))
    duration = doc.get("duration_ms")
    return Answer(doc["exit_code"], streams["stdout"], streams["stderr"],
                  duration if isinstance(duration, int) and not isinstance(duration, bool) else 0, cut)


def trailer(answer: Answer) -> tuple[list[str], bytes] | None:
    """(the job script's last word, split; the command's stderr before it), or None when it is missing."""
    at = answer.stderr.rfind(b"\n" + TRAILER + b" ")
    if at < 0 or not answer.stderr.endswith(b"\n"):
        return None
    words = answer.stderr[at + 1:].decode("ascii", "replace").split()[1:]
    # the guest is hostile: only the script's own shapes, numbers that fit, count (anything else: no trailer)
    if not words or any(not w.isdigit() or len(w) > 18 for w in words[1:]) or len(words) not in TRAILER_WORDS.get(words[0], ()):
        return None
    return words, answer.stderr[:at]


class Jobs:
    """Buffered execs of one session (the road's client holds one): `raw` for the road's own short commands,
    `run` for a command as a job."""

    def __init__(self, http: Http, transfers: Transfers, label: str, api_dir: str) -> None:
        self.http = http
        self.transfers = transfers
        self.label = label
        self.jobs_dir = posixpath.join(api_dir, JOBS_DIR)
        self.slice = min(WAIT_SLICE, EXEC_MAX_TIMEOUT - SLICE_MARGIN)  # lowered when the platform clamps harder

    # -- one exec ---------------------------------------------------------------------------
    def raw(self, argv: Sequence[str], stdin: bytes = b"", timeout: int = HELPER_TIMEOUT, workdir: str = "",
            call: Call | None = None) -> Answer:
        """One documented exec, buffered; HttpRefused and connection failures become the road's errors."""
        body: dict[str, Any] = {"argv": list(argv), "timeout_seconds": int(timeout)}
        if workdir:
            body["workdir"] = workdir
        if stdin:
            body["stdin"] = base64.b64encode(stdin).decode()
        try:
            conn, resp = self.http.send("POST", "/sandbox/exec", json.dumps(body).encode(),
                                        {"Content-Type": "application/json", "Accept": "application/json"}, call=call)
        except errors.HttpRefused as e:
            if e.status in (404, 410):
                raise errors.CommandLost("session %s cannot run the command: %s" % (self.label, e)) from e
            if e.status >= 500 or e.status in (408, 409, 429):
                raise errors.GuestUnavailable("session %s did not take the command: %s; nothing was run" % (self.label, e)) from e
            raise errors.SandboxError("the data plane refused the command on session %s: %s" % (self.label, e)) from e
        except ConnectionRefusedError as e:
            raise errors.GuestUnavailable("cannot reach the API for session %s: %s; nothing was run" % (self.label, e)) from e
        except (OSError, http.client.HTTPException) as e:
            raise errors.CommandLost("lost the command on session %s before its answer: %s; it may have partly run "
                                     "and is not re-run" % (self.label, e)) from e
        try:
            if conn.sock is not None:
                conn.sock.settimeout(max(READ_TIMEOUT, timeout + SLICE_MARGIN))
            raw = resp.read(16 * STREAM_CAP)  # two capped streams, escaped in JSON at worst
            answer = parse_answer(json.loads(raw.decode("utf-8") or "{}"), resp.headers)
        except (OSError, http.client.HTTPException, ValueError) as e:
            if call is not None:
                call.conn = None
            conn.close()
            raise errors.CommandLost("lost the answer of a command on session %s: %s; it may have partly run and is "
                                     "not re-run" % (self.label, e)) from e
        self.http.release(conn, resp, call)  # kept for the next call when it was read whole
        return answer

    def _script(self, mode: str, job: str, wait: int, have: tuple[int, int] = (0, 0), args: Sequence[str] = (),
                stdin: bytes = b"", workdir: str = "", call: Call | None = None) -> Answer:
        """One run of JOB_SCRIPT; `have` is the stdout and stderr bytes already read."""
        limit = call.output_limit if call is not None else 0
        return self._slice(["/bin/sh", "-c", JOB_SCRIPT, "sh", mode, job, str(wait), str(have[0]), str(have[1]), str(limit)]
                           + list(args), wait, stdin, workdir, call)

    def _slice(self, argv: Sequence[str], wait: int, stdin: bytes = b"", workdir: str = "", call: Call | None = None) -> Answer:
        """One exec that answers like the job script within `wait` seconds (the job script, or a warm client)."""
        answer = self.raw(argv, stdin=stdin, timeout=wait + SLICE_MARGIN, workdir=workdir, call=call)
        if trailer(answer) is None and 1000 <= answer.duration_ms < wait * 1000:
            # the platform ended the exec before its slice: it clamps harder than documented; wait less per exec
            self.slice = max(1, min(self.slice, answer.duration_ms // 1000 - 1))
            log.info("session %s: an exec ended after %d ms, before its %d s: waiting %d s per exec from now on",
                     self.label, answer.duration_ms, wait, self.slice)
        return answer

    # -- a command as a job -----------------------------------------------------------------
    def run(self, call: Call, stdin: bytes, start: Callable[[str, int], list[str]] | None = None) -> Iterator[tuple[str, Any]]:
        """('stdout'|'stderr', bytes) as they come and last ('exit', ExecResult) of call.argv run as a job;
        CommandLost otherwise.

        With `start`, the first exec is start(job dir, seconds to wait) with `stdin`, a guest program that answers
        like the job script and leaves a job dir like its jobs when it hands over (_guest/warm_client.py); the rest
        (polls, kill, download, drop) is the same."""
        job = posixpath.join(self.jobs_dir, uuid.uuid4().hex)
        started = time.monotonic()
        deadline = started + call.timeout if call.timeout else None
        finished = False
        timed_out = False
        have = [0, 0]  # stdout and stderr bytes read so far
        try:
            staged = len(stdin) > ONE_SHOT_MAX
            if staged and start is not None:
                raise errors.SandboxError("session %s: %d bytes of stdin do not fit one exec" % (self.label, len(stdin)))
            if staged:
                self._stage(stdin, job)
            how = STDIN_STAGED if staged else STDIN_INLINE if stdin else STDIN_NONE  # none: never wait on an open stdin
            if start is not None:
                wait = self._wait(deadline)
                answer = self._slice(start(job, wait), wait, stdin, call.workdir, call)
            else:
                answer = self._script("run", job, self._wait(deadline), (0, 0), [how] + list(call.argv),
                                      stdin=b"" if staged else stdin, workdir=call.workdir, call=call)
            probed = False
            while True:
                said = trailer(answer)
                if said is None:
                    if probed:
                        raise errors.CommandLost("session %s: the command's job at %s does not answer (%s); it may have "
                                                 "partly run and is not re-run" % (self.label, job, _text(answer.stderr)))
                    probed = True
                    first = answer
                    answer = self._script("wait", job, 0, (have[0], have[1]), call=call)
                    if (trailer(answer) or [[""]])[0][:1] == ["absent"]:
                        raise errors.SandboxError("session %s: the command could not be started (exit code %d): %s"
                                                  % (self.label, first.exit_code, _text(first.stderr)))
                    continue
                probed = False
                words, b64err = said
                if words[:1] == ["done"]:
                    self._check_limit(call, int(words[2]) + int(words[3]))  # none of it is downloaded then
                    break
                if words[:1] != ["running"]:
                    raise errors.CommandLost("session %s: the command's job at %s is gone before its end was read (%s); "
                                             "it may have partly run and is not re-run" % (self.label, job, " ".join(words)))
                if len(words) == 4:
                    self._check_limit(call, int(words[3]))
                yield from self._inline(answer.stdout, b64err, have, int(words[1]), int(words[2]))
                self._check_cancelled(call)
                if deadline is not None and time.monotonic() >= deadline:
                    timed_out = True
                    answer = self._script("kill", job, 0, (have[0], have[1]), call=call)
                else:
                    answer = self._script("wait", job, self._wait(deadline), (have[0], have[1]), call=call)
            yield from self._output(answer, job, have)
            finished = True
        except errors.SandboxError:
            self._check_cancelled(call)
            raise
        finally:
            if not finished:
                self._drop(job)
        yield "exit", ac.ExecResult(int(words[1]), timed_out, int((time.monotonic() - started) * 1000))

    def _inline(self, b64out: bytes, b64err: bytes, have: list[int], out_to: int, err_to: int) -> Iterator[tuple[str, bytes]]:
        """The output an answer carried (base64), checked against the offsets the script says it reached."""
        try:
            out, err = base64.b64decode(b64out), base64.b64decode(b64err)
        except ValueError as e:
            raise errors.CommandLost("session %s: the output of a command came garbled (%s); it is not re-run" % (self.label, e)) from e
        if len(out) != out_to - have[0] or len(err) != err_to - have[1]:
            raise errors.CommandLost("session %s: the output of a command came cut (%d and %d bytes, %d and %d sent); it "
                                     "is not re-run" % (self.label, len(out), len(err), out_to - have[0], err_to - have[1]))
        have[0], have[1] = out_to, err_to
        if out:
            yield "stdout", out
        if err:
            yield "stderr", err

    def _wait(self, deadline: float | None) -> int:
        if deadline is None:
            return self.slice
        return max(0, min(self.slice, int(deadline - time.monotonic() + 0.999)))

    def _check_limit(self, call: Call, written: int) -> None:
        """A job that printed more than its task may hold is stopped (by run's drop) before its output is moved:
        the worker would only drop it, and moving it (512 KiB an exec) could take minutes on a busy mux."""
        if call.output_limit and written > call.output_limit:
            raise errors.OutputOverLimit(self.label, call.output_limit, "%d when it was stopped" % written)

    def _check_cancelled(self, call: Call) -> None:
        if call.cancelled.is_set():
            raise errors.CommandLost("the command on session %s was stopped: its worker went away" % self.label)

    def _stage(self, stdin: bytes, job: str) -> None:
        """Upload a stdin too big for one request into the job dir (the job script reads it from there)."""
        made = self.raw(["mkdir", "-p", "--", job])
        if made.exit_code != 0:
            raise errors.SandboxError("session %s: cannot make the job dir %s: %s" % (self.label, job, _text(made.stderr)))
        fd, local = tempfile.mkstemp(prefix=".microvm-stdin.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(stdin)
            self.transfers.upload(local, posixpath.join(job, "in"))
        finally:
            os.unlink(local)

    def _output(self, answer: Answer, job: str, have: list[int]) -> Iterator[tuple[str, bytes]]:
        """The rest of the command's stdout and stderr, whole: inline when the script sent it, else downloaded."""
        said = trailer(answer)
        if said is None:  # never: only a done answer comes here
            raise errors.CommandLost("session %s: the end of the command was not read" % self.label)
        words, b64err = said
        sizes = (int(words[2]), int(words[3]))
        if words[4] == "0":
            if answer.cut:
                raise errors.CommandLost("session %s: the platform cut the %s of a command the road sent whole; its "
                                         "output is lost (not re-run)" % (self.label, " and ".join(answer.cut)))
            yield from self._inline(answer.stdout, b64err, have, sizes[0], sizes[1])
            return
        try:
            for i, name in enumerate(("stdout", "stderr")):
                if sizes[i] > have[i]:
                    yield from self._fetch(posixpath.join(job, "out" if i == 0 else "err"), name, sizes[i], have[i])
        finally:
            self._drop(job)

    def _fetch(self, remote: str, name: str, size: int, skip: int) -> Iterator[tuple[str, bytes]]:
        """A job's output file through the file API, from byte `skip` on (what came before was read already)."""
        fd, local = tempfile.mkstemp(prefix=".microvm-%s." % name)
        os.close(fd)
        try:
            got = self.transfers.download(remote, local)
            if got != size:
                raise errors.CommandLost("session %s: the %s of the command is %d bytes in the guest, %d came; it is "
                                         "not re-run" % (self.label, name, size, got))
            with open(local, "rb") as f:
                f.seek(skip)
                for chunk in iter(lambda: f.read(STREAM_CAP), b""):
                    yield name, chunk
        finally:
            os.unlink(local)

    def _drop(self, job: str) -> None:
        """Stop a job that is still running and remove its dir (best effort: a sweep of the scratch dir is next)."""
        try:
            self._script("drop", job, 0)
        except errors.SandboxError as e:
            log.warning("session %s: could not stop and remove the job %s: %s", self.label, job, e)


def _text(data: bytes) -> str:
    return data[-500:].decode("utf-8", "replace").strip() or "no message"
