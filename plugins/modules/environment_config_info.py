#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: environment_config_info
short_description: List the Environment Configs microVM sandbox sessions start from, or look one up
version_added: 0.1.0
description:
  - Returns one Environment Config by name or id, the configs whose name contains a text (the list's C(search),
    case-insensitive), or every config, following the API's pagination. Manifests are not returned, and secret
    values never are.
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api
  - microvm.sandbox.api.attributes
  - microvm.sandbox.api.info_module
options:
  name:
    description:
      - Name or id of one config. When nothing matches, RV(configs) is empty; the module does not fail.
    type: str
  search:
    description:
      - Only the configs whose name contains this text, case-insensitively (at most 64 characters).
    type: str
seealso:
  - module: microvm.sandbox.environment_config
"""

EXAMPLES = r"""
- name: Every config whose name mentions review
  microvm.sandbox.environment_config_info:
    search: review
  register: review_configs

- name: One config
  microvm.sandbox.environment_config_info:
    name: reviewer
  register: reviewer
"""

RETURN = r"""
configs:
  description:
    - The matching configs as the platform lists them (see
      RV(microvm.sandbox.environment_config#module:config) for the fields); list items carry C(region)
      instead of C(credentials), and one looked up by O(name) is the full object.
  returned: always
  type: list
  elements: dict
  sample:
    - id: 019fb39c-14d9-7080-933e-b9b90e25acda
      name: reviewer
      agentspec_schema_version: flat
      content_hash: 75803fef24dc731824ecd4a1853c76153c7d8503534092b94da3ca3f31a882f4
      created_by: local
      created_at: "2026-11-17T10:00:00Z"
      updated_at: "2026-11-17T10:00:00Z"
      region: local
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient  # noqa: E402


def list_configs(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    p = module.params
    if p["name"]:
        found = client.find_config(p["name"])
        configs = [found] if found else []
        if p["search"]:
            configs = [c for c in configs if p["search"].lower() in str(c.get("name") or "").lower()]
    else:
        configs = client.list_configs(search=p["search"])
    return dict(changed=False, configs=configs)


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            name=dict(type="str"),
            search=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: list_configs(module, client))


if __name__ == "__main__":
    main()
