# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How the modules show platform objects in diffs."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

from ansible_collections.microvm.sandbox.plugins.module_utils import profile

# Fields that change without any change to the object, or only appear on create:
# left out of diffs so that --diff shows what the task did.
_VOLATILE = frozenset(["last_event_at", "warnings", "updated_at"])


def status_of(session):
    return profile.short_status((session or {}).get("status"))


def object_view(obj):
    """The object as a diff side: {} for none, volatile fields dropped."""
    if not obj:
        return {}
    return dict((k, v) for k, v in obj.items() if k not in _VOLATILE)


session_view = object_view
