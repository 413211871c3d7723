#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: session_fork
short_description: Fork a microVM sandbox session into 1-4 independent copies
version_added: 0.1.0
description:
  - Forks a session (C(POST /v2/agents/sessions/{id}/fork)); each copy boots a fresh sandbox from a checkpoint of
    the source, with its workspace and root filesystem changes, and the source keeps running
    (U(https://docs.digitalocean.com/reference/pydo/reference/harness/create_session_fork/)).
  - Without O(checkpoint), the platform first takes an implicit checkpoint of the source "now" and forks from it.
  - The fork is all or nothing, and blocking (see O(blocking_timeout)); a fork that got no answer is never sent again.
  - B(Idempotent by lineage, not by name.) Every copy reports C(parent_session_id) (and C(fork_from_checkpoint_id));
    the module counts the live sessions forked from O(source) (from O(checkpoint), when given) and forks only the
    copies missing to reach O(count). A second run with the same task changes nothing and returns the same sessions.
  - B(Two fork tasks on the same source share that count.) Without O(checkpoint), every live fork of the source
    counts, whoever made it. After one task made 3 forks, a task with O(count=2) changes nothing, and one with
    O(count=4) adds only 1; O(state=absent) deletes them all. Tasks that must not see each other's copies fork from
    different checkpoints (different labels), since a task naming a checkpoint counts only the forks from it.
  - B(Names.) The fork call takes no names
    (U(https://docs.digitalocean.com/reference/pydo/reference/harness/create_session_fork/)), so the platform names
    the copies, and a name is known for certain only once the platform has given it (RV(names)). The local control
    plane names them
    C(<source>-fork-1), C(<source>-fork-2) and so on, the lowest numbers no live session uses; check mode predicts
    names by that rule. On the platform, use the names RV(names) returns after a real run.
  - A session with a persistent workspace cannot be forked (the platform does not offer it).
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
      - The diff shows the names of the source's live forks before and after.
options:
  source:
    description:
      - Id or name of the session to fork. Names are matched among live sessions only.
    type: str
    required: true
  checkpoint:
    description:
      - The checkpoint to fork from, by id or by label (the newest checkpoint with that label). It must be C(READY).
      - Not set forks from an implicit checkpoint of the source taken now.
    type: str
  count:
    description:
      - How many live forks of the source (from O(checkpoint)) there should be, 1 to 4.
    type: int
    default: 1
  state:
    description:
      - V(present) forks the copies missing to reach O(count).
      - V(absent) deletes every live fork of the source (from O(checkpoint), when given) and waits until they are gone.
    type: str
    choices: [present, absent]
    default: present
  wait:
    description:
      - Wait until the new sessions are usable (or, for V(absent), gone), up to O(wait_timeout) seconds.
    type: bool
    default: true
  check_staged_credentials:
    description:
      - Refuse a fork without O(checkpoint) while credentials staged by the role C(microvm.sandbox.credentials) are in the session; the copy
        would keep them after their cleanup, in every session made from it. The message names the staged directories
        and the fix (run the role's C(cleanup) first, stage again afterwards).
      - Only for a fork without O(checkpoint), which captures the session as it is now; a fork from an existing
        checkpoint copies what that checkpoint holds (take checkpoints with M(microvm.sandbox.checkpoint), which
        checks too).
      - Runs one command in the session first (the documented exec, which wakes a paused session) to list what the
        credentials role staged, by its manifest in C(/workspace/.scratch/.microvm/staged-credentials).
      - V(false) skips the check, for a session that never holds credentials or whose permission policy refuses the
        command.
    type: bool
    default: true
    version_added: 0.1.0
seealso:
  - module: microvm.sandbox.session
  - module: microvm.sandbox.checkpoint
  - name: How to Checkpoint, Fork, and Roll Back Sessions
    description: The platform's guide.
    link: https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/how-to/checkpoint-fork-rollback-sessions/
"""

EXAMPLES = r"""
- name: A prepared sandbox, saved once its dependencies are in
  microvm.sandbox.checkpoint:
    session: build-base
    label: deps-installed

- name: Four copies of it, one per test shard (a rerun forks nothing more)
  microvm.sandbox.session_fork:
    source: build-base
    checkpoint: deps-installed
    count: 4
  register: shards

- name: Add them to the inventory
  ansible.builtin.add_host:
    name: "{{ item }}"
    groups: shards
    ansible_connection: microvm.sandbox.agent
  loop: "{{ shards.names }}"

- name: A second checkpoint of the same source
  microvm.sandbox.checkpoint:
    session: build-base
    label: lint-ready

- name: Another fan-out of the same source, kept apart by forking from its own checkpoint
  microvm.sandbox.session_fork:
    source: build-base
    checkpoint: lint-ready      # counts (and deletes) only the forks from this checkpoint
    count: 2

- name: Delete the copies when done
  microvm.sandbox.session_fork:
    source: build-base
    checkpoint: "{{ item }}"
    state: absent
  loop: [deps-installed, lint-ready]
"""

RETURN = r"""
sessions:
  description:
    - The live forks of the source (from the checkpoint, when given) after the task, oldest first, as the platform
      reports them (see RV(microvm.sandbox.session#module:session) for the fields). Empty for O(state=absent).
  returned: always
  type: list
  elements: dict
names:
  description: The names of RV(sessions), in the same order.
  returned: always
  type: list
  elements: str
  sample: [build-base-fork-1, build-base-fork-2]
created:
  description:
    - The names of the sessions this task forked.
    - In check mode, the names it would fork by the local control plane's rule (C(<source>-fork-<n>), the lowest
      numbers no live session uses); the platform chooses its own names.
  returned: always
  type: list
  elements: str
checkpoint:
  description: The checkpoint the forks come from, when O(checkpoint) was given.
  returned: when O(checkpoint) is set
  type: dict
"""

from typing import Any, Collection  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import profile  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import api_argument_spec, refuse_if_credentials_staged, \
    run_api_module  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, NotFound  # noqa: E402

MAX_FORKS = 4


class ForkManager(object):

    def __init__(self, module: AnsibleModule, client: ApiClient) -> None:
        self.module = module
        self.client = client
        self.p = module.params
        self.check = module.check_mode

    def run(self) -> dict[str, Any]:
        source = self.client.require_session(self.p["source"], live=True)
        sid = source["session_id"]
        checkpoint = self.resolve_checkpoint(sid)
        from_id = checkpoint["checkpoint_id"] if checkpoint else None
        before = self.live_forks(sid, from_id)
        after: list[dict[str, Any]]
        created: list[Any]
        if self.p["state"] == "absent":
            changed, after, created = self.absent(before), [], []
        else:
            changed, after, created = self.present(source, from_id, before)
        result: dict[str, Any] = dict(changed=changed, sessions=after, names=[s.get("name") for s in after], created=created)
        if checkpoint:
            result["checkpoint"] = checkpoint
        if self.module._diff:
            result["diff"] = dict(before={"forks": [s.get("name") for s in before]},
                                  after={"forks": [s.get("name") for s in after]})
        return result

    def resolve_checkpoint(self, sid: str) -> dict[str, Any] | None:
        wanted = self.p["checkpoint"]
        if not wanted:
            return None
        # Checkpoint ids are opaque (`cp_9f2c1a4b` in the docs): the value is tried as an id, then as a label.
        found = self.client.find_checkpoint(sid, checkpoint_id=wanted)
        if found is None:
            found = self.client.find_checkpoint(sid, label=wanted)
        if found is None:
            raise NotFound("checkpoint", wanted, "in session %s (checkpoint ids and labels are per session)" % sid)
        return found

    def live_forks(self, sid: str, from_id: str | None) -> list[dict[str, Any]]:
        forks = self.client.forks_of(sid, from_id)
        return sorted(forks, key=lambda s: (str(s.get("created_at") or ""), s.get("name") or ""))

    def present(self, source: dict[str, Any], from_id: str | None,
                existing: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]], list[Any]]:
        missing = self.p["count"] - len(existing)
        if missing <= 0:
            return False, existing, []
        if from_id is None and self.p["check_staged_credentials"]:  # the fork captures the session as it is now
            refuse_if_credentials_staged(self.client, source, "fork")
        if self.check:
            live = [s.get("name") or "" for s in self.client.list_sessions()
                    if profile.short_status(s.get("status")) not in profile.GONE]
            predicted = [dict(name=name, parent_session_id=source["session_id"], fork_from_checkpoint_id=from_id or "",
                              status="SESSION_STATUS_READY")
                         for name in fork_names(source.get("name") or "", live, missing)]
            return True, existing + predicted, [s["name"] for s in predicted]
        children = self.client.fork_session(source["session_id"], count=missing, from_checkpoint_id=from_id)
        if self.p["wait"]:
            children = [self.client.wait_session(c["session_id"], until=profile.USABLE, timeout=self.p["wait_timeout"])
                        for c in children]
        return True, existing + children, [c.get("name") for c in children]

    def absent(self, existing: list[dict[str, Any]]) -> bool:
        if not existing:
            return False
        if self.check:
            return True
        for s in existing:
            try:
                self.client.delete_session(s["session_id"])
            except ApiError as e:
                if not e.gone:
                    raise
        if self.p["wait"]:
            for s in existing:
                self.client.wait_session(s["session_id"], until=frozenset(["DESTROYED"]),
                                         timeout=self.p["wait_timeout"], gone_ok=True)
        return True


def fork_names(parent_name: str, taken: Collection[str], count: int) -> list[str]:
    """The names the local control plane gives `count` new forks: <parent>-fork-<n>, lowest free n first.

    The same rule as the plane's own fork_name (microvm_localplane.checkpoints; a unit test keeps the two in step):
    a name is free when no live session has it (case-insensitively); the parent's name is shortened so that the
    result fits in 64 characters.
    """
    used = set(str(n).lower() for n in taken)
    names: list[str] = []
    n = 1
    while len(names) < count:
        suffix = "-fork-%d" % n
        name = parent_name[:64 - len(suffix)].rstrip("._-") + suffix
        if name.lower() not in used:
            names.append(name)
            used.add(name.lower())
        n += 1
    return names


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            source=dict(type="str", required=True),
            checkpoint=dict(type="str"),
            count=dict(type="int", default=1),
            state=dict(type="str", default="present", choices=["present", "absent"]),
            wait=dict(type="bool", default=True),
            check_staged_credentials=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    if not 1 <= module.params["count"] <= MAX_FORKS:
        module.fail_json(msg="count must be from 1 to %d (the platform forks at most %d copies at once), got %d"
                         % (MAX_FORKS, MAX_FORKS, module.params["count"]))
    run_api_module(module, lambda client: ForkManager(module, client).run())


if __name__ == "__main__":
    main()
