#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: session_info
short_description: List microVM sandbox sessions, or look one up by id or name
version_added: 0.1.0
description:
  - Returns one session by id or name, or every session that matches the filters, following the API's pagination.
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api
  - microvm.sandbox.api.attributes
  - microvm.sandbox.api.info_module
options:
  name:
    description:
      - Id or name of one session, as O(microvm.sandbox.session#module:name) takes it. Names are matched
        (case-insensitively) among live sessions only.
      - When nothing matches, RV(sessions) is empty; the module does not fail.
    type: str
    aliases: [session]
  name_prefix:
    description:
      - Only sessions whose name starts with this prefix (case-sensitive).
    type: str
  statuses:
    description:
      - Only sessions in one of these statuses, given as short names (V(READY)) or in full (V(SESSION_STATUS_READY)),
        in any case.
      - V(usable) stands for V(READY) and V(DETACHED); V(gone) for V(DESTROYING), V(DESTROYED) and V(FAILED).
      - When not set, the platform's default listing, which is every session but the V(DESTROYED) and V(FAILED)
        ones (U(https://docs.digitalocean.com/reference/pydo/reference/harness/list_sessions/)). Name those statuses
        (or V(gone)) to see them.
    type: list
    elements: str
  search:
    description:
      - The platform's own search filter of the session list (its C(search) parameter), applied before the other
        filters. Ignored with O(name).
    type: str
seealso:
  - module: microvm.sandbox.session
  - plugin: microvm.sandbox.sessions
    plugin_type: inventory
"""

EXAMPLES = r"""
- name: One session by name
  microvm.sandbox.session_info:
    name: ci-job-42
  register: found

- name: Fail when it is missing
  ansible.builtin.assert:
    that: found.sessions | length == 1

- name: Every usable or paused CI session
  microvm.sandbox.session_info:
    name_prefix: ci-
    statuses: [usable, PAUSED]
  register: ci

- name: Their ids
  ansible.builtin.debug:
    msg: "{{ ci.sessions | map(attribute='session_id') | list }}"
"""

RETURN = r"""
sessions:
  description:
    - The matching sessions, as the platform reports them (see RV(microvm.sandbox.session#module:session) for the fields).
  returned: always
  type: list
  elements: dict
  sample:
    - session_id: 2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1
      name: ci-job-42
      status: SESSION_STATUS_READY
      agent_kind: AGENT_KIND_CUSTOM
      idle_timeout_seconds: 900
      parent_session_id: ""
      workspace_id: ""
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import profile  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.views import expand_statuses, select_sessions  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient  # noqa: E402


def list_sessions(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    p = module.params
    try:
        statuses = expand_statuses(p["statuses"])
    except ValueError as e:
        module.fail_json(msg="statuses: %s" % e)
    # The API filters on one status at most, and hides DESTROYED and FAILED unless asked: ask for what the
    # statuses need (every session when none are given), and filter the rest here.
    status = profile.list_status_filter(statuses)
    if p["name"]:
        sessions = client.sessions_named(p["name"], status=status)
        if not sessions:
            found = client.session_by_id(p["name"])
            sessions = [found] if found else []
    else:
        sessions = client.list_sessions(status=status, search=p["search"])
    return dict(changed=False, sessions=select_sessions(sessions, statuses=statuses, name_prefix=p["name_prefix"]))


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            name=dict(type="str", aliases=["session"]),
            name_prefix=dict(type="str"),
            statuses=dict(type="list", elements="str"),
            search=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: list_sessions(module, client))


if __name__ == "__main__":
    main()
