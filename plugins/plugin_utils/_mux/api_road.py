# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The second road into a sandbox: the platform's documented exec and file API.

The mux's SessionLink uses ApiRoadClient in place of the gRPC AgentClient when the connection's
`transport` is `api`, or `auto` and the agent port does not answer; it has the same methods
(exec_stream, iter_exec, exec, upload, download, close), so every op of the mux runs unchanged
on either road. Its parts, one job each:

- api_http.py: the HTTP calls of one session (errors.HttpRefused for an error status);
- api_exec.py: the documented buffered exec, the road's first language: every command runs as a job
  that no output cap and no 240 s clamp cuts (big output downloaded, long tasks polled, stdin staged);
- api_events.py: the event stream with interactive stdin (documented 18 Nov 2026; the stream's event shapes
  are still OUR READING, kept there), used only for a command that needs stdin while it runs, on a team whose
  platform offers it (403 otherwise, remembered per link);
- api_transfer.py: the workspace upload and download, and the staged transfers past their bounds.

No per-command env: it is carried by `/usr/bin/env -- NAME=VALUE ... argv` (docs/connection.md,
"Transports"; docs/platform-contract.md, section 7).
"""

from __future__ import annotations

import logging
import posixpath
import queue
import threading
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_events
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import capped
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import run_dirs
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_exec import EXEC_MAX_TIMEOUT, Jobs
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_http import COPY_CHUNK, Call, Http
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.api_transfer import Transfers
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

if TYPE_CHECKING:
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink

log = logging.getLogger("microvm.mux")

TRANSPORTS = ("agent", "api", "auto")
AUTO_PROBE_SECONDS = 5.0              # auto: how long the agent port may take to answer before the api road is used


def env_argv(argv: Sequence[str], env: dict[str, str] | None) -> list[str]:
    """argv with the per-command environment the documented exec lacks, through env(1)."""
    if not env:
        return list(argv)
    for name in env:
        if not name or "=" in name or "\0" in name:
            raise errors.SandboxError("environment variable name %r cannot be passed to a command" % name)
    return ["/usr/bin/env", "--"] + ["%s=%s" % (k, v) for k, v in sorted(env.items())] + list(argv)


class ApiRoadClient:
    """Exec, upload and download through the documented data plane of one session."""

    channel = None  # no gRPC channel on this road

    def __init__(self, api_url: str, prefix: str, token: str, session_id: str, label: str,
                 scratch_dir: str = profile.SCRATCH_DIR, validate_certs: bool = True, connect_timeout: float = 60.0,
                 host_tag: str = "") -> None:
        self.label = label
        self.scratch_dir = scratch_dir
        self.api_dir = posixpath.join(scratch_dir, run_dirs.api_dir_name(host_tag))  # swept by a later link once we are gone
        self.http = Http(api_url, prefix, token, session_id, label, validate_certs=validate_certs,
                         connect_timeout=connect_timeout)
        self.transfers = Transfers(self.http, label, scratch_dir, self._remote_size)
        self.jobs = Jobs(self.http, self.transfers, label, self.api_dir)
        self.interactive: bool | None = None  # the team's switch, learnt from the first keep_stdin_open (403 = off)

    def __repr__(self) -> str:
        return "ApiRoadClient(%r)" % self.label

    def close(self) -> None:
        self.http.close()

    # -- exec -------------------------------------------------------------------------------
    def exec_stream(self, argv: Sequence[str], env: dict[str, str] | None = None, workdir: str = "", timeout: int = 0,
                    stdin: bytes | None = None, deadline: float | None = None,
                    hold_stdin: bool = False, output_limit: int = 0) -> tuple[Call, queue.Queue[bytes | None]]:
        """Prepare a command; returns (call, stdin_queue) like AgentClient.exec_stream.

        It starts in iter_exec: as a buffered job once the queue's stdin is complete (put(None)); with
        `hold_stdin` (stdin arrives while it runs) on the event stream at once, if the team has interactive stdin.
        `output_limit` (the worker's max_output_bytes, 0 = none): a job whose output passes it is stopped at once
        (api_exec.Jobs.run); the event stream streams, so there the worker's own count stops it.
        """
        if hold_stdin and self.interactive is False:
            raise errors.SandboxError(self._needs_interactive())
        call = Call(env_argv(argv, env), workdir or "", int(timeout or 0), bool(hold_stdin))
        call.output_limit = max(0, int(output_limit or 0))
        feed: queue.Queue[bytes | None] = queue.Queue()
        if stdin is not None:
            if stdin:
                feed.put(bytes(stdin))
            feed.put(None)
        return call, feed

    def _needs_interactive(self) -> str:
        return ("session %s: this command needs stdin while it runs (su's password prompt), which the api "
                "transport carries only with %s; it is not enabled for this team (the platform answered 403). Use "
                "become_method sudo (its password goes with the command), enable interactive stdin for the team, use "
                "transport agent, connect as root (su from root asks for no password), or become without a password "
                "(NOPASSWD). Nothing was run."
                % (self.label, api_events.TEAM_SETTING))

    def iter_exec(self, call: Call, feed: queue.Queue[bytes | None] | None = None) -> Iterator[tuple[str, Any]]:
        """Yield ('stdout'|'stderr', bytes) and finally ('exit', ExecResult); raise CommandLost otherwise."""
        feed = feed if feed is not None else queue.Queue()
        try:
            if call.hold_stdin:
                yield from self._iter_events(call, feed)
                return
            stdin = _collect(feed)
            if call.cancelled.is_set():  # the worker went away before its stdin was complete: never start it
                raise errors.CommandLost("the command on session %s was cancelled before it started" % self.label)
            yield from self.jobs.run(call, stdin)
        finally:
            feed.put(None)  # unblock a stdin writer if stdin never ended

    def _iter_events(self, call: Call, feed: queue.Queue[bytes | None]) -> Iterator[tuple[str, Any]]:
        body: dict[str, Any] = {"argv": call.argv, "timeout_seconds": min(call.timeout or EXEC_MAX_TIMEOUT, EXEC_MAX_TIMEOUT)}
        if call.workdir:
            body["workdir"] = call.workdir
        finished = False
        try:
            try:
                resp = api_events.start(self.http, call, body)
            except errors.HttpRefused as e:
                if e.status == 403:
                    self.interactive = False
                    raise errors.SandboxError(self._needs_interactive()) from e
                raise errors.GuestUnavailable("session %s did not take the command: %s; nothing was run" % (self.label, e)) from e
            except (OSError, ValueError) as e:
                raise errors.CommandLost("lost the command on session %s before its answer: %s; it may have partly "
                                         "run and is not re-run" % (self.label, e)) from e
            self.interactive = True
            writer = threading.Thread(target=api_events.write_stdin, args=(self.http, call, feed, self.label),
                                      name="api-stdin", daemon=True)
            writer.start()
            for kind, data in api_events.events(call, resp, self.label):
                if kind == "exit" and data.timed_out and not call.timeout:
                    log.warning("session %s: a command ran into the platform's %d s exec limit", self.label, EXEC_MAX_TIMEOUT)
                yield kind, data
            finished = True
        finally:
            if not finished:
                call.cancel()  # a consumer that gave up, or a failure: the command must not run on
            if call.conn is not None:
                call.conn.close()

    def exec(self, argv: Sequence[str], env: dict[str, str] | None = None, workdir: str = "", timeout: int = 0, stdin: bytes = b"",
             deadline: float | None = None) -> ac.ExecResult:
        """Run a command to completion (the mux's own helpers): at most capped.HELPER_OUTPUT_LIMIT of stdout and stderr."""
        call, feed = self.exec_stream(argv, env=env, workdir=workdir, timeout=timeout, stdin=stdin or b"")
        return capped.collect_exec(self.iter_exec(call, feed))

    def _remote_size(self, remote_path: str) -> int | None:
        """The guest's word on a file's size (it only picks the download's way: both ways bound and verify it)."""
        try:
            res = self.jobs.raw(["stat", "-L", "-c", "%s", "--", remote_path])
        except errors.SandboxError:
            return None
        text = res.stdout.strip()
        if res.exit_code != 0 or not text.isdigit() or len(text) > 20:
            return None  # a missing file: the download says so
        return int(text)

    # -- files ------------------------------------------------------------------------------
    def upload(self, local_path: str, remote_path: str, mode: int = 0, chunk_size: int = COPY_CHUNK, is_archive: bool = False) -> int:
        """Stream a local file to a guest path under the transfer root (X-Content-Sha256); returns bytes written."""
        return self.transfers.upload(local_path, remote_path, mode, chunk_size, is_archive)

    def download(self, remote_path: str, local_path: str, chunk_size: int = COPY_CHUNK) -> int:
        """Fetch a guest file to local_path, verified, then renamed into place; a file past the streaming bound is staged."""
        return self.transfers.download(remote_path, local_path, chunk_size)


def _collect(feed: queue.Queue[bytes | None]) -> bytes:
    parts: list[bytes] = []
    while True:
        item = feed.get()
        if item is None:
            return b"".join(parts)
        parts.append(item)


def attach(link: SessionLink) -> None:
    """Give a SessionLink (_mux/session_link.py) the api road: its client and its warm runners."""
    cfg = link.cfg
    link.road = "api"
    link.client = ApiRoadClient(cfg.api_url, cfg.prefix, cfg.token, link.resolved_id, link.label,
                                scratch_dir=cfg.scratch_dir, validate_certs=cfg.validate_certs, host_tag=cfg.host_tag,
                                connect_timeout=min(cfg.connect_timeout, 30.0))
    link.runners = module_runners.ApiModuleRunners(link.client, cfg.scratch_dir)
    log.info("session %s: using the documented exec and file API (transport %s)", link.label, cfg.transport)
