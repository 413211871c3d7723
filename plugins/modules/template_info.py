#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: template_info
short_description: List microVM sandbox templates, or look one up by id or name
version_added: 0.1.0
description:
  - Returns one template by id or name, or every template, following the API's pagination; optionally with builds.
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api
  - microvm.sandbox.api.attributes
  - microvm.sandbox.api.info_module
options:
  name:
    description:
      - Id or name of one template. When nothing matches, RV(templates) is empty; the module does not fail.
    type: str
  include_builds:
    description:
      - Add each template's builds (C(build_id), C(status), C(error)) under the key C(builds).
    type: bool
    default: false
seealso:
  - module: microvm.sandbox.template
"""

EXAMPLES = r"""
- name: Every template
  microvm.sandbox.template_info:
  register: all_templates

- name: One template with its builds
  microvm.sandbox.template_info:
    name: agent-python
    include_builds: true
  register: tpl

- name: Why did its last build fail?
  ansible.builtin.debug:
    msg: "{{ tpl.templates[0].builds | map(attribute='error') | select | list }}"
  when: tpl.templates | length > 0
"""

RETURN = r"""
templates:
  description:
    - The matching templates as the platform reports them (see RV(microvm.sandbox.template#module:template)
      for the fields), with C(builds) when O(include_builds=true).
  returned: always
  type: list
  elements: dict
  sample:
    - template_id: 5a3e0c56-9a62-4f4e-8d6d-3f0b5d8f3c11
      name: agent-python
      status: TEMPLATE_STATUS_READY
      spec:
        base_template: sandbox
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient  # noqa: E402


def list_templates(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    p = module.params
    if p["name"]:
        found = client.find_template(p["name"])
        templates = [found] if found else []
    else:
        # List items carry no spec (pydo list_templates): each template's own GET does.
        templates = [t for t in (client.template_or_none(item["template_id"]) for item in client.list_templates()) if t]
    if p["include_builds"]:
        templates = [dict(t, builds=client.list_builds(t["template_id"])) for t in templates]
    return dict(changed=False, templates=templates)


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            name=dict(type="str"),
            include_builds=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: list_templates(module, client))


if __name__ == "__main__":
    main()
