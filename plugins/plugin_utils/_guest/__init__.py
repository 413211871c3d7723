# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Programs sent into the guest as one `python3 -c` argv string (each under the kernel's 128 KiB MAX_ARG_STRLEN).

Standard library only and self-contained.
"""

from __future__ import annotations

import os
from types import ModuleType

# Linux refuses any single argv string longer than MAX_ARG_STRLEN (32 pages of 4 KiB), whatever ARG_MAX says.
MAX_ARG_STRLEN = 128 * 1024


def source_of(program: ModuleType) -> str:
    """A guest program's own source, sent as the one `python3 -c` argument that runs it in the guest."""
    path = program.__file__ or ""
    if path.endswith(".pyc"):
        path = path[:-1]
    with open(path, "r", encoding="utf-8") as f:
        return f.read()


def script_of(name: str, values: dict[str, object]) -> str:
    """A guest shell script of this package (sent as the one `sh -c` argument that runs it), its whole-line
    comments dropped (they would travel with every exec) and each @NAME@ replaced by values[NAME]."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with open(path, "r", encoding="utf-8") as f:
        text = "".join(line for line in f if not line.startswith("#"))
    for key, value in values.items():
        text = text.replace("@%s@" % key, str(value))
    return text
