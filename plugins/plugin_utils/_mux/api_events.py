# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Exec over Server-Sent Events with interactive stdin: OUR READING of a stream no page spells out.

Used only for a command that needs stdin while it runs (su's password prompt) on a team whose platform offers
interactive stdin (`keep_stdin_open`, a per-team switch: 403 otherwise). The pages say output "streams over
Server-Sent Events" and that the exec id "comes from the started event"; the event names and shapes below are
our reading (docs/platform-contract.md, section 0, "Decisions"), kept in this module alone:

- `Accept: text/event-stream` asks for the stream;
- `started` {"exec_id"}, then `stdout` / `stderr` {"data": <base64>}, last `exit` {"exit_code", "timed_out",
  "duration_ms"} or `error` {"message"}; comment lines are keepalives.

Stdin goes to `.../sandbox/exec/{exec_id}/stdin` as documented: {data (base64), offset, eof}, at most 1 MiB a
write, a retry at the same offset trimmed by the platform.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import queue
from typing import Any, Iterator

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_http import READ_TIMEOUT, Call, Http
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

log = logging.getLogger("microvm.mux")

EVENT_STREAM = "text/event-stream"
STDIN_WRITE = 768 * 1024              # one interactive stdin write ("at most 1 MiB" each)
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
            if event == "started":
                call.exec_id = str(data.get("exec_id") or "")
            elif event in ("stdout", "stderr"):
                yield event, base64.b64decode(data.get("data") or "")
            elif event == "exit":
                yield "exit", ac.ExecResult(int(data.get("exit_code", -1)), bool(data.get("timed_out")),
                                            int(data.get("duration_ms") or 0))
                return
            elif event == "error":
                lost = str(data.get("message") or "the data plane reported an error")
                break
    except (OSError, http.client.HTTPException, ValueError) as e:
        lost = "%s: %s" % ("cancelled" if call.cancelled.is_set() else "the event stream was cut", e)
    raise errors.CommandLost("lost the command on session %s: %s; it may have partly run and is not re-run" % (label, lost))


def write_stdin(api: Http, call: Call, feed: queue.Queue[bytes | None], label: str) -> None:
    """Forward the queue's stdin as offset-keyed writes; a failed write is retried once at its offset."""
    offset = 0
    while not call.exec_id and not call.cancelled.is_set():
        call.cancelled.wait(0.01)  # the exec id comes with the started event
    while not call.cancelled.is_set():
        item = feed.get()
        eof = item is None
        data = b"" if item is None else bytes(item)
        for i in range(0, max(len(data), 1), STDIN_WRITE):
            piece = data[i:i + STDIN_WRITE]
            last = eof or i + STDIN_WRITE >= len(data)
            doc: dict[str, int | str | bool] = {"offset": offset}
            if piece:
                doc["data"] = base64.b64encode(piece).decode()
            if eof and last:
                doc["eof"] = True
            if len(doc) == 1:
                continue
            for attempt in (1, 2):
                try:
                    offset = int(api.json_call("POST", "/sandbox/exec/%s/stdin" % call.exec_id, doc)
                                 .get("offset", offset + len(piece)))
                    break
                except errors.HttpRefused as e:
                    log.info("session %s: stdin write refused (%s): the command has ended", label, e)
                    return
                except (OSError, http.client.HTTPException) as e:
                    if attempt == 2:
                        log.warning("session %s: stdin write failed twice: %s; stopping the command", label, e)
                        call.cancel()
                        return
        if eof:
            return
