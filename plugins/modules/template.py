#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: template
short_description: Register, rebuild and delete microVM sandbox templates
version_added: 0.1.0
description:
  - Registers a template built from an OCI image you have already pushed, rebased onto a platform base template,
    rebuilds it when asked to, and deletes it.
  - B(What the platform reports back.) The template object carries C(spec.base_template) only
    (U(https://docs.digitalocean.com/reference/pydo/reference/harness/create_template/)), so an existing template is
    compared on O(base_template) alone and is not rebuilt when nothing reported differs. The platform does not
    report the image a template was built from, so a new O(source_oci_ref) (or a new image under the same tag) is
    B(not) detected; set O(force_rebuild=true) to rebuild from it.
  - A template whose last build failed is rebuilt by V(present), since it does not hold a usable image.
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
      - The diff shows the template's name, base template and status before and after.
notes:
  - While the task waits more than a few seconds (a build), its action plugin shows what the wait is on as it happens,
    at the default verbosity (the status, the platform's warnings, the seconds so far), and RV(stages) afterwards.
    See the collection's docs/modules.md, "Progress while a task waits".
options:
  name:
    description:
      - Name of the template (sessions refer to templates by name). A template id is accepted too.
    type: str
    required: true
  state:
    description:
      - V(present) registers the template, or rebuilds it when O(base_template) differs from what it was built on
        (or O(force_rebuild) is set), and waits for the build.
      - V(absent) deletes it. The platform refuses while live sessions use it.
    type: str
    choices: [present, absent]
    default: present
  source_oci_ref:
    description:
      - The image to build from, for example V(registry.example.com/team/agent:1.4), V(localhost:5000/agent@sha256:...)
        or an OCI layout V(oci:/path/to/layout:tag).
      - Required to register a new template. It is sent again on a rebuild; it is never compared, since the
        platform does not report it back.
    type: str
  base_template:
    description:
      - The platform base the image is rebased onto. Required to register a new template ("omitting it causes
        registration to fail",
        U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/how-to/use-custom-template/)).
      - "Documented values: V(codex-base), V(opencode-base), V(claude-code-base), V(hermes-base), V(langgraph-base),
        V(sandbox) (no agent: a bare sandbox with your own tooling) and V(crewai)
        (U(https://docs.digitalocean.com/reference/doctl/reference/harness-runtime/template/create/)); the legacy
        V(coding-base), V(coding-codex), V(coding-opencode), V(coding-claude-code), V(coding-hermes) and V(langgraph)
        are still accepted. The platform checks the value."
      - The local control plane accepts the same values and builds every one on its built-in root filesystem.
      - Compared with the existing template's C(spec.base_template) when set.
    type: str
  force_rebuild:
    description:
      - Rebuild the template even when nothing differs, for example after pushing a new image under the same tag.
        This always reports a change.
    type: bool
    default: false
  wait:
    description:
      - Wait until the build finishes, up to O(wait_timeout) seconds. A failed build fails the task with the
        build's own error.
      - With V(false), the module returns as soon as the build has started.
    type: bool
    default: true
seealso:
  - module: microvm.sandbox.template_info
  - module: microvm.sandbox.session
"""

EXAMPLES = r"""
- name: Register the agent template from the image CI pushed
  microvm.sandbox.template:
    name: agent-python
    source_oci_ref: "registry.example.com/team/agent-python@{{ image_digest }}"
    base_template: sandbox
  register: tpl

- name: Rebuild from a new image (the platform does not report the source, so say so)
  microvm.sandbox.template:
    name: agent-python
    source_oci_ref: registry.example.com/team/agent-python:2.0
    base_template: sandbox
    force_rebuild: true

- name: Start a build and do not wait for it
  microvm.sandbox.template:
    name: agent-python
    source_oci_ref: registry.example.com/team/agent-python:2.0
    base_template: sandbox
    wait: false

- name: Delete it
  microvm.sandbox.template:
    name: agent-python
    state: absent
"""

RETURN = r"""
template:
  description:
    - The template after the task (in check mode, the expected result). For O(state=absent), as last seen, or empty.
  returned: always
  type: dict
  contains:
    template_id:
      description: Id of the template.
      type: str
    name:
      description: Name.
      type: str
    status:
      description: C(TEMPLATE_STATUS_PENDING), C(TEMPLATE_STATUS_BUILDING), C(TEMPLATE_STATUS_READY) or
        C(TEMPLATE_STATUS_FAILED).
      type: str
    spec:
      description: What it is built on, C(base_template). The platform does not report the source image.
      type: dict
    created_at:
      description: Creation time.
      type: str
    updated_at:
      description: Time of the last change.
      type: str
  sample:
    template_id: 5a3e0c56-9a62-4f4e-8d6d-3f0b5d8f3c11
    name: agent-python
    status: TEMPLATE_STATUS_READY
    spec:
      base_template: sandbox
build:
  description: The build this task started (or waited for), with C(build_id), C(status) and C(error).
  returned: when a build was started or waited for
  type: dict
  sample:
    build_id: 0d8b6a7c-3f61-4c1e-a0f5-b2b1d6e0f7a9
    status: SUCCEEDED
    error: ""
stages:
  description:
    - What the task did and waited on, in order, with the seconds each took (to a tenth); the call C(create),
      C(update) or C(delete), then each status the build passed (C(build PENDING), C(build BUILDING)) until it
      ended. Empty when the task changed nothing and waited on nothing (and in check mode).
    - While the task runs, a build that lasts more than a few seconds is also shown as it happens (see the notes).
  returned: always
  type: list
  elements: dict
  sample: [{"stage": "create", "seconds": 0.1}, {"stage": "build BUILDING", "seconds": 63.0}]
"""

from typing import Any, Collection  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.oci import parse_image_ref  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.progress import Timeline  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, template_status  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.views import object_view  # noqa: E402

IN_PROGRESS = ("PENDING", "BUILDING")


class TemplateManager(object):

    def __init__(self, module: AnsibleModule, client: ApiClient) -> None:
        self.module = module
        self.client = client
        self.p = module.params
        self.check = module.check_mode
        self.build: dict[str, Any] | None = None
        self.timeline = Timeline()   # the task's calls and the build's statuses, returned as `stages`

    def run(self) -> dict[str, Any]:
        existing = self.client.find_template(self.p["name"])
        if self.p["state"] == "absent":
            changed, after = self.absent(existing)
            template = existing if changed else {}
        else:
            changed, after = self.present(existing)
            template = after
        result: dict[str, Any] = dict(changed=changed, template=template or {}, stages=self.timeline.as_list())
        if self.build is not None:
            result["build"] = self.build
        if self.module._diff:
            result["diff"] = dict(before=object_view(existing), after=object_view(after))
        return result

    # -- present -----------------------------------------------------------
    def present(self, existing: dict[str, Any] | None) -> tuple[bool, dict[str, Any]]:
        if existing is None:
            return True, self.create()
        if self.p["wait"] and template_status(existing) in IN_PROGRESS and not self.check:
            # A build started earlier (wait: false) decides what the template holds now.
            existing, self.build = self.client.wait_build(existing["template_id"], timeout=self.p["wait_timeout"],
                                                          observe=self.watch)
        reasons = self.rebuild_reasons(existing)
        if not reasons:
            return False, existing
        return True, self.rebuild(existing)

    def rebuild_reasons(self, existing: dict[str, Any]) -> list[str]:
        reasons = []
        if self.p["force_rebuild"]:
            reasons.append("force_rebuild")
        if template_status(existing) == "FAILED":
            reasons.append("its last build failed")
        # Only what the platform reports (spec.base_template) is compared: the source image is not reported.
        spec = existing.get("spec") or {}
        if self.p["base_template"] is not None and spec.get("base_template") != self.p["base_template"]:
            reasons.append("base_template")
        return reasons

    def wanted_image(self) -> dict[str, str]:
        try:
            return parse_image_ref(self.p["source_oci_ref"])
        except ValueError as e:
            self.module.fail_json(msg="source_oci_ref: %s" % e)

    def create(self) -> dict[str, Any]:
        missing = [o for o in ("source_oci_ref", "base_template") if not self.p[o]]
        if missing:
            self.module.fail_json(msg="Template %r does not exist; %s %s required to register it (base_template: a "
                                      "platform base such as sandbox, codex-base or claude-code-base)."
                                  % (self.p["name"], " and ".join(missing), "are" if len(missing) > 1 else "is"))
        self.wanted_image()  # refuse a malformed reference before any call
        if self.check:
            return self.predicted({})
        self.timeline.mark("create")
        template = self.client.create_template(self.p["name"], self.p["source_oci_ref"], self.p["base_template"])
        return self.wait_for_build(template, known=())

    def rebuild(self, existing: dict[str, Any]) -> dict[str, Any]:
        if self.check:
            return self.predicted(existing)
        tid = existing["template_id"]
        known: list[Any] = [b.get("build_id") for b in self.client.list_builds(tid)]
        if self.p["source_oci_ref"]:
            self.wanted_image()
        # With force_rebuild and no source given, the platform rebuilds what it has.
        self.timeline.mark("update")
        template = self.client.update_template(tid, source_oci_ref=self.p["source_oci_ref"],
                                               base_template=self.p["base_template"])
        return self.wait_for_build(template, known)

    def wait_for_build(self, template: dict[str, Any], known: Collection[Any]) -> dict[str, Any]:
        tid = template["template_id"]
        if not self.p["wait"]:
            self.timeline.end()
            self.build = self.client.newest_build(tid, exclude=known)
            return template
        template, self.build = self.client.wait_build(tid, known_build_ids=known, timeout=self.p["wait_timeout"],
                                                      observe=self.watch)
        return template

    def watch(self, status: str) -> None:
        """Each build status on the way is a stage (`build PENDING`, `build BUILDING`); the outcome ends the last."""
        if status in ("SUCCEEDED", "READY", "FAILED"):
            self.timeline.end()
        else:
            self.timeline.mark("build " + status)

    def predicted(self, existing: dict[str, Any]) -> dict[str, Any]:
        spec = dict(existing.get("spec") or {})
        if self.p["base_template"] is not None:
            spec["base_template"] = self.p["base_template"]
        return dict(existing, name=existing.get("name") or self.p["name"], spec=spec,
                    status="TEMPLATE_STATUS_READY")

    # -- absent ------------------------------------------------------------
    def absent(self, existing: dict[str, Any] | None) -> tuple[bool, dict[str, Any]]:
        if existing is None:
            return False, {}
        if not self.check:
            self.timeline.mark("delete")
            try:
                self.client.delete_template(existing["template_id"])
            except ApiError as e:
                if not e.gone:
                    raise
        return True, {}


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            name=dict(type="str", required=True),
            state=dict(type="str", default="present", choices=["present", "absent"]),
            source_oci_ref=dict(type="str"),
            base_template=dict(type="str"),
            force_rebuild=dict(type="bool", default=False),
            wait=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: TemplateManager(module, client).run())


if __name__ == "__main__":
    main()
