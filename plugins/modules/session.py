#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: session
short_description: Create, pause, resume and delete microVM sandbox sessions
version_added: 0.1.0
description:
  - Manages a sandbox session of the managed microVM platform (DigitalOcean Managed Agents / Harness Runtime)
    or of the local control plane, addressed by its name.
  - The session is created from a flat environment spec (name, O(agent), O(template), O(size), O(idle_timeout),
    O(persistent_workspace), O(repos), O(env), O(secrets), O(egress)), sent as YAML, the form the platform documents
    for it; the platform decodes it strictly.
  - B(What the platform reports back.) The session object carries C(agent_kind), C(idle_timeout_seconds),
    C(workspace_id) and C(resume_on_topoff), so O(agent), O(idle_timeout) and O(persistent_workspace) are compared
    with an existing session, and O(resume_on_topoff) is changed in place when it differs.
    It does B(not) report the template, the size, repos, env, secrets or egress, so those are only used when the
    session is created and a change to them is not detected on an existing session; use O(recreate) with a new name,
    or delete the session, to apply them.
  - When an existing session differs in a reported setting, the module B(fails) and lists the differing fields,
    because running work in a sandbox that is not the one asked for is worse than stopping. Set O(recreate=true) to
    delete and create it again instead (its files are lost).
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
      - The diff shows the session object before and after (status, agent kind, idle timeout, ids, lineage).
notes:
  - While the task waits more than a few seconds (a first create), its action plugin shows what the wait is on as it happens,
    at the default verbosity (the status, the platform's warnings, the seconds so far), and RV(stages) afterwards.
    See the collection's docs/modules.md, "Progress while a task waits".
options:
  name:
    description:
      - Name of the session, unique among live sessions (case-insensitive).
      - 1-64 characters of letters, digits, V(.), V(_) and V(-), starting and ending with a letter or digit.
      - A session id is accepted too, to address an existing session (for example one returned by
        M(microvm.sandbox.session_info)); a session cannot be created under an id.
    type: str
    required: true
  state:
    description:
      - V(present) creates the session if no live session has this name and waits until it is usable.
        A paused session stays paused.
      - V(running) is V(present), and resumes the session if it is paused.
      - V(paused) is V(present), then pauses the session if it is running.
      - V(absent) deletes the session and waits until it is gone; FAILED sessions of that name (or that id) are
        deleted too, so their records go.
    type: str
    choices: [present, running, paused, absent]
    default: present
  agent:
    description:
      - The adapter (the spec's C(agent) field), which selects what runs in the sandbox. The documented adapters are
        V(codex), V(claude-code), V(opencode), V(hermes), V(langgraph), V(codex-agentapi) and V(custom)
        (U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/concepts/agent-adapters/)).
      - The default V(custom) is a bare sandbox that runs your own code. The Agent Adapters page describes it as
        running "a container image you supply", and the platform base template V(sandbox) "carries no agent"
        (U(https://docs.digitalocean.com/reference/doctl/reference/harness-runtime/template/create/)). This collection
        drives the sandbox itself over its guest agent, so it needs no coding agent.
      - Compared with the existing session's C(agent_kind).
      - The local control plane runs V(custom) only.
    type: str
    default: custom
  template:
    description:
      - Template (by name) the sandbox boots from. The platform's default for the adapter when not set.
      - Used when the session is created only; the platform does not report it back.
    type: str
  size:
    description:
      - Size slug of the sandbox, such as V(mars-2vcpu-4gb). M(microvm.sandbox.size_info) lists the slugs the platform
        offers; the platform's default size when not set.
      - Used when the session is created only; the platform does not report it back.
    type: str
  idle_timeout:
    description:
      - Idle time after which the platform pauses the session, in seconds or as a duration such as V(600s),
        V(10m) or V(1h30m).
      - Compared with the existing session's C(idle_timeout_seconds) when set.
    type: str
  persistent_workspace:
    description:
      - Keep C(/workspace) as a persistent workspace, saved when the session is removed (the spec's
        C(persistent_workspace)). The session then reports a C(workspace_id).
      - The platform does not offer fork and rollback for a session that has a workspace.
      - Compared with the existing session (whether it has a C(workspace_id)) when set.
    type: bool
  keep_warm:
    description:
      - The spec's C(keep_warm)
        (U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/reference/environment-spec/)),
        reported back on the session. On the local control plane, a V(true) create keeps sandboxes of its template
        and size booted ahead, and a later one is served from them in milliseconds (see docs/localplane.md).
      - Compared with the existing session when set.
    type: bool
  config_id:
    description:
      - Create the session from a saved Environment Config instead of a spec (the JSON create form
        C({name, config_id})), for example the C(id) of the RV(microvm.sandbox.environment_config#module:config)
        M(microvm.sandbox.environment_config) returns, or the C(config_id) another session reports.
      - The spec options (O(template), O(size), O(idle_timeout), O(persistent_workspace), O(keep_warm), O(repos),
        O(env), O(secrets), O(egress)) come from the config and cannot be given with it; the adapter is the config's,
        so O(agent) is not compared.
      - Compared with the existing session's C(config_id).
    type: str
  workspace_id:
    description:
      - Attach this persistent workspace (M(microvm.sandbox.persistent_workspace)) as the session's C(/workspace).
        A workspace is attached only to a session created from a saved config, so O(config_id) is required; one
        session holds a workspace at a time, and removing the session saves its files.
      - Compared with the existing session's C(workspace_id).
    type: str
  repos:
    description:
      - GitHub repositories, as C(owner/repo), that the platform clones into the sandbox when the session starts (the
        spec's C(repos), shown in the Refactor a Repository example,
        U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/examples/refactor-a-repository/)).
      - Private repositories need your team's GitHub connection (C(doctl harness-runtime auth github)), and the hosts
        must be reachable through O(egress) when it is restricted.
      - Used when the session is created only; the platform does not report it back.
      - The local control plane has no network to clone from and refuses a session with repositories (naming them);
        put the code into the sandbox with M(microvm.sandbox.sync) there instead.
    type: list
    elements: str
  permissions:
    description:
      - The spec's permission policy, which decides what the sandbox's agent may do without asking, what waits for
        a person's approval and what is refused
        (U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/concepts/permissions/)).
      - An omitted O(permissions.default) resolves to V(ask) on the platform, so a command can be held for approval;
        a command nobody approves ends rejected (C(hitl_rejected)), and a task that ran it fails naming this setting.
        A sandbox driven by Ansible has nobody to approve, so give it V(allow) (or rules that allow what its tasks
        run).
      - Used when the session is created only; the platform does not report it back.
    type: dict
    suboptions:
      default:
        description: The decision for any action no rule matches.
        type: str
        choices: [allow, ask, deny]
      rules:
        description:
          - Rules as the Permission Policies page writes them, each with an C(action) of V(allow), V(ask) or V(deny).
          - Passed as given.
        type: list
        elements: dict
  resume_on_topoff:
    description:
      - Let the platform resume the session automatically once the team's prepayment balance is topped off after a
        low-balance pause (only a session paused for low balance whose last run was unfinished is resumed).
      - Sent as the create call's C(resume_on_topoff) query parameter
        (U(https://docs.digitalocean.com/reference/dots/reference/harness-runtime/harness-create-session/)). The
        session reports it, so an existing session that differs is updated in place (C(PATCH), the platform's one
        patchable setting, U(https://docs.digitalocean.com/reference/pydo/reference/harness/update_session/)); no
        recreate.
      - It is per session, and forks never inherit it. Not set leaves it as it is (off for a new session).
    type: bool
  env:
    description:
      - Environment variables of the sandbox, used when it is created.
      - The platform keeps them verbatim in the saved spec and shows them in API responses. Put credentials into
        O(secrets) instead; the module warns when a key here looks like a secret.
      - Values are strings, numbers or booleans (V(true) becomes C(true)); a list, a mapping or null fails the task
        naming the variable.
    type: dict
  secrets:
    description:
      - Environment variables whose values are credentials, sent as the spec's C(secrets) when the session is created.
      - The platform holds them in a managed secret store; they are readable inside the sandbox but never shown in
        API responses (U(https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/concepts/secrets/)).
        Ansible also hides the values in the module's output.
      - The former name O(secret_env) is an alias; its values now go to C(secrets), not to C(env).
      - A variable may be set in O(env) or in O(secrets), not in both.
    type: dict
    aliases: [secret_env]
  egress:
    description:
      - Hosts the sandbox may reach; everything else is denied.
      - Not set, or V([unrestricted]), leaves egress open.
      - When the control plane refuses a host (the local plane refuses one that does not resolve, naming it), the
        task fails with the plane's message.
    type: list
    elements: str
  recreate:
    description:
      - When the existing session differs in O(agent), O(idle_timeout) or O(persistent_workspace), delete it and create
        a new one with the same name instead of failing. Its sandbox and files are lost.
    type: bool
    default: false
  wait:
    description:
      - Wait until the session reaches the state asked for (usable, paused or gone), up to O(wait_timeout) seconds.
      - With V(false), the module returns as soon as the platform accepted the call. V(paused) and V(running) still
        wait for a new session to become usable before they pause it, since the platform refuses that earlier.
    type: bool
    default: true
seealso:
  - module: microvm.sandbox.session_info
  - module: microvm.sandbox.session_fork
  - module: microvm.sandbox.size_info
  - module: microvm.sandbox.checkpoint
  - plugin: microvm.sandbox.sessions
    plugin_type: inventory
  - name: Environment Spec Reference
    description: The fields of the spec the session is created from.
    link: https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/reference/environment-spec/
"""

EXAMPLES = r"""
- name: A sandbox for the CI job, created once and reused by later runs
  microvm.sandbox.session:
    name: ci-job-42
    template: python-3-12
    size: mars-2vcpu-4gb
    idle_timeout: 15m
    env:
      LOG_LEVEL: debug
    secrets:
      PACKAGE_INDEX_TOKEN: "{{ package_index_token }}"
    egress:
      - packages.example.com
      - files.example.com
    permissions:
      default: allow  # omitted, the platform's default is ask: each command waits for a person's approval
  register: sandbox

- name: A sandbox with a repository cloned in, resumed on its own after a low-balance pause
  microvm.sandbox.session:
    name: checkout-refactor
    size: mars-4vcpu-8gb
    repos:
      - your-org/your-service
    egress:
      - github.com
      - api.github.com
    resume_on_topoff: true
    permissions:
      default: allow

- name: Pause it while nothing runs
  microvm.sandbox.session:
    name: ci-job-42
    state: paused
    permissions:
      default: allow  # used only if this task creates the session

- name: Resume it
  microvm.sandbox.session:
    name: ci-job-42
    state: running
    permissions:
      default: allow

- name: Recreate it with a shorter idle timeout
  microvm.sandbox.session:
    name: ci-job-42
    idle_timeout: 5m
    recreate: true
    permissions:
      default: allow

- name: Delete it
  microvm.sandbox.session:
    name: ci-job-42
    state: absent

- name: Set the API options once for every module of the collection
  module_defaults:
    group/microvm.sandbox.api:
      api_url: "{{ lookup('ansible.builtin.env', 'DO_AGENTS_API_URL') }}"
      wait_timeout: 120
  block:
    - name: Create
      microvm.sandbox.session:
        name: scratch
        permissions:
          default: allow

    - name: Delete
      microvm.sandbox.session:
        name: scratch
        state: absent
"""

RETURN = r"""
session:
  description:
    - The session as the platform reports it after the task.
    - In check mode, the expected result. A session that would be created has its name, status, agent kind, idle
      timeout and empty lineage, but no C(session_id), C(sandbox_id) or times, since the platform assigns them; use
      the name to address it (C(ansible_host) may be the name), or guard on C(session_id is defined).
    - For O(state=absent), the session as last seen, or empty when there was none.
    - The platform reports neither the template, the size, repos, env, secrets nor egress of a session.
  returned: always
  type: dict
  contains:
    session_id:
      description: Id of the session.
      type: str
      sample: 2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1
    name:
      description: Name of the session.
      type: str
      sample: ci-job-42
    status:
      description: Status, one of C(SESSION_STATUS_PROVISIONING), C(SESSION_STATUS_READY), C(SESSION_STATUS_DETACHED),
        C(SESSION_STATUS_PAUSED), C(SESSION_STATUS_DESTROYING), C(SESSION_STATUS_DESTROYED), C(SESSION_STATUS_FAILED).
      type: str
      sample: SESSION_STATUS_READY
    agent_kind:
      description: The adapter, as an enum such as C(AGENT_KIND_CUSTOM).
      type: str
    sandbox_id:
      description: Id of the sandbox (empty until allocated; changes on rollback).
      type: str
    idle_timeout_seconds:
      description: Idle timeout in seconds.
      type: int
    pause_reason:
      description: Why the session is paused (C(manual), C(idle), C(low_balance), or a newer value); empty unless
        paused.
      type: str
    parent_session_id:
      description: The session this one was forked from (empty otherwise).
      type: str
    fork_id:
      description: Id shared by the sessions of one fork call (empty otherwise).
      type: str
    fork_from_checkpoint_id:
      description: The checkpoint this session was forked from (empty otherwise).
      type: str
    workspace_id:
      description: Id of the persistent workspace (empty without one).
      type: str
    config_id:
      description: Id of the Environment Config the session was created from.
      type: str
    region:
      description: Region of the sandbox.
      type: str
    keep_warm:
      description: Whether the platform keeps the sandbox warm.
      type: bool
    resume_on_topoff:
      description: Whether the platform resumes the session on its own after a low-balance pause once the balance
        is topped off.
      type: bool
    warnings:
      description: The platform's warnings about the session (the local control plane also says here why a
        C(FAILED) session failed; the session object has no error text).
      type: list
      elements: str
    created_at:
      description: Creation time.
      type: str
    last_event_at:
      description: Time of the last event.
      type: str
  sample:
    session_id: 2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1
    name: ci-job-42
    status: SESSION_STATUS_READY
    agent_kind: AGENT_KIND_CUSTOM
    idle_timeout_seconds: 900
    workspace_id: ""
created:
  description:
    - Whether this task created the session (also with O(recreate)); in check mode, whether it would.
    - The callback plugin P(microvm.sandbox.cleanup#callback) deletes the sessions that tasks report as created.
  returned: always
  type: bool
  sample: true
stages:
  description:
    - What the task did and waited on, in order, with the seconds each took (to a tenth); the call C(create),
      C(delete), C(pause) or C(resume), then each status the session passed on the way (for example C(PROVISIONING))
      until the one waited for. Empty when the task changed nothing and waited on nothing (and in check mode).
    - While the task runs, a wait longer than a few seconds is also shown as it happens (see the notes).
  returned: always
  type: list
  elements: dict
  sample: [{"stage": "create", "seconds": 0.2}, {"stage": "PROVISIONING", "seconds": 41.3}]
"""

from typing import Any, Callable, Collection  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import profile  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import (  # noqa: E402
    api_argument_spec, describe_error, parse_duration, run_api_module)
from ansible_collections.microvm.sandbox.plugins.module_utils.progress import Timeline  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, WaitTimeout  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.views import agent_kind, same_adapter, session_view, status_of  # noqa: E402

SECRET_LOOKING_KEY = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY", "PRIVATE_KEY", "CREDENTIAL")
DELETED = "SESSION_STATUS_DESTROYED"


class SessionManager(object):
    """Brings one session to the state a task asks for."""

    def __init__(self, module: AnsibleModule, client: ApiClient) -> None:
        self.module = module
        self.client = client
        self.p = module.params
        self.check = module.check_mode
        self.changed = False
        self.timeout = self.p["wait_timeout"]
        self.last_seen: dict[str, Any] | None = None
        self.created = False
        self.timeline = Timeline()   # the task's calls and waits, returned as `stages`

    # -- the task ----------------------------------------------------------
    def run(self) -> dict[str, Any]:
        existing = self.find()
        before = session_view(existing)
        if self.p["state"] == "absent":
            session = self.absent(existing)
        else:
            session = self.present(existing)
            session = self.settings_in_place(session)
            session = self.to_state(session)
        result = dict(changed=self.changed, session=session or {}, created=self.created, stages=self.timeline.as_list())
        if self.module._diff:
            result["diff"] = dict(before=before, after=session_view(session) if self.p["state"] != "absent" else {})
        return result

    def find(self) -> dict[str, Any] | None:
        session = self.client.find_session(self.p["name"])
        if session is not None and status_of(session) in profile.GONE:
            if self.p["state"] == "absent":
                # A FAILED session still holds its sandbox's records until it is deleted.
                return session if status_of(session) == "FAILED" else None
            self.module.fail_json(
                msg="Session %s (%r) is %s: it cannot be used again. Give a name to create a new session."
                % (session.get("session_id"), session.get("name"), status_of(session)), session=session)
        return session

    # -- present -----------------------------------------------------------
    def present(self, existing: dict[str, Any] | None) -> dict[str, Any]:
        if existing is not None:
            differing = self.differences(existing)
            if not differing:
                return self.settle(existing)
            if not self.p["recreate"]:
                self.module.fail_json(
                    msg="Session %r exists with settings that cannot be changed in place: %s. Set recreate: true to "
                        "delete it and create it again (its files are lost), or change the task to match."
                        % (existing.get("name"), "; ".join(differing)),
                    differing_fields=differing, session=existing)
            self.delete(existing)
        return self.create()

    def differences(self, existing: dict[str, Any]) -> list[str]:
        """'field: is X, wanted Y' for every requested, reported setting the session does not have."""
        wanted = self.wanted_settings()
        out = []
        for field, want in sorted(wanted.items()):
            have = existing.get(field)
            if want is not None and have != want:
                out.append("%s: is %r, wanted %r" % (field, have, want))
        for option in ("config_id", "workspace_id"):
            if self.p[option] and existing.get(option) != self.p[option]:
                out.append("%s: is %r, wanted %r" % (option, existing.get(option) or "", self.p[option]))
        have_kind = existing.get("agent_kind")
        if not self.p["config_id"] and not same_adapter(have_kind, self.p["agent"]):
            out.append("agent_kind: is %r, wanted %r (agent %r)" % (have_kind, agent_kind(self.p["agent"]), self.p["agent"]))
        if self.p["persistent_workspace"] is not None and bool(existing.get("workspace_id")) != self.p["persistent_workspace"]:
            out.append("persistent_workspace: is %r (workspace_id %r), wanted %r" % (
                bool(existing.get("workspace_id")), existing.get("workspace_id") or "", self.p["persistent_workspace"]))
        return out

    def wanted_settings(self) -> dict[str, Any]:
        """Requested settings the platform reports back on the session object, as they appear there."""
        return {"idle_timeout_seconds": self.idle_timeout(), "keep_warm": self.p["keep_warm"]}

    def idle_timeout(self) -> int | None:
        if self.p["idle_timeout"] is None:
            return None
        try:
            return parse_duration(self.p["idle_timeout"])
        except ValueError as e:
            self.module.fail_json(msg="idle_timeout: %s" % e)

    def settings_in_place(self, session: dict[str, Any]) -> dict[str, Any]:
        """resume_on_topoff is reported and patchable: set it on the existing session when it differs."""
        want = self.p["resume_on_topoff"]
        if want is None or bool(session.get("resume_on_topoff")) == want:
            return session
        self.changed = True
        if self.check:
            return dict(session, resume_on_topoff=want)
        return self.client.update_session(session["session_id"], want)

    def create(self) -> dict[str, Any]:
        problem = profile.session_name_problem(self.p["name"])
        if problem:
            self.module.fail_json(msg="Cannot create a session named %r: %s. No live session has that name or id."
                                  % (self.p["name"], problem))
        self.warn_about_secret_looking_env()
        spec = self.create_spec()
        self.changed = True
        self.created = True
        if self.check:
            return self.predicted()
        self.timeline.mark("create")
        if self.p["config_id"]:
            session = self.client.create_session_from_config(self.p["name"], self.p["config_id"],
                                                             workspace_id=self.p["workspace_id"],
                                                             resume_on_topoff=self.p["resume_on_topoff"])
        else:
            try:
                session = self.client.create_session(spec, resume_on_topoff=self.p["resume_on_topoff"])
            except ApiError as e:
                self.fail_on_size(e)
                raise
        for warning in session.get("warnings") or []:
            self.module.warn("platform: %s" % warning)
        try:
            return self.settle(session)
        except (ApiError, WaitTimeout) as e:
            # It exists now: say so, so that whoever cleans up after the run (the cleanup callback) knows.
            msg, details = describe_error(e, self.client)
            details.setdefault("session", session)
            self.module.fail_json(msg=msg, created=True, stages=self.timeline.as_list(), **details)

    def fail_on_size(self, error: ApiError) -> None:
        """A create refused for its size: say where the slugs on offer are listed, under the prefix in use."""
        if error.status != 400 or not self.p["size"] or "size" not in (error.server_message or "").lower():
            return
        msg, details = describe_error(error, self.client)
        self.module.fail_json(msg="%s List the sizes on offer with microvm.sandbox.size_info (%s) and set size to "
                                  "one of their slugs, or leave it out for the platform's default."
                                  % (msg, self.client.sizes_route()), **details)

    def predicted(self) -> dict[str, Any]:
        """The session check mode expects: what can be known before the platform creates it, and nothing made up.

        The ids, times and workspace id exist only once it is created, so they are absent (a task that needs the id
        in check mode must guard on it, see the README); a new session is no fork and not paused.
        """
        predicted = dict((k, v) for k, v in self.wanted_settings().items() if v is not None)
        predicted.update(name=self.p["name"], status="SESSION_STATUS_READY", agent_kind=agent_kind(self.p["agent"]),
                         resume_on_topoff=bool(self.p["resume_on_topoff"]), pause_reason="", parent_session_id="",
                         fork_id="", fork_from_checkpoint_id="")
        if self.p["persistent_workspace"] is False:
            predicted["workspace_id"] = ""
        if self.p["config_id"]:
            predicted["config_id"] = self.p["config_id"]
            if self.p["workspace_id"]:
                predicted["workspace_id"] = self.p["workspace_id"]
        return predicted

    def create_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": self.p["name"], "agent": self.p["agent"]}
        for option, field in (("template", "template"), ("size", "size"),
                              ("persistent_workspace", "persistent_workspace"), ("keep_warm", "keep_warm")):
            if self.p[option] is not None:
                spec[field] = self.p[option]
        idle_timeout = self.idle_timeout()
        if idle_timeout is not None:
            spec["idle_timeout"] = "%ds" % idle_timeout
        env = dict((str(k), env_string(v)) for k, v in (self.p["env"] or {}).items())
        secrets = dict((str(k), env_string(v)) for k, v in (self.p["secrets"] or {}).items())
        both = sorted(set(env) & set(secrets))
        if both:
            self.module.fail_json(msg="%s set in both env and secrets: give each variable once (credentials belong "
                                      "in secrets, which the platform never shows back)" % ", ".join(both))
        if self.p["repos"]:
            spec["repos"] = list(self.p["repos"])
        permissions = dict((k, v) for k, v in (self.p["permissions"] or {}).items() if v is not None)
        if permissions:
            spec["permissions"] = permissions
        if env:
            spec["env"] = env
        if secrets:
            spec["secrets"] = secrets
        egress = self.p["egress"]
        if egress:
            spec["egress"] = "unrestricted" if egress == ["unrestricted"] else list(egress)
        return spec

    def warn_about_secret_looking_env(self) -> None:
        for key in sorted(self.p["env"] or {}):
            if any(word in str(key).upper() for word in SECRET_LOOKING_KEY):
                self.module.warn("env key %r looks like a secret: pass it in secrets, which the platform keeps in its "
                                 "secret store and never shows back" % key)

    def settle(self, session: dict[str, Any], need_usable: bool = False) -> dict[str, Any]:
        """Wait for a provisioning session to become usable when the task waits (or must)."""
        if status_of(session) == "PROVISIONING" and (self.p["wait"] or need_usable) and not self.check:
            return self.client.wait_session(session["session_id"], until=profile.USABLE, timeout=self.timeout,
                                            observe=self.watch(profile.USABLE))
        return session

    def watch(self, until: Collection[str]) -> Callable[[str], None]:
        """An observer of a wait: each status on the way is a stage; reaching one of `until` ends the last."""
        def observe(status: str) -> None:
            if status in until:
                self.timeline.end()
            else:
                self.timeline.mark(status)
        return observe

    # -- running / paused --------------------------------------------------
    def to_state(self, session: dict[str, Any]) -> dict[str, Any]:
        state = self.p["state"]
        status = status_of(session)
        if state == "running" and status == "PAUSED":
            return self.transition(session, self.client.resume_session, profile.USABLE, "SESSION_STATUS_READY")
        if state == "paused" and status != "PAUSED":
            session = self.settle(session, need_usable=True)
            return self.transition(session, self.client.pause_session, frozenset(["PAUSED"]), "SESSION_STATUS_PAUSED")
        return session

    def transition(self, session: dict[str, Any], call: Callable[[str], Any], until: Collection[str],
                   predicted_status: str) -> dict[str, Any]:
        self.changed = True
        if self.check:
            return dict(session, status=predicted_status)
        self.timeline.mark(getattr(call, "__name__", "call").replace("_session", ""))   # pause / resume
        call(session["session_id"])
        if not self.p["wait"]:
            self.timeline.end()
            return self.client.get_session(session["session_id"])
        return self.client.wait_session(session["session_id"], until=until, timeout=self.timeout,
                                        observe=self.watch(until))

    # -- absent ------------------------------------------------------------
    def absent(self, existing: dict[str, Any] | None) -> dict[str, Any] | None:
        doomed = [existing] if existing is not None else []
        doomed += [s for s in self.failed_by_name() if existing is None or s["session_id"] != existing["session_id"]]
        for session in doomed:
            self.delete(session)
        return self.last_seen

    def failed_by_name(self) -> list[dict[str, Any]]:
        """FAILED sessions of this name: the API's name filter matches live sessions only."""
        return self.client.sessions_named(self.p["name"], status=profile.STATUS_PREFIX + "FAILED")

    def delete(self, session: dict[str, Any]) -> None:
        self.changed = True
        self.last_seen = dict(session, status=DELETED)
        if self.check:
            return
        self.timeline.mark("delete")
        try:
            self.client.delete_session(session["session_id"])
        except ApiError as e:
            if not e.gone:
                raise
            return  # someone else deleted it in between: the goal is reached
        if self.p["wait"] or self.p["state"] != "absent":
            # A recreate must wait: the name stays taken until the old session is gone.
            gone = self.client.wait_session(session["session_id"], until=frozenset(["DESTROYED"]),
                                            timeout=self.timeout, gone_ok=True, observe=self.watch(["DESTROYED"]))
        else:
            gone = self.client.find_session(session["session_id"])  # most likely DESTROYING
        if gone is not None:
            self.last_seen = gone


def env_string(value: Any) -> str:
    """The platform takes strings only; YAML booleans become 'true'/'false', not Python's 'True'."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


SPEC_OPTIONS = ("template", "size", "idle_timeout", "persistent_workspace", "keep_warm", "repos", "env", "secrets",
                "egress")


def main() -> None:
    module = AnsibleModule(
        argument_spec=api_argument_spec(
            name=dict(type="str", required=True),
            state=dict(type="str", default="present", choices=["present", "running", "paused", "absent"]),
            agent=dict(type="str", default=profile.DEFAULT_AGENT),
            template=dict(type="str"),
            size=dict(type="str"),
            idle_timeout=dict(type="str"),
            persistent_workspace=dict(type="bool"),
            keep_warm=dict(type="bool"),
            config_id=dict(type="str"),
            workspace_id=dict(type="str"),
            repos=dict(type="list", elements="str"),
            permissions=dict(type="dict", options=dict(
                default=dict(type="str", choices=list(profile.PERMISSION_DECISIONS)),
                rules=dict(type="list", elements="dict"),
            )),
            resume_on_topoff=dict(type="bool"),
            env=dict(type="dict"),
            secrets=dict(type="dict", no_log=True, aliases=["secret_env"]),
            egress=dict(type="list", elements="str"),
            recreate=dict(type="bool", default=False),
            wait=dict(type="bool", default=True),
        ),
        # A session from a saved config takes its spec from the config; a workspace attaches only that way.
        mutually_exclusive=[("config_id", option) for option in SPEC_OPTIONS],
        required_by={"workspace_id": "config_id"},
        supports_check_mode=True,
    )
    run_api_module(module, lambda client: SessionManager(module, client).run())


if __name__ == "__main__":
    main()
