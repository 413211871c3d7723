# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Where a become plugin's checks look in a command's growing output: only what is new, plus a bounded tail.

Until become succeeds, every output frame is searched for the plugin's prompt, success marker and password
errors. Searching the whole output each time costs O(n^2) for a guest that prints much before its prompt, so
each look covers only the output that arrived since the previous look plus OVERLAP bytes before it: enough
for anything those checks match (ansible-core's success marker is a `BECOME-SUCCESS-<32 letters>` line,
prompts and error texts are short), so one split across frames is still found whole.
"""

from __future__ import annotations

import re

# Bytes of already searched output searched again with new output: far more than any prompt, success marker or
# password error text a become plugin matches, small enough that each look costs O(new output).
OVERLAP = 4096

_LINE_END = re.compile(rb"[\r\n]")


class Tail:
    """One output stream (stdout or stderr) of a command being watched for become."""

    def __init__(self) -> None:
        self.seen = 0  # bytes of the stream searched so far
        self.floor = 0  # where the output after the last answered prompt begins

    def look(self, data: bytes | bytearray) -> tuple[bytes, bytes] | None:
        """(window, its part after the answered prompt) for the output `data` (the whole stream so far, not
        copied), or None when nothing arrived since the last look: every check already saw all of it.

        The window starts OVERLAP bytes before the new output, moved on to the first line start in that reach
        so that checks matching at the start of a line (ansible-core's prompt check) do not take a cut through
        a line for one.
        """
        end = len(data)
        if end <= self.seen:
            return None
        start = max(0, self.seen - OVERLAP)
        if start and data[start - 1] not in b"\r\n":
            line_end = _LINE_END.search(data, start, self.seen)
            if line_end is not None:
                start = line_end.end()
        self.seen = end
        window = bytes(data[start:])
        return window, window[max(0, self.floor - start):]

    def answered(self, data: bytes | bytearray) -> None:
        """A prompt was answered: later checks for another prompt or a refused password start after `data`."""
        self.floor = len(data)
