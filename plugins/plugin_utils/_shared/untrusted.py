# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What a guest sends, made safe to show: file names, error text and output quoted in warnings, diffs and errors.

A guest chooses its file names and what its programs print. Shown raw on the user's terminal, an escape
sequence in them can clear the screen, rewrite earlier lines or set the window title, and a bidi override can
make a name read as another. `shown()` writes those characters as visible escapes and leaves everything else
as it is. Stdlib only: the mux and the worker both use it.
"""

from __future__ import annotations

import functools
import re

# C0 controls, DEL, C1 controls, bidi marks, embeddings, overrides and isolates, and undecodable bytes (as
# surrogateescape keeps them: U+DC80-U+DCFF)
_UNSAFE = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\udc80-\udcff"


@functools.lru_cache(maxsize=2)
def _unsafe(text: bool) -> re.Pattern[str]:
    """The characters shown() escapes; with `text`, tabs and line breaks are kept. Compiled on first use, not at
    import: every task's worker imports this module and most tasks never show a guest's text (0.4 ms; issue 45)."""
    return re.compile("[%s]" % (_UNSAFE.replace("\x00-\x1f", "\x00-\x08\x0b-\x1f") if text else _UNSAFE))


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:
        return "\\x%02x" % (code - 0xDC00)  # the byte that did not decode
    return "\\x%02x" % code if code < 0x100 else "\\u%04x" % code


def shown(value: str | bytes | bytearray, text: bool = False) -> str:
    """`value` (a name, or with `text` multi-line text such as a guest's stderr, keeping its tabs and line breaks)
    with control characters (ESC, C1, DEL...), bidi controls and undecodable bytes written as visible escapes
    such as \\x1b and \\u202e; everything else unchanged."""
    if not isinstance(value, str):
        value = bytes(value).decode("utf-8", "surrogateescape")
    return _unsafe(bool(text)).sub(_escape, value)
