# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Progress of the long first steps (issue 42): a module's per-stage timeline, and the lines shown while it waits.

A module cannot print while it runs, so it returns its `stages` (what it waited on, and for how long); the action
plugins of `session` and `template` (plugin_utils/_worker/progress_action.py) show the wait as it happens. Both format here,
so the lines read the same. Nothing here ever sees a token, env or secret: only names, statuses and seconds.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import time
from typing import Any, Callable


class Timeline(object):
    """Stages in the order they began: mark(name) starts one (a repeat of the current one is no new stage)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self._stages: list[list[Any]] = []   # [name, started at (s since start), ended at or None]

    def mark(self, stage: str) -> None:
        now = self._clock() - self.started
        if self._stages and self._stages[-1][0] == stage and self._stages[-1][2] is None:
            return
        self.end(now)
        self._stages.append([stage, now, None])

    def end(self, at: float | None = None) -> None:
        """Close the current stage (now, or at `at` seconds since the start)."""
        if self._stages and self._stages[-1][2] is None:
            self._stages[-1][2] = self._clock() - self.started if at is None else at

    def as_list(self) -> list[dict[str, Any]]:
        """[{stage, seconds}]: what the module returns as `stages` (seconds to a tenth)."""
        self.end()
        return [{"stage": name, "seconds": round(max(0.0, end - begin), 1)} for name, begin, end in self._stages]


def wait_line(host: str, module: str, target: str, state: str, elapsed: float, note: str | None = None) -> str:
    """One line shown while a task waits: `localhost: microvm.sandbox.session ci-1: PROVISIONING, 12 s so far`."""
    line = "%s: %s %s: %s, %d s so far" % (host, module, target, state, int(elapsed))
    if note:
        line += " (%s)" % note
    return line


def summary_line(host: str, module: str, target: str, elapsed: float, stages: list[dict[str, Any]] | None) -> str:
    """The line shown after a wait that was reported: how long, and each stage's share."""
    parts = ", ".join("%s %.1f s" % (s.get("stage"), float(s.get("seconds") or 0)) for s in stages or []
                      if isinstance(s, dict))
    return "%s: %s %s: done in %d s%s" % (host, module, target, int(elapsed), " (%s)" % parts if parts else "")
