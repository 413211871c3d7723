# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""bench/ci_job_bench.py's timer: one JSON line per task and host into $MICROVM_CI_TIMING, with when the task started and
ended on that host (wall clock, seconds), so the bench can say where the time of the CI playbook goes."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "microvm_ci_timing"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._starts: dict[tuple[str, str], float] = {}

    def v2_runner_on_start(self, host: Any, task: Any) -> None:
        # per host and task: the free strategy starts a task on each host at its own time
        self._starts[(host.get_name(), task._uuid)] = time.time()

    def _record(self, result: Any, status: str) -> None:
        path = os.environ.get("MICROVM_CI_TIMING")
        if not path:
            return
        now = time.time()
        host = result._host.get_name()
        start = self._starts.pop((host, result._task._uuid), now)
        line = {"task": result._task.get_name(), "host": host, "status": status, "start": start, "end": now}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def v2_runner_on_ok(self, result: Any) -> None:
        self._record(result, "ok")

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        self._record(result, "failed")

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self._record(result, "unreachable")
