# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The mux's GIL switch interval: short only while requests compete for the process (issue 45).

One mux process carries every session. A thread waiting for the GIL behind one streaming at full speed waits up
to the switch interval at each hand-over (Python's default 5 ms), and a small command needs several: next to a
flood it ran 2-3x slower, hence a 0.5 ms interval since the shared-fate work. But with one request at a time (a
playbook's tasks, one host) nothing competes, and the short interval only makes the running thread drop and
retake the GIL ten times as often. So the rule: SHORT while two or more requests are in flight, and for HOLD
seconds after (a neighbour's next small command comes within milliseconds: it must not pay one long hand-over
at its start each time); LONG otherwise.

MICROVM_MUX_SWITCH_INTERVAL (for benches and diagnosis) fixes the interval instead: a number of seconds
(0.0005 was the rule before, 0.005 is Python's default); unset, empty or "adaptive": the rule above.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("microvm.mux")

SWITCH = "MICROVM_MUX_SWITCH_INTERVAL"
SHORT = 0.0005   # seconds, while requests compete
LONG = 0.005     # Python's default: one request alone
HOLD = 2.0       # seconds the short interval outlives the last competition


def fixed_interval(value: str | None) -> float | None:
    """The fixed interval SWITCH asks for, or None (the adaptive rule); a bad value is logged and ignored."""
    text = (value or "").strip().lower()
    if text in ("", "adaptive"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0.00001 <= seconds <= 1.0:
        log.warning("%s=%r is neither `adaptive` nor a number of seconds between 0.00001 and 1: "
                    "the adaptive rule applies", SWITCH, value)
        return None
    return seconds


class SwitchInterval:
    """Counts the requests in flight (enter/leave, from any thread) and sets the process's switch interval."""

    def __init__(self, fixed: float | None = None, setter: Callable[[float], None] = sys.setswitchinterval,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fixed = fixed
        self.setter = setter
        self.clock = clock
        self.lock = threading.Lock()
        self.in_flight = 0
        self.short_until = 0.0  # while short: when it may go back to LONG (inf while requests compete)
        self.current = fixed if fixed is not None else LONG
        self.setter(self.current)

    @classmethod
    def from_environment(cls) -> SwitchInterval:
        return cls(fixed_interval(os.environ.get(SWITCH)))

    def _set(self, interval: float) -> None:
        if interval != self.current:
            self.current = interval
            self.setter(interval)

    def enter(self) -> None:
        """A request starts."""
        if self.fixed is not None:
            return
        with self.lock:
            self.in_flight += 1
            if self.in_flight >= 2:
                self.short_until = float("inf")
                self._set(SHORT)
            elif self.current != LONG and self.clock() >= self.short_until:
                self._set(LONG)

    def leave(self) -> None:
        """A request ended (answered, failed or its worker gone)."""
        if self.fixed is not None:
            return
        with self.lock:
            self.in_flight -= 1
            if self.in_flight < 2 and self.short_until == float("inf"):
                self.short_until = self.clock() + HOLD
