#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: checkpoint_info
short_description: List the checkpoints of a microVM sandbox session
version_added: 0.1.0
description:
  - Returns the checkpoints of one session, newest first, following the API's pagination.
  - Fails when the session does not exist; returns an empty list when no checkpoint matches.
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api
  - microvm.sandbox.api.attributes
  - microvm.sandbox.api.info_module
options:
  session:
    description:
      - Id or name of the session. Names are matched among live sessions only.
    type: str
    required: true
  checkpoint_id:
    description:
      - Only the checkpoint with this id.
    type: str
  label:
    description:
      - Only the checkpoints with this label.
    type: str
seealso:
  - module: microvm.sandbox.checkpoint
"""

EXAMPLES = r"""
- name: All checkpoints of a session
  microvm.sandbox.checkpoint_info:
    session: ci-job-42
  register: cps

- name: The newest one labelled deps-installed
  microvm.sandbox.checkpoint_info:
    session: ci-job-42
    label: deps-installed
  register: deps
"""

RETURN = r"""
checkpoints:
  description:
    - The matching checkpoints, newest first, as the platform reports them
      (see RV(microvm.sandbox.checkpoint#module:checkpoint) for the fields).
  returned: always
  type: list
  elements: dict
  sample:
    - checkpoint_id: cp_9f2c1a4b
      session_id: 2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1
      status: READY
      kind: explicit
      label: deps-installed
      event_id: 01JABCDEFGHJKLMNPQRSTVWXYZ
      size_bytes: 73400320
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient  # noqa: E402


def list_checkpoints(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    p = module.params
    sid = client.require_session(p["session"])["session_id"]
    if p["checkpoint_id"]:
        found = client.find_checkpoint(sid, checkpoint_id=p["checkpoint_id"])
        checkpoints = [found] if found else []
    else:
        checkpoints = client.list_checkpoints(sid)
    if p["label"] is not None:
        checkpoints = [cp for cp in checkpoints if cp.get("label") == p["label"]]
    return dict(changed=False, checkpoints=checkpoints)


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            session=dict(type="str", required=True),
            checkpoint_id=dict(type="str"),
            label=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: list_checkpoints(module, client))


if __name__ == "__main__":
    main()
