#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: persistent_workspace_info
short_description: List persistent workspaces of microVM sandboxes, or look one up
version_added: 0.1.0
description:
  - Returns one persistent workspace by id, the workspaces with a name (names are labels, not unique), or every
    workspace, newest first, following the API's pagination; optionally only those in one state
    (U(https://docs.digitalocean.com/reference/doctl/reference/harness-runtime/workspace/list/)).
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api
  - microvm.sandbox.api.attributes
  - microvm.sandbox.api.info_module
options:
  workspace_id:
    description:
      - Id of one workspace. When it does not exist, RV(workspaces) is empty; the module does not fail.
    type: str
  name:
    description:
      - Only the workspaces with this label.
    type: str
  state:
    description:
      - Only the workspaces in this state. V(AVAILABLE) lists those a new session can use.
    type: str
    choices: [AVAILABLE, ATTACHING, ATTACHED, RELEASING, FAILED, DELETING]
seealso:
  - module: microvm.sandbox.persistent_workspace
"""

EXAMPLES = r"""
- name: Workspaces a new session can use
  microvm.sandbox.persistent_workspace_info:
    state: AVAILABLE
  register: free

- name: Which session holds the notes workspace, and when was it last saved?
  microvm.sandbox.persistent_workspace_info:
    name: notes
  register: notes

- name: Show it
  ansible.builtin.debug:
    msg: "{{ notes.workspaces | map(attribute='attached_session_id') | list }}"
"""

RETURN = r"""
workspaces:
  description:
    - The matching workspaces as the platform reports them, newest first (see
      RV(microvm.sandbox.persistent_workspace#module:workspace) for the fields).
  returned: always
  type: list
  elements: dict
  sample:
    - workspace_id: 018f6f2a-3c1e-7b6a-9d4e-5a7b8c9d0e1f
      name: notes
      state: ATTACHED
      size_limit_gib: 10
      bytes_used: 52428
      attached_session_id: 3f7c2a7e-6b0d-4a55-9f0e-2b8f6d1c4e90
      last_saved_at: "2026-11-17T10:20:00Z"
      created_at: "2026-11-17T10:00:00Z"
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError  # noqa: E402


def list_workspaces(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    p = module.params
    if p["workspace_id"]:
        try:
            found = [client.get_workspace(p["workspace_id"])]
        except ApiError as e:
            if not e.gone:
                raise
            found = []
        found = [w for w in found if not p["state"] or w.get("state") == p["state"]]
    else:
        found = client.list_workspaces(state=p["state"])
    if p["name"] is not None:
        found = [w for w in found if w.get("name") == p["name"]]
    return dict(changed=False, workspaces=found)


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            workspace_id=dict(type="str"),
            name=dict(type="str"),
            state=dict(type="str", choices=["AVAILABLE", "ATTACHING", "ATTACHED", "RELEASING", "FAILED", "DELETING"]),
        ),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: list_workspaces(module, client))


if __name__ == "__main__":
    main()
