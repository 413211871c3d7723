# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Per-hop timestamps of a task, for bench/hops_bench.py (issue 45): off unless MICROVM_HOPS names a file.

Each process of ours that a task crosses appends one JSON line per event to that file: the worker (the
connection plugin's import, each request it sends and the answer's end), the mux (each request: when it came,
when its payload was in, when it went to the runner, when the runner's answer came, when the answer went out), and
the guest's warm runner, whose stamps ride in its EXIT frame when the mux asks for them in the request. A request
carries the worker's id for it ("hop"), so the bench joins the lines. Stamps are time.time_ns(): one clock for
every process of the machine (the local plane's guests share the host's). Names and numbers only: no payload,
argument, environment or output is ever written.

Off (the default): one environment lookup per request in the worker, one attribute test in the mux.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

SWITCH = "MICROVM_HOPS"
STAMPS_MAX = 8          # the runner's stamps the mux keeps (they come from the guest: a budget, ints only)
_ids = itertools.count(1)


def target() -> str | None:
    """The file the stamps go to, or None (off)."""
    return os.environ.get(SWITCH) or None


def now() -> int:
    return time.time_ns()


def new_id() -> str:
    """An id for one request, unique on the machine for the bench's run: the worker's pid and a count."""
    return "%d-%d" % (os.getpid(), next(_ids))


def record(path: str | None, side: str, **fields: Any) -> None:
    """Append one line {side, pid, fields} to `path` (nothing when None); a failure to write is ignored."""
    if not path:
        return
    line = json.dumps(dict(fields, side=side, pid=os.getpid()), sort_keys=True) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        os.write(fd, line.encode("utf-8"))  # one write of one short line: O_APPEND keeps the processes' lines whole
    except OSError:
        pass
    finally:
        os.close(fd)


def runner_stamps(raw: Any) -> dict[str, int]:
    """The runner's stamps from its EXIT frame, kept only as at most STAMPS_MAX short names with integer values."""
    if not isinstance(raw, dict):
        return {}
    kept: dict[str, int] = {}
    for name, value in raw.items():
        if len(kept) >= STAMPS_MAX:
            break
        if isinstance(name, str) and len(name) <= 16 and isinstance(value, int) and not isinstance(value, bool):
            kept[name] = value
    return kept
