#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: persistent_workspace
short_description: Create and delete persistent workspaces of microVM sandboxes
version_added: 0.1.0
description:
  - A persistent workspace is a saved set of files with its own id; inside a session it is the C(/workspace) folder.
    Removing the session saves the files, and a new session that uses the same workspace starts with them
    (U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/how-to/use-persistent-workspaces/)).
  - A workspace is attached when a session is created from a saved config with its id, never afterwards, to one
    session at a time (O(microvm.sandbox.session#module:workspace_id)).
  - Persistent workspaces are in public preview and enabled per team; when they are not enabled, every workspace
    call answers 403.
  - B(Identity.) The platform's names are labels, not unique. Without O(workspace_id), this module takes
    O(name) as the workspace's identity. It finds the one workspace with that name, creates it when there is none,
    and fails naming the ids when several share the name.
  - The size limit is fixed when the workspace is created; a different O(size_limit_gib) for an existing workspace
    fails the task rather than replace a workspace and its files.
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api
  - microvm.sandbox.api.attributes
attributes:
  check_mode:
    support: full
  diff_mode:
    support: full
    details:
      - The diff shows the workspace's name, state and size limit before and after.
options:
  name:
    description:
      - Label of the workspace, and its identity for this module when O(workspace_id) is not given.
      - One of O(name) and O(workspace_id) is required.
    type: str
  workspace_id:
    description:
      - Id of an existing workspace to manage (workspace names are not accepted where the API takes an id).
    type: str
  size_limit_gib:
    description:
      - Size limit in GiB, a whole number from 1 to 100 (your team's limit may be lower). Required to create a
        workspace; compared with an existing one (it cannot change).
    type: int
  idempotency_key:
    description:
      - Sent with the create, so a repeated request cannot create a second workspace. Within 24 hours the same
        key with the same size and name returns the first workspace, and the same key with other values is refused.
      - Without it the module makes one up for the call, which makes its own retries safe; pass your own to make
        a whole re-run within 24 hours safe even before the workspace is listed.
    type: str
  state:
    description:
      - V(present) creates the workspace when it does not exist.
      - V(absent) deletes it and everything saved in it. Only an C(AVAILABLE) or C(FAILED) workspace can be deleted;
        remove the session that holds it first (the task fails naming it).
    type: str
    choices: [present, absent]
    default: present
  wait:
    description:
      - With O(state=absent), wait up to O(wait_timeout) seconds until the workspace no longer exists (it shows
        C(DELETING) while its delete runs).
    type: bool
    default: true
seealso:
  - module: microvm.sandbox.persistent_workspace_info
  - module: microvm.sandbox.session
"""

EXAMPLES = r"""
- name: A workspace for the notes agent (created once, found by name afterwards)
  microvm.sandbox.persistent_workspace:
    name: notes
    size_limit_gib: 10
  register: notes

- name: Start a session from a saved config with that workspace as its /workspace
  microvm.sandbox.session:
    name: notes-run-7
    config_id: "{{ notes_config_id }}"  # the id of a saved config (microvm.sandbox.environment_config)
    workspace_id: "{{ notes.workspace.workspace_id }}"

- name: Delete the session; its files are saved to the workspace
  microvm.sandbox.session:
    name: notes-run-7
    state: absent

- name: Delete the workspace once no session holds it
  microvm.sandbox.persistent_workspace:
    workspace_id: "{{ notes.workspace.workspace_id }}"
    state: absent
"""

RETURN = r"""
workspace:
  description:
    - The workspace after the task (in check mode, the expected result); for O(state=absent), as last seen, or
      empty when there was none.
  returned: always
  type: dict
  contains:
    workspace_id:
      description: Id of the workspace.
      type: str
    name:
      description: Its label (not unique).
      type: str
    state:
      description: C(AVAILABLE), C(ATTACHING), C(ATTACHED), C(RELEASING), C(FAILED) or C(DELETING).
      type: str
    size_limit_gib:
      description: Size limit in GiB.
      type: int
    bytes_used:
      description: Bytes of the saved files.
      type: int
    attached_session_id:
      description: The session that holds it, empty when none.
      type: str
    last_saved_at:
      description: When its files were last saved, empty before the first save.
      type: str
    created_at:
      description: Creation time.
      type: str
  sample:
    workspace_id: 018f6f2a-3c1e-7b6a-9d4e-5a7b8c9d0e1f
    name: notes
    state: AVAILABLE
    size_limit_gib: 10
    bytes_used: 0
    attached_session_id: ""
    last_saved_at: ""
    created_at: "2026-11-17T10:00:00Z"
"""

import uuid  # noqa: E402
from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.views import object_view  # noqa: E402

MIN_SIZE_GIB = 1
MAX_SIZE_GIB = 100


def find_workspace(module: AnsibleModule, client: ApiClient) -> dict[str, Any] | None:
    """The managed workspace: by id, else the one with that name (names are labels; several is an error)."""
    p = module.params
    if p["workspace_id"]:
        try:
            return client.get_workspace(p["workspace_id"])
        except ApiError as e:
            if e.gone:
                return None
            raise
    same = [w for w in client.list_workspaces() if w.get("name") == p["name"] and w.get("state") != "DELETING"]
    if len(same) > 1:
        module.fail_json(msg="%d workspaces are named %r (names are labels, not unique): give workspace_id, one of %s"
                         % (len(same), p["name"], ", ".join(sorted(w["workspace_id"] for w in same))))
    return same[0] if same else None


def present(module: AnsibleModule, client: ApiClient, existing: dict[str, Any] | None) -> tuple[bool, dict[str, Any]]:
    p = module.params
    size = p["size_limit_gib"]
    if size is not None and not MIN_SIZE_GIB <= size <= MAX_SIZE_GIB:
        module.fail_json(msg="size_limit_gib must be a whole number from %d to %d, got %d"
                         % (MIN_SIZE_GIB, MAX_SIZE_GIB, size))
    if existing is not None:
        if size is not None and existing.get("size_limit_gib") != size:
            module.fail_json(msg="workspace %s has a size limit of %s GiB, not %d: the size limit is fixed when a "
                                 "workspace is created; create another workspace (and move the files) instead"
                             % (existing["workspace_id"], existing.get("size_limit_gib"), size), workspace=existing)
        return False, existing
    if p["workspace_id"]:
        module.fail_json(msg="workspace %s does not exist: give name and size_limit_gib (without workspace_id) to "
                             "create one" % p["workspace_id"])
    if size is None:
        module.fail_json(msg="workspace %r does not exist; size_limit_gib (1-100) is required to create it"
                         % p["name"])
    if module.check_mode:
        return True, dict(workspace_id="", name=p["name"], state="AVAILABLE", size_limit_gib=size, bytes_used=0,
                          attached_session_id="", last_saved_at="", created_at="")
    key = p["idempotency_key"] or str(uuid.uuid4())
    return True, client.create_workspace(size, name=p["name"], idempotency_key=key)


def absent(module: AnsibleModule, client: ApiClient, existing: dict[str, Any] | None) -> tuple[bool, dict[str, Any]]:
    if existing is None:
        return False, {}
    if existing.get("state") == "DELETING":
        changed = False
    else:
        changed = True
        if module.check_mode:
            return True, {}
        try:
            client.delete_workspace(existing["workspace_id"])
        except ApiError as e:
            if not e.gone:
                raise
    if module.params["wait"] and not module.check_mode:
        client.wait_workspace(existing["workspace_id"], (), timeout=module.params["wait_timeout"], gone_ok=True)
    return changed, {}


def run(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    existing = find_workspace(module, client)
    if module.params["state"] == "absent":
        changed, after = absent(module, client, existing)
        shown = existing if changed else {}
    else:
        changed, after = present(module, client, existing)
        shown = after
    result: dict[str, Any] = dict(changed=changed, workspace=shown or {})
    if module._diff:
        result["diff"] = dict(before=object_view(existing), after=object_view(after))
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            name=dict(type="str"),
            workspace_id=dict(type="str"),
            size_limit_gib=dict(type="int"),
            idempotency_key=dict(type="str", no_log=False),
            state=dict(type="str", default="present", choices=["present", "absent"]),
            wait=dict(type="bool", default=True),
        ),
        required_one_of=[("name", "workspace_id")],
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: run(module, client))


if __name__ == "__main__":
    main()
