# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin of microvm.sandbox.template: runs the module, and shows a long wait (a build) as it happens.

See plugin_utils/_worker/progress_action.py.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

from typing import Any

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.progress_action import ProgressAction, template_lookup


class ActionModule(ProgressAction):
    MODULE = "microvm.sandbox.template"

    def lookup(self, client: ApiClient, name: str) -> tuple[str, list[Any]]:
        return template_lookup(client, name)
