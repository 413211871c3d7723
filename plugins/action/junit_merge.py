# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin of microvm.sandbox.junit_merge: the merge runs in the controller's own process.

The files are on the controller (pulled from the sandboxes), so there is nothing to ship anywhere: running in
process saves the module's start (a second of a CI job's critical path on a loaded machine).
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

from typing import Any

from ansible.plugins.action import ActionBase

from ansible_collections.microvm.sandbox.plugins.module_utils.junit_xml import ARGUMENT_SPEC, run


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        _validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        warnings: list[str] = []
        result.update(run(args, bool(self._task.check_mode), warnings.append))
        if warnings:
            result["warnings"] = warnings
        result.setdefault("changed", False)
        return result
