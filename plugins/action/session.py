# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin of microvm.sandbox.session: runs the module, and shows a long wait (a first create) as it happens.

See plugin_utils/_worker/progress_action.py.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

from typing import Any

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.progress_action import ProgressAction, session_lookup
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import preload

# the strategy loads this class in ansible-playbook itself before it forks the worker: the agent connection too,
# so every worker forked after (the tasks in the session) inherits it loaded (_worker/preload.py)
preload.load_connection()


class ActionModule(ProgressAction):
    MODULE = "microvm.sandbox.session"

    def lookup(self, client: ApiClient, name: str) -> tuple[str, list[Any]]:
        return session_lookup(client, name)
