#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: environment_config
short_description: Save and delete Environment Configs, the reusable specs microVM sandbox sessions start from
version_added: 0.1.0
description:
  - An Environment Config (doctl calls it an agent config) is an environment spec saved once under a name unique in
    your team, which sessions then start from without sending the spec again
    (U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/how-to/use-agent-configs/),
    U(https://docs.digitalocean.com/reference/pydo/reference/harness/create_config/)). Only a session started
    from a config can hold a persistent workspace (M(microvm.sandbox.persistent_workspace)).
  - Start a session from it with M(microvm.sandbox.session) and O(microvm.sandbox.session#module:config_id).
  - B(Configs are immutable.) The platform does not show a config's manifest back in a form this module could
    compare, so an existing config is left as it is, whatever O(spec) says; set O(recreate=true) to delete it and
    save it again (the platform refuses while sessions started from it are active).
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
      - The diff shows the config's name and content hash before and after.
options:
  name:
    description:
      - Name of the config, unique in your team (case-insensitively), 1 to 64 characters. An id is accepted too.
    type: str
    required: true
  spec:
    description:
      - The environment spec, as the session module sends it (for example C(name), C(agent), C(template), C(size),
        C(idle_timeout), C(keep_warm), C(persistent_workspace), C(env), C(egress))
        (U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/reference/environment-spec/)).
        It is sent as YAML text (C(manifest_yaml)); C(agent) defaults to V(custom).
      - Put credentials in O(secrets), never in the spec's C(env).
      - Required to create the config.
    type: dict
  secrets:
    description:
      - The spec's C(secrets), kept in the platform's secret store and never shown back. Never logged.
    type: dict
  insights:
    description:
      - Which signals go to DigitalOcean Insights, C(metrics), C(logs) and C(traces), each V(true), V(false) or
        null (no choice, so the product default).
    type: dict
  state:
    description:
      - V(present) saves the config when no config has that name.
      - V(absent) deletes it; the platform refuses while sessions started from it are active.
    type: str
    choices: [present, absent]
    default: present
  recreate:
    description:
      - With O(state=present), delete an existing config of that name and save it again from O(spec). This always
        reports a change.
    type: bool
    default: false
seealso:
  - module: microvm.sandbox.environment_config_info
  - module: microvm.sandbox.session
  - module: microvm.sandbox.persistent_workspace
"""

EXAMPLES = r"""
- name: Save the reviewer's environment once
  microvm.sandbox.environment_config:
    name: reviewer
    spec:
      name: reviewer
      agent: custom
      size: mars-2vcpu-4gb
      idle_timeout: 30m
      permissions:
        default: allow  # every session started from it; omitted, the platform's default is ask
    secrets:
      GITHUB_TOKEN: "{{ vault_github_token }}"
  register: reviewer

- name: Start a session from it, with a persistent workspace
  microvm.sandbox.session:
    name: review-2
    config_id: "{{ reviewer.config.id }}"
    workspace_id: "{{ notes_workspace_id }}"

- name: Delete the session (its files stay in the workspace)
  microvm.sandbox.session:
    name: review-2
    state: absent

- name: Delete the config once no session from it is active
  microvm.sandbox.environment_config:
    name: reviewer
    state: absent
"""

RETURN = r"""
config:
  description:
    - The config after the task (in check mode, the expected result); for O(state=absent), as last seen, or empty.
  returned: always
  type: dict
  contains:
    id:
      description: Id of the config (sessions started from it report it as C(config_id)).
      type: str
    name:
      description: Its name.
      type: str
    agentspec_schema_version:
      description: The spec format it was saved in.
      type: str
    content_hash:
      description: Hash of its manifest.
      type: str
    created_by:
      description: Who created it.
      type: str
    created_at:
      description: Creation time.
      type: str
    updated_at:
      description: Time of the last change (configs are immutable).
      type: str
    credentials:
      description: The secret slots the manifest declares (C(name), C(source), C(provider)); never a value.
      type: list
      elements: dict
  sample:
    id: 019fb39c-14d9-7080-933e-b9b90e25acda
    name: reviewer
    agentspec_schema_version: flat
    content_hash: 75803fef24dc731824ecd4a1853c76153c7d8503534092b94da3ca3f31a882f4
    created_by: local
    created_at: "2026-11-17T10:00:00Z"
    updated_at: "2026-11-17T10:00:00Z"
    credentials:
      - name: GITHUB_TOKEN
        source: tenantSecret
        provider: ""
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import profile, spec_yaml  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.views import object_view  # noqa: E402


def manifest(module: AnsibleModule) -> str:
    p = module.params
    spec = dict(p["spec"] or {})
    if "secrets" in spec:
        module.fail_json(msg="spec.secrets: give credentials in the secrets option, which is never logged")
    spec.setdefault("agent", profile.DEFAULT_AGENT)
    if p["secrets"]:
        spec["secrets"] = dict((str(k), str(v)) for k, v in p["secrets"].items())
    try:
        return spec_yaml.dump(spec)
    except (TypeError, ValueError) as e:
        module.fail_json(msg="spec: %s" % e)


def save(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    p = module.params
    if not p["spec"]:
        module.fail_json(msg="Config %r does not exist; spec is required to save it." % p["name"])
    text = manifest(module)
    if module.check_mode:
        return dict(id="", name=p["name"], agentspec_schema_version="", content_hash="", created_by="", created_at="",
                    updated_at="", credentials=[dict(name=k, source="", provider="") for k in sorted(p["secrets"] or {})])
    return client.create_config(p["name"], text, insights=p["insights"])


def delete(client: ApiClient, existing: dict[str, Any]) -> None:
    try:
        client.delete_config(existing["id"])
    except ApiError as e:
        if not e.gone:
            raise


def run(module: AnsibleModule, client: ApiClient) -> dict[str, Any]:
    p = module.params
    existing = client.find_config(p["name"])
    if p["state"] == "absent":
        changed, after = existing is not None, {}
        if existing is not None and not module.check_mode:
            delete(client, existing)
        shown = existing or {}
    else:
        if existing is not None and not p["recreate"]:
            changed, after = False, existing
        else:
            manifest(module)  # refuse a bad spec before deleting anything
            if existing is not None and not module.check_mode:
                delete(client, existing)
            changed, after = True, save(module, client)
        shown = after
    result = dict(changed=changed, config=shown)
    if module._diff:
        result["diff"] = dict(before=object_view(existing), after=object_view(after))
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            name=dict(type="str", required=True),
            spec=dict(type="dict"),
            secrets=dict(type="dict", no_log=True),
            insights=dict(type="dict"),
            state=dict(type="str", default="present", choices=["present", "absent"]),
            recreate=dict(type="bool", default=False),
        ),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: run(module, client))


if __name__ == "__main__":
    main()
