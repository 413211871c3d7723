#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: size_info
short_description: List the sandbox sizes a microVM sandbox session can have
version_added: 0.1.0
description:
  - Returns the platform's size catalog (C(GET /sessions/sandbox/sizes) under O(route_prefix), by default
    C(GET /v2/harness-runtime/sessions/sandbox/sizes)), smallest first. Every slug it lists is accepted as
    O(microvm.sandbox.session#module:size)
    (U(https://docs.digitalocean.com/reference/pydo/reference/harness/list_session_sandbox_sizes/)).
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api
  - microvm.sandbox.api.attributes
  - microvm.sandbox.api.info_module
options:
  slug:
    description:
      - Only the size with this slug; fails when the catalog has no such size.
    type: str
seealso:
  - module: microvm.sandbox.session
"""

EXAMPLES = r"""
- name: The sizes on offer
  microvm.sandbox.size_info:
  register: catalog

- name: A session of the smallest size
  microvm.sandbox.session:
    name: small-box
    size: "{{ catalog.sizes[0].slug }}"
    permissions:
      default: allow

- name: Delete it when done
  microvm.sandbox.session:
    name: small-box
    state: absent
"""

RETURN = r"""
sizes:
  description: The sizes, smallest first, as the platform reports them.
  returned: always
  type: list
  elements: dict
  contains:
    slug:
      description: The slug to pass as the session's size.
      type: str
    vcpus:
      description: Virtual CPUs.
      type: int
    memory_mb:
      description: Memory in MiB.
      type: int
    price_per_hour_usd:
      description: Price per hour in US dollars.
      type: float
    price_per_month_usd:
      description: Price per month in US dollars.
      type: float
  sample:
    - slug: mars-2vcpu-4gb
      vcpus: 2
      memory_mb: 4096
slugs:
  description: The slugs of RV(sizes), in the same order.
  returned: always
  type: list
  elements: str
  sample: [mars-2vcpu-4gb]
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient  # noqa: E402


def list_sizes(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    sizes = client.list_sizes()
    wanted = module.params["slug"]
    if wanted is not None:
        selected = [s for s in sizes if s.get("slug") == wanted]
        if not selected:
            module.fail_json(msg="No size %r in the platform's catalog (%s); it offers: %s"
                             % (wanted, client.sizes_route(), ", ".join(str(s.get("slug")) for s in sizes) or "nothing"),
                             sizes=sizes)
        sizes = selected
    return dict(changed=False, sizes=sizes, slugs=[s.get("slug") for s in sizes])


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(slug=dict(type="str")),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: list_sizes(module, client))


if __name__ == "__main__":
    main()
