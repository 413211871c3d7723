# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The environment spec as YAML text, the form the platform's session create takes.

The create call selects its form by Content-Type: YAML (application/yaml and
friends) is the environment spec, JSON is only {name, config_id}
(https://docs.digitalocean.com/reference/dots/reference/harness-runtime/harness-create-session/).
So the spec goes out as real YAML, block style, every string double-quoted with
anything unprintable escaped, so no value can turn into another type ("yes",
"null", "010") or another structure ("a: b", a newline). Module code may not
rely on PyYAML being installed where modules run, hence this small emitter.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import math

from typing import Any, List

_SHORT_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t", "\x00": "\\0"}


def _printable(ch: str) -> bool:
    """Characters YAML 1.1 and 1.2 both take literally inside a double-quoted scalar.

    Line and paragraph separators and the byte order mark are escaped too: YAML 1.1 reads the first two as
    line breaks, and a BOM may be dropped.
    """
    code = ord(ch)
    if 0x20 <= code <= 0x7E:
        return True
    if code in (0x2028, 0x2029, 0xFEFF):
        return False
    return 0xA0 <= code <= 0xD7FF or 0xE000 <= code <= 0xFFFD or 0x10000 <= code <= 0x10FFFF


def quote(text: str) -> str:
    out = []
    for ch in text:
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif _printable(ch):
            out.append(ch)
        elif ord(ch) <= 0xFF:
            out.append("\\x%02x" % ord(ch))
        elif ord(ch) <= 0xFFFF:
            out.append("\\u%04x" % ord(ch))
        else:
            out.append("\\U%08x" % ord(ch))
    return '"%s"' % "".join(out)


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the spec cannot carry %r" % (value,))
        return repr(value)
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, dict) and not value:
        return "{}"
    if isinstance(value, (list, tuple)) and not value:
        return "[]"
    raise TypeError("the spec cannot carry a %s" % type(value).__name__)


def _nested(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple)) and len(value) > 0


def _block(value: Any, indent: int) -> List[str]:
    pad = " " * indent
    lines: List[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError("spec keys are strings, got %r" % (key,))
            if _nested(item):
                lines.append("%s%s:" % (pad, quote(key)))
                lines.extend(_block(item, indent + 2))
            else:
                lines.append("%s%s: %s" % (pad, quote(key), _scalar(item)))
        return lines
    for item in value:
        if _nested(item):
            inner = _block(item, indent + 2)
            lines.append("%s- %s" % (pad, inner[0].lstrip()))
            lines.extend(inner[1:])
        else:
            lines.append("%s- %s" % (pad, _scalar(item)))
    return lines


def dump(doc: dict) -> str:
    """A mapping as a YAML document (block style; strings, numbers, booleans, null, lists and mappings)."""
    if not isinstance(doc, dict):
        raise TypeError("the spec is a mapping, got %s" % type(doc).__name__)
    if not doc:
        return "{}\n"
    return "\n".join(_block(doc, 0)) + "\n"
