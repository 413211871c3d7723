# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Load the agent connection in ansible-playbook's own process, before it forks the task workers.

Core forks a worker per task, and each worker loads the task's connection plugin afresh: importing it and
its modules costs about 7 ms of a task's CPU (docs/connection.md). Loaded once in the parent, every worker
forked after inherits it. The parent runs this collection's code in two places: the sessions inventory,
and the action plugin classes the strategy loads for each task before it forks the worker (session, sync,
workspace_archive), so a play that starts a session and then works in it gets it too. The same goes for what
ansible-core itself works out once per process in each worker (core_compat A12: 3 ms a task on 2.21).
"""

from __future__ import annotations

PLUGIN = "microvm.sandbox.agent"


def load_connection(name: str = PLUGIN) -> bool:
    """Load connection plugin `name` in this process; True when it is loaded (a failure is the workers' to report)."""
    try:
        from ansible.plugins.loader import connection_loader

        from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat

        core_compat.warm_worker_caches()  # core's own per-process work, done once here too (core_compat A12)
        return connection_loader.get(name, class_only=True) is not None
    except Exception:  # pylint: disable=broad-exception-caught  # an optimisation only: each worker loads it again
        return False
