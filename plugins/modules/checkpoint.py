#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: checkpoint
short_description: Checkpoint a microVM sandbox session, roll it back, delete checkpoints
version_added: 0.1.0
description:
  - Creates a checkpoint of a session's sandbox, rolls the session back to a checkpoint, or deletes checkpoints.
  - Checkpoints are identified by their O(label) (or O(checkpoint_id)); labels make creation idempotent.
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
      - For V(present) and V(absent), the checkpoint before and after; for V(rolled_back), the session before
        and after (its C(sandbox_id) changes).
options:
  session:
    description:
      - Id or name of the session. Names are matched among live sessions only.
    type: str
    required: true
  state:
    description:
      - V(present) creates a checkpoint labelled O(label) unless the session already has one with that label in
        status C(READY) or C(PENDING) (and O(retake) is not set). Without O(label), a new checkpoint is created on
        every run.
      - V(rolled_back) rolls the session back to the checkpoint given by O(checkpoint_id) or O(label) (the newest
        with that label) and waits until the session is usable. The platform boots a new sandbox from the checkpoint
        every time, so this B(always reports a change) (in check mode too, without doing it).
      - V(absent) deletes the checkpoint given by O(checkpoint_id), or every checkpoint labelled O(label).
    type: str
    choices: [present, rolled_back, absent]
    default: present
  label:
    description:
      - Label of the checkpoint.
    type: str
  checkpoint_id:
    description:
      - Id of the checkpoint, for V(rolled_back) and V(absent).
    type: str
  retake:
    description:
      - For V(present) with O(label), take a new checkpoint even when the session already has one with that label,
        then delete the older checkpoints with that label (RV(replaced)), so that the label names the session's
        state B(now). This is what a rerun on a kept session needs after its sources changed; without it, the label
        finds the old checkpoint, and everything forked or rolled back from it tests the old state.
      - Forks of an older checkpoint stay as they are, and M(microvm.sandbox.session_fork) given the label counts only
        the forks of the new checkpoint, so it forks new copies. Delete the old copies first, with
        M(microvm.sandbox.session_fork) and O(microvm.sandbox.session_fork#module:state=absent) for the same label.
        See "Reruns on kept sessions" in docs/playbooks.md, also for labels per commit instead.
      - Always reports a change.
    type: bool
    default: false
  check_staged_credentials:
    description:
      - Refuse a checkpoint while credentials staged by the role C(microvm.sandbox.credentials) are in the session; the copy
        would keep them after their cleanup, in every session made from it. The message names the staged directories
        and the fix (run the role's C(cleanup) first, stage again afterwards).
      - Runs one command in the session first (the documented exec, which wakes a paused session) to list what the
        credentials role staged, by its manifest in C(/workspace/.scratch/.microvm/staged-credentials).
      - V(false) skips the check, for a session that never holds credentials or whose permission policy refuses the
        command.
    type: bool
    default: true
    version_added: 0.1.0
  wait:
    description:
      - For V(rolled_back), wait until the session is usable again, up to O(wait_timeout) seconds.
      - Creating a checkpoint always waits; the platform answers once it is done.
    type: bool
    default: true
notes:
  - The platform refuses a checkpoint (HTTP 409) while a command is running in the session.
seealso:
  - module: microvm.sandbox.checkpoint_info
  - module: microvm.sandbox.session
"""

EXAMPLES = r"""
- name: Checkpoint the sandbox once its dependencies are installed
  microvm.sandbox.checkpoint:
    session: ci-job-42
    label: deps-installed
  register: cp

- name: Roll back to it after a test run (always reports a change)
  microvm.sandbox.checkpoint:
    session: ci-job-42
    label: deps-installed
    state: rolled_back

- name: Roll back by id
  microvm.sandbox.checkpoint:
    session: ci-job-42
    checkpoint_id: "{{ cp.checkpoint.checkpoint_id }}"
    state: rolled_back

- name: On a rerun after the sources changed, take it again (the label names the new state, the old one goes)
  microvm.sandbox.checkpoint:
    session: ci-job-42
    label: deps-installed
    retake: true
  register: cp

- name: Delete it
  microvm.sandbox.checkpoint:
    session: ci-job-42
    label: deps-installed
    state: absent
"""

RETURN = r"""
checkpoint:
  description:
    - The checkpoint created, found, rolled back to, or deleted (in check mode, the expected result); empty when there
      was none.
  returned: always
  type: dict
  contains:
    checkpoint_id:
      description: Id of the checkpoint, an opaque string (the platform's examples show C(cp_9f2c1a4b)).
      type: str
    session_id:
      description: Id of its session.
      type: str
    status:
      description: C(PENDING), C(READY) or C(FAILED).
      type: str
    kind:
      description: How it was taken; C(explicit) for a checkpoint asked for.
      type: str
    label:
      description: Label.
      type: str
    event_id:
      description: The session event the checkpoint was cut at.
      type: str
    size_bytes:
      description: Size of the checkpoint.
      type: int
    created_at:
      description: Creation time.
      type: str
    error_message:
      description: Why it failed, when it did.
      type: str
  sample:
    checkpoint_id: cp_9f2c1a4b
    session_id: 2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1
    status: READY
    kind: explicit
    label: deps-installed
    event_id: 01JABCDEFGHJKLMNPQRSTVWXYZ
    size_bytes: 73400320
replaced:
  description: Ids of the older checkpoints with the same label that O(retake) deleted.
  returned: when O(retake) is set and O(state=present)
  type: list
  elements: str
session:
  description: The session after a rollback (same C(session_id), new C(sandbox_id)).
  returned: when O(state=rolled_back)
  type: dict
  sample:
    session_id: 2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1
    name: ci-job-42
    status: SESSION_STATUS_READY
    sandbox_id: sbx-0002
"""

from typing import Any  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import profile  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, refuse_if_credentials_staged, \
    run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, NotFound  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.views import object_view  # noqa: E402

# A checkpoint in one of these counts as existing for idempotency; a FAILED one does not.
KEPT = ("READY", "PENDING")


def checkpoint_status(cp: dict[str, Any]) -> str:
    s = str((cp or {}).get("status") or "").upper()
    return s[len("CHECKPOINT_STATUS_"):] if s.startswith("CHECKPOINT_STATUS_") else s


class CheckpointManager(object):

    def __init__(self, module: AnsibleModule, client: ApiClient) -> None:
        self.module = module
        self.client = client
        self.p = module.params
        self.check = module.check_mode

    def run(self) -> dict[str, Any]:
        self.session = self.client.require_session(self.p["session"], live=True)
        sid = self.session["session_id"]
        state = self.p["state"]
        if state == "present":
            before, after, changed = self.present(sid)
            result: dict[str, Any] = dict(changed=changed, checkpoint=after)
            if self.p["retake"]:
                result["replaced"] = self.replaced
        elif state == "absent":
            before, after, changed = self.absent(sid)
            result = dict(changed=changed, checkpoint=before if changed else {})
        else:
            before, after, checkpoint = self.rolled_back(sid)
            result = dict(changed=True, checkpoint=checkpoint, session=after)
        if self.module._diff:
            result["diff"] = dict(before=object_view(before), after=object_view(after))
        return result

    def present(self, sid: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
        label = self.p["label"]
        self.replaced: list[str] = []
        existing = None
        if label:
            existing = self.client.find_checkpoint(sid, label=label)
            if existing is not None and checkpoint_status(existing) in KEPT and not self.p["retake"]:
                return existing, existing, False
        before = (existing or {}) if self.p["retake"] else {}
        if self.p["check_staged_credentials"]:
            refuse_if_credentials_staged(self.client, self.session, "checkpoint")
        if self.check:
            if self.p["retake"]:
                self.replaced = [cp["checkpoint_id"] for cp in self.labelled(sid, label)]
            return before, dict(session_id=sid, label=label, status="READY"), True
        # A retake lists the older ones first: the new checkpoint carries the same label.
        older = self.labelled(sid, label) if self.p["retake"] else []
        created = self.client.create_checkpoint(sid, label=label)
        if checkpoint_status(created) == "READY":  # never give up the old state for a failed new one
            self.replaced = self.delete_all(sid, older)
        return before, created, True

    def labelled(self, sid: str, label: str | None) -> list[dict[str, Any]]:
        return [cp for cp in self.client.list_checkpoints(sid) if cp.get("label") == label]

    def delete_all(self, sid: str, checkpoints: list[dict[str, Any]]) -> list[str]:
        """Delete these checkpoints (already gone is fine) -> their ids."""
        for cp in checkpoints:
            try:
                self.client.delete_checkpoint(sid, cp["checkpoint_id"])
            except ApiError as e:
                if not e.gone:  # already gone is what we want
                    raise
        return [cp["checkpoint_id"] for cp in checkpoints]

    def absent(self, sid: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
        if self.p["checkpoint_id"]:
            found = self.client.find_checkpoint(sid, checkpoint_id=self.p["checkpoint_id"])
            doomed = [found] if found else []
        else:
            doomed = [cp for cp in self.client.list_checkpoints(sid) if cp.get("label") == self.p["label"]]
        if not doomed:
            return {}, {}, False
        if not self.check:
            self.delete_all(sid, doomed)
        return doomed[0], {}, True

    def rolled_back(self, sid: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        checkpoint = self.client.find_checkpoint(sid, checkpoint_id=self.p["checkpoint_id"], label=self.p["label"])
        if checkpoint is None:
            raise NotFound("checkpoint", self.p["checkpoint_id"] or self.p["label"],
                           "in session %r (checkpoint ids and labels are per session)" % self.session.get("name"))
        if checkpoint_status(checkpoint) == "FAILED":
            self.module.fail_json(msg="Checkpoint %s (%r) failed, so the session cannot be rolled back to it: %s"
                                  % (checkpoint.get("checkpoint_id"), checkpoint.get("label"),
                                     checkpoint.get("error_message") or "no error given"), checkpoint=checkpoint)
        before = self.session
        if self.check:
            return before, dict(before, status="SESSION_STATUS_READY"), checkpoint
        after = self.client.rollback(sid, checkpoint["checkpoint_id"])
        if self.p["wait"] and profile.short_status(after.get("status")) not in profile.USABLE:
            after = self.client.wait_session(sid, until=profile.USABLE, timeout=self.p["wait_timeout"])
        return before, after, checkpoint


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            session=dict(type="str", required=True),
            state=dict(type="str", default="present", choices=["present", "rolled_back", "absent"]),
            label=dict(type="str"),
            checkpoint_id=dict(type="str"),
            wait=dict(type="bool", default=True),
            retake=dict(type="bool", default=False),
            check_staged_credentials=dict(type="bool", default=True),
        ),
        required_if=[
            ("state", "rolled_back", ("checkpoint_id", "label"), True),
            ("state", "absent", ("checkpoint_id", "label"), True),
        ],
        mutually_exclusive=[("checkpoint_id", "label")],
        supports_check_mode=True,
    )
    if module.params["state"] == "present" and module.params["checkpoint_id"]:
        module.fail_json(msg="checkpoint_id cannot be chosen when creating a checkpoint; use label to name it")
    if module.params["retake"] and not (module.params["state"] == "present" and module.params["label"]):
        module.fail_json(msg="retake needs state: present and a label (it takes the labelled checkpoint again); "
                             "without a label every run takes a new checkpoint anyway")
    run_api_module(module, lambda client: CheckpointManager(module, client).run())


if __name__ == "__main__":
    main()
