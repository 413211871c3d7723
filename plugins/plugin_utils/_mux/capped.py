# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the mux keeps of the output of its own helper commands in a guest: a few KiB per stream, never more.

The mux runs small commands for itself (a run's TMPDIR, staged copies, sweeps, a file's size on the api
road). One mux carries every session of its user, so a guest whose tools print without end must not grow
it: the collector keeps HELPER_OUTPUT_LIMIT bytes of each stream, drains the rest without holding it, and
marks the result as cut. Task output (the exec and warm ops) streams to its worker and is bounded there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown

if TYPE_CHECKING:  # agent_client imports this module: the name only
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_client import ExecResult

HELPER_OUTPUT_LIMIT = 8 * 1024   # per stream: the longest thing the mux reads is a sweep's listing, bounded by it
CUT_NOTE = "(output cut at %d KiB)" % (HELPER_OUTPUT_LIMIT // 1024)


class Capped:
    """The first `limit` bytes of a stream; what comes later is only counted."""

    __slots__ = ("limit", "kept", "seen")

    def __init__(self, limit: int = HELPER_OUTPUT_LIMIT) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.seen = 0

    def add(self, data: bytes) -> None:
        self.seen += len(data)
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += data[:room]

    @property
    def cut(self) -> bool:
        return self.seen > len(self.kept)


def collect_exec(events: Iterable[tuple[str, Any]], limit: int = HELPER_OUTPUT_LIMIT) -> ExecResult:
    """The exit of one command's (kind, data) events, with at most `limit` bytes of its stdout and of its stderr
    on it (both roads); `truncated` says whether either was cut."""
    out, err = Capped(limit), Capped(limit)
    for kind, data in events:
        if kind == "stdout":
            out.add(data)
        elif kind == "stderr":
            err.add(data)
        else:
            data.stdout, data.stderr = bytes(out.kept), bytes(err.kept)
            data.truncated = out.cut or err.cut
            return data
    raise AssertionError("unreachable")  # an exec's events end with its exit, or raise


def complete_lines(result: ExecResult) -> list[str]:
    """The lines of a helper's stdout; a cut listing loses its partial last line (the caller sweeps the rest later)."""
    lines = result.stdout.decode("utf-8", "replace").split("\n")
    if result.truncated:
        lines = lines[:-1]
    return [line for line in lines if line]


def message(result: ExecResult) -> str:
    """A failed helper's stderr as an error message, saying so when it was cut."""
    err = shown(result.stderr, text=True).strip() or "exit code %d" % result.exit_code  # the guest's words, for the user
    return "%s %s" % (err, CUT_NOTE) if result.truncated else err
