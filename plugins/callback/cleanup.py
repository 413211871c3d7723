# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
name: cleanup
type: aggregate
short_description: Delete the sandbox sessions a run created when it ends, fails or is interrupted
version_added: 0.1.0
description:
  - Remembers every session that a task of the run reports as created (M(microvm.sandbox.session) with
    RV(microvm.sandbox.session#module:created), M(microvm.sandbox.session_fork) with
    RV(microvm.sandbox.session_fork#module:created)), and deletes them when the playbook ends (its recap), also when
    every host of a play failed or was unreachable (ansible-playbook then skips the later plays, cleanup plays
    included), and when the run is interrupted (Ctrl-C, SIGINT) or terminated (SIGTERM, as CI runners cancel a job).
  - Like Molecule's destroy step for a test run. Enable it for runs whose sessions are throwaway (CI jobs, tests).
    Sessions the run found already existing (a kept session, resumed) are never touched, nor sessions created
    outside the run.
  - The run still reports its failure; the callback changes no task result and no exit code.
  - B(Limits.) Only what a task reported is known. A task killed while its create call is in flight, a
    C(SIGKILL) of ansible-playbook or a lost controller leave the session running (a session's
    O(microvm.sandbox.session#module:idle_timeout) then pauses it; it does not delete it). Deletion uses this plugin's
    O(api_token) (by default E(DO_AGENTS_API_TOKEN)), so a session created with another token passed as a module
    option is only reported. Anything that could not be deleted is named in a warning, with the command to delete it.
  - Enable it with C(callbacks_enabled = microvm.sandbox.cleanup) in C(ansible.cfg) (section C([defaults])), or
    E(ANSIBLE_CALLBACKS_ENABLED=microvm.sandbox.cleanup).
author:
  - microvm.sandbox maintainers (@microvm)
requirements:
  - enable in configuration
extends_documentation_fragment:
  - microvm.sandbox.api.plugin
options:
  when:
    description:
      - V(always) deletes the created sessions at the end of every run.
      - V(failure) deletes them only when the run failed (a task failed and was not rescued, or a host was
        unreachable) or was interrupted, and keeps them after a successful run, for example to keep the session
        that the playbook C(microvm.sandbox.provision) prepared, when it was prepared completely.
    type: str
    choices: [always, failure]
    default: always
    env:
      - name: MICROVM_CLEANUP_WHEN
    ini:
      - section: microvm_cleanup
        key: when
  wait_timeout:
    description:
      - Seconds to wait, per session, until a deleted session is gone (C(DESTROYED)); 0 sends the deletions without
        waiting.
    type: int
    default: 120
    env:
      - name: MICROVM_CLEANUP_WAIT_TIMEOUT
    ini:
      - section: microvm_cleanup
        key: wait_timeout
notes:
  - The sessions are deleted on the control plane the creating task used (its O(microvm.sandbox.session#module:api_url)
    and O(microvm.sandbox.session#module:route_prefix)), with this plugin's token.
seealso:
  - name: Playbooks, "Nothing left running"
    description: The guarantee, its limits and the patterns that hold across plays.
    link: https://github.com/microvm/sandbox/blob/main/docs/playbooks.md
"""

import atexit  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import typing as t  # noqa: E402

from ansible.plugins.callback import CallbackBase  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, WaitTimeout  # noqa: E402

SESSION_ACTIONS = frozenset(["microvm.sandbox.session", "microvm.sandbox.session_fork"])


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "microvm.sandbox.cleanup"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args: t.Any, **kwargs: t.Any) -> None:
        super(CallbackModule, self).__init__(*args, **kwargs)
        # session_id -> (name, api_url, route_prefix), in the order they were created
        self.created: dict[str, tuple[str, str | None, str | None]] = {}
        self.done = False
        self._pid = os.getpid()
        self._previous_sigterm: t.Any = None
        self._registered = False

    # -- recording ---------------------------------------------------------
    def v2_playbook_on_start(self, playbook: t.Any) -> None:
        self.done = False
        if not self._registered:
            self._registered = True
            atexit.register(self._at_exit)
        previous = signal.getsignal(signal.SIGTERM)
        if previous != self._on_sigterm:
            self._previous_sigterm = previous
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def v2_runner_on_ok(self, result: t.Any) -> None:
        self._record(result)

    def v2_runner_on_failed(self, result: t.Any, ignore_errors: bool = False) -> None:
        self._record(result)

    def v2_runner_item_on_ok(self, result: t.Any) -> None:
        self._record(result)

    def v2_runner_item_on_failed(self, result: t.Any) -> None:
        self._record(result)

    def _record(self, result: t.Any) -> None:
        task = result._task
        action = getattr(task, "resolved_action", None) or task.action
        if action not in SESSION_ACTIONS:
            return
        res = result.result  # ansible-core 2.19+: the task's result, as native types
        if res.get("results"):  # a loop's summary: its items were recorded one by one
            return
        args = (res.get("invocation") or {}).get("module_args") or {}
        where = (args.get("api_url") or None, args.get("route_prefix") or None)
        for session in created_sessions(action, res):
            self.created.setdefault(session["session_id"], (session.get("name") or "",) + where)

    # -- the end -----------------------------------------------------------
    def v2_playbook_on_stats(self, stats: t.Any) -> None:
        failed = any(stats.failures.get(h) or stats.dark.get(h) for h in stats.processed)
        self._cleanup("failed" if failed else "ended")

    def _at_exit(self) -> None:
        # Interrupted (SIGINT: the CLI exits without a recap) or ended some other way before the recap.
        if os.getpid() == self._pid and not self.done:
            self._cleanup("was interrupted")

    def _on_sigterm(self, signum: int, frame: t.Any) -> None:
        if os.getpid() == self._pid:
            self._cleanup("was terminated")
        previous = self._previous_sigterm
        if callable(previous):
            previous(signum, frame)  # ansible's own: stops the workers, then the process
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _cleanup(self, how: str) -> None:
        self.done = True
        if self.get_option("when") == "failure" and how == "ended":
            if self.created:
                self._display.display("microvm.sandbox.cleanup: the run succeeded; keeping the %d session(s) it "
                                      "created (when=failure): %s" % (len(self.created), self._names(self.created)))
            self.created = {}
            return
        doomed, self.created = self.created, {}
        if not doomed:
            return
        left = {}
        for session_id, (name, api_url, prefix) in doomed.items():
            problem = self._delete(session_id, api_url, prefix)
            if problem:
                left[session_id] = (name, problem)
        deleted = dict((k, v) for k, v in doomed.items() if k not in left)
        if deleted:
            self._display.display("microvm.sandbox.cleanup: the run %s; deleted the %d session(s) it created: %s"
                                  % (how, len(deleted), self._names(deleted)))
        for session_id, (name, problem) in sorted(left.items()):
            self._display.warning(
                "microvm.sandbox.cleanup: session %s (%s), created by this run, may still be running: %s. Delete it "
                "with the task microvm.sandbox.session name=%s state=absent, or microvm.sandbox.teardown."
                % (name or "-", session_id, problem, session_id))

    @staticmethod
    def _names(sessions: dict) -> str:
        return ", ".join(v[0] or k for k, v in sessions.items())

    def _client(self, api_url: str | None, prefix: str | None) -> ApiClient:
        return ApiClient(api_url=api_url or self.get_option("api_url"), api_token=self.get_option("api_token"),
                         prefix=prefix or self.get_option("route_prefix"), timeout=self.get_option("request_timeout"),
                         validate_certs=self.get_option("validate_certs"))

    def _delete(self, session_id: str, api_url: str | None, prefix: str | None) -> str | None:
        """Delete one session and wait until it is gone -> None, or what went wrong (never the token)."""
        try:
            client = self._client(api_url, prefix)
            try:
                client.delete_session(session_id)
            except ApiError as e:
                if e.gone:
                    return None  # deleted by the run itself, or by someone else: the goal is reached
                raise
            timeout = self.get_option("wait_timeout")
            if timeout > 0:
                client.wait_session(session_id, until=frozenset(["DESTROYED"]), timeout=timeout, gone_ok=True)
            return None
        except (ApiError, WaitTimeout) as e:
            return str(e)


def created_sessions(action: str, result: t.Mapping[str, t.Any]) -> list[dict]:
    """The sessions (with an id) that one task result says it created; check mode predicts no ids."""
    if action == "microvm.sandbox.session":
        session = result.get("session") or {}
        return [session] if result.get("created") and session.get("session_id") else []
    names = set(result.get("created") or [])
    return [s for s in result.get("sessions") or [] if s.get("session_id") and s.get("name") in names]
