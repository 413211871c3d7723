# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Exec on the event stream with interactive stdin (page "How to Send Interactive Stdin to a Sandbox Command").

Used only for a command that needs stdin while it runs (su's password prompt) on a team whose platform offers
interactive stdin (`keep_stdin_open`, a per-team switch: 403 otherwise). Documented (18 Nov 2026): output "streams
over Server-Sent Events"; `keep_stdin_open: true` on the event stream keeps stdin open; the exec id "comes from the
started event"; stdin goes to `.../sandbox/exec/{exec_id}/stdin` as {data (base64), offset, eof}: `offset` is the
count of stdin bytes already accepted (equal appends, lower is a retry whose overlap is trimmed, higher is a 409),
at most 1 MiB a write; 404 for an unknown or finished exec, 409 for a closed stdin, an offset gap or a session that
cannot take it.

OUR READING, kept in this module alone (docs/platform-contract.md, "Data plane"): `Accept: text/event-stream`
asks for the stream; the started event's data is {"exec_id"}; `stdout` / `stderr` {"data": <base64>}, last
`exit` {"exit_code", "timed_out", "duration_ms"} or `error` {"message"}; comment lines are keepalives; a write's
answer carries the accepted `offset` (a write answered without one counts as taken, its bytes kept until one says
so: the client never depends on it alone).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import queue
import urllib.parse
from typing import Any, Iterator

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_http import READ_TIMEOUT, Call, Http
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

log = logging.getLogger("microvm.mux")

EVENT_STREAM = "text/event-stream"
STDIN_WRITE = 768 * 1024              # one interactive stdin write ("at most 1 MiB" each)
STDIN_RETRIES = 3                     # writes without an answer, in a row, before the command is stopped
RESEND_KEEP = 8 * 1024 * 1024         # sent bytes kept while writes are answered without an offset
TEAM_SETTING = "interactive stdin (keep_stdin_open), which the platform enables per team"


def start(api: Http, call: Call, body: dict) -> http.client.HTTPResponse:
    """Start the command with stdin kept open; HttpRefused (403: the team has no interactive stdin) propagates."""
    conn, resp = api.send("POST", "/sandbox/exec", json.dumps(dict(body, keep_stdin_open=True)).encode(),
                          {"Content-Type": "application/json", "Accept": EVENT_STREAM}, call=call)
    call.conn = conn
    if conn.sock is not None:
        conn.sock.settimeout(READ_TIMEOUT)
    return resp


def read_events(resp: http.client.HTTPResponse) -> Iterator[tuple[str, Any]]:
    """(event, data) pairs of a Server-Sent Events body; comments (keepalives) are skipped."""
    event: str | None = None
    data: list[str] = []
    while True:
        raw = resp.readline(8 * 1024 * 1024)
        if not raw:
            return
        line = raw.rstrip(b"\r\n").decode("utf-8")
        if not line:
            if event is not None or data:
                yield event or "message", json.loads("\n".join(data) or "{}")
            event, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def events(call: Call, resp: http.client.HTTPResponse, label: str) -> Iterator[tuple[str, Any]]:
    """('stdout'|'stderr', bytes) as they come and ('exit', ExecResult) last; CommandLost otherwise."""
    lost = "its event stream ended without an exit event"
    try:
        for event, data in read_events(resp):
            data = data if isinstance(data, dict) else {}
            if event == "started":
                exec_id = data.get("exec_id")
                if not isinstance(exec_id, str) or not exec_id or len(exec_id) > 200:
                    lost = "its started event carried no exec id (%r), so its stdin cannot be written" % (str(data)[:100],)
                    break
                call.exec_id = exec_id
            elif event in ("stdout", "stderr"):
                yield event, base64.b64decode(data.get("data") or "")
            elif event == "exit":
                code = data.get("exit_code")
                if not isinstance(code, int) or isinstance(code, bool):
                    lost = "its exit event carried no exit_code (%r)" % (str(data)[:100],)
                    break
                duration = data.get("duration_ms")
                yield "exit", ac.ExecResult(code, data.get("timed_out") is True,
                                            duration if isinstance(duration, int) and not isinstance(duration, bool) else 0)
                return
            elif event == "error":
                lost = str(data.get("message") or "the data plane reported an error")
                break
    except (OSError, http.client.HTTPException, ValueError, TypeError) as e:
        lost = "%s: %s" % ("cancelled" if call.cancelled.is_set() else "the event stream was cut", e)
    raise errors.CommandLost("lost the command on session %s: %s; it may have partly run and is not re-run" % (label, lost))


def write_stdin(api: Http, call: Call, feed: queue.Queue[bytes | None], label: str) -> None:
    """Forward the queue's stdin to the command as offset-keyed writes (StdinWriter), until its eof or its end."""
    while not call.exec_id and not call.cancelled.is_set():
        call.cancelled.wait(0.01)  # the exec id comes with the started event
    writer = StdinWriter(api, call, label)
    while not call.cancelled.is_set():
        item = feed.get()
        if item is None:
            writer.eof = True
        else:
            writer.held += item
        if not writer.flush() or writer.eof:
            return


class StdinWriter:
    """The stdin of one exec: the bytes the platform has not acknowledged yet are kept, so any write can be sent
    again from the last acknowledged offset (the platform trims the overlap of a lower offset)."""

    def __init__(self, api: Http, call: Call, label: str) -> None:
        self.api = api
        self.call = call
        self.label = label
        self.path = "/sandbox/exec/%s/stdin" % urllib.parse.quote(call.exec_id, safe="")
        self.acked = 0              # stdin bytes the platform acknowledged (a write's answered offset)
        self.held = bytearray()     # the bytes from `acked` on: first those sent unacknowledged, then the unsent
        self.sent = 0               # how many of `held` went out in writes answered without an offset
        self.eof = False            # the queue ended: the last write closes stdin
        self.eof_sent = False

    def flush(self) -> bool:
        """Write out what is held (and the eof once asked for); False when writing stops for good."""
        gap_resent = False
        failures = 0
        while self.sent < len(self.held) or (self.eof and not self.eof_sent):
            piece = bytes(self.held[self.sent:self.sent + STDIN_WRITE])
            offset = self.acked + self.sent
            doc: dict[str, int | str | bool] = {"offset": offset}
            if piece:
                doc["data"] = base64.b64encode(piece).decode()
            if self.eof and self.sent + len(piece) >= len(self.held):
                doc["eof"] = True
            failure: Exception | None = None
            try:
                answer = self._post(doc)
            except errors.HttpRefused as e:
                if e.status == 409 and self.sent and not gap_resent:
                    # an offset gap: the platform has fewer bytes than the writes answered without an offset went
                    # past; send again from the last acknowledged offset, which it trims to what it lacks
                    log.info("session %s: stdin write at offset %d refused (%s): sending again from offset %d",
                             self.label, offset, e, self.acked)
                    gap_resent, self.sent = True, 0
                    continue
                if e.status in (404, 409):  # the command ended, or closed its stdin: nothing is waiting for more
                    log.info("session %s: stdin write at offset %d refused (%s): the command has ended or closed its "
                             "stdin; %d bytes not written", self.label, offset, e, len(self.held) - self.sent)
                    return False
                if e.status < 500:
                    return self._give_up("refused (%s)" % e)
                failure = e
            except (OSError, http.client.HTTPException) as e:
                failure = e
            except errors.CommandLost as e:  # the link was closed: the command goes with it
                return self._give_up("not sent (%s)" % e)
            else:
                self._acknowledged(answer, offset, len(piece))
                self.eof_sent = self.eof_sent or bool(doc.get("eof"))
                continue
            # no answer (cut, or a 5xx): the write may have been taken; send again from the last acknowledged offset
            failures += 1
            if failures > STDIN_RETRIES:
                return self._give_up("failed %d times (last: %s)" % (failures, failure))
            log.info("session %s: stdin write failed (%s): sending again from offset %d", self.label, failure, self.acked)
            self.sent = 0
        return True

    def _post(self, doc: dict) -> dict:
        """One write's answer; a 2xx whose body is no JSON object counts as taken with no offset said."""
        try:
            return self.api.json_call("POST", self.path, doc)
        except (errors.HttpRefused, errors.CommandLost):
            raise
        except (ValueError, errors.SandboxError) as e:
            log.info("session %s: a stdin write was answered without a readable body (%s)", self.label, e)
            return {}

    def _give_up(self, why: str) -> bool:
        log.warning("session %s: a stdin write was %s; stopping the command, which would wait for it", self.label, why)
        self.call.cancel()
        return False

    def _acknowledged(self, answer: dict, offset: int, length: int) -> None:
        said = answer.get("offset")
        if isinstance(said, int) and not isinstance(said, bool) and self.acked <= said <= offset + length:
            del self.held[:said - self.acked]  # taken; what follows `said` is written next
            self.acked, self.sent = said, 0
            return
        self.sent += length  # answered without a usable offset: taken, and kept until an offset says so
        if self.sent > RESEND_KEEP:
            drop = self.sent - RESEND_KEEP
            del self.held[:drop]
            self.acked, self.sent = self.acked + drop, RESEND_KEEP
