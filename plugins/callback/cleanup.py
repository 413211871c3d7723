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
  - B(Molecule.) With O(molecule) the callback serves a Molecule scenario whose sessions
    C(microvm.sandbox.molecule_create) starts. Molecule runs no destroy when Ctrl-C interrupts it, in any step, so
    the playbook Molecule was running when interrupted (create, prepare, converge, idempotence, side_effect, verify,
    cleanup, destroy) deletes every session of the scenario itself. The scenario's C(ansible.cfg) enables it (the
    scenarios of this collection do it in C(extensions/molecule/config.yml); see C(docs/molecule.md)).
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
  molecule:
    description:
      - The run is one step of a Molecule scenario whose sessions C(microvm.sandbox.molecule_create) starts, and
        Molecule's destroy step owns them. A run that ends, successful or failed, deletes nothing (O(when) does not
        apply), so the sessions of C(molecule create) stay for C(molecule converge) and for C(--destroy=never).
      - When the run is interrupted (SIGINT, Ctrl-C) or terminated (SIGTERM), the callback deletes every session of
        the scenario, not only the ones this run created - the sessions named in the ledger of
        C(microvm.sandbox.molecule_create) (C(microvm_sandbox_sessions.yml) in E(MOLECULE_EPHEMERAL_DIRECTORY)) and
        in Molecule's instance config (E(MOLECULE_INSTANCE_CONFIG)), which Molecule sets for every playbook it runs.
        It then does what Molecule's destroy would have done; it empties the instance config, removes the ledger and
        marks the scenario not created in Molecule's state (E(MOLECULE_STATE_FILE)) - so the next
        C(molecule converge) creates fresh sessions. A session it could not delete stays in the ledger, for the next
        C(molecule destroy).
      - A session a create call was starting when the run was interrupted is found by its name, recorded in the ledger
        before the call.
    type: bool
    default: false
    env:
      - name: MICROVM_CLEANUP_MOLECULE
    ini:
      - section: microvm_cleanup
        key: molecule
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
import tempfile  # noqa: E402
import time  # noqa: E402
import typing as t  # noqa: E402

import yaml  # noqa: E402
from ansible.plugins.callback import CallbackBase  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, WaitTimeout  # noqa: E402

SESSION_ACTIONS = frozenset(["microvm.sandbox.session", "microvm.sandbox.session_fork"])
# playbooks/molecule_create.yml writes it (microvm_molecule_ledger), playbooks/molecule_destroy.yml removes it
MOLECULE_LEDGER = "microvm_sandbox_sessions.yml"
# A create call in flight when the run was interrupted reaches the platform after the first look: look once more.
MOLECULE_SECOND_LOOK = 2.0
INTERRUPTED = ("was interrupted", "was terminated")

Where = t.Tuple[t.Optional[str], t.Optional[str]]  # (api_url, route_prefix) of the creating task; None: this plugin's


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
        molecule = self.get_option("molecule")
        if how not in INTERRUPTED and (molecule or (self.get_option("when") == "failure" and how == "ended")):
            if self.created:
                why = "Molecule's destroy deletes them" if molecule else "when=failure"
                self._say("microvm.sandbox.cleanup: the run %s; keeping the %d session(s) it created (%s): %s"
                          % ("succeeded" if how == "ended" else how, len(self.created), why,
                             self._names(self.created)))
            self.created = {}
            return
        doomed, self.created = self.created, {}
        scenario = MoleculeScenario.from_env(os.environ) if molecule and how in INTERRUPTED else None
        if not doomed and scenario is None:
            return
        # A second Ctrl-C (ansible-playbook's own handler restored the default one at the first) must not stop the
        # deletions half-way: every request is bounded by request_timeout; the wait below may be interrupted.
        previous_sigint = signal.getsignal(signal.SIGINT)
        if how == "was interrupted":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            left: dict[str, tuple[str, str]] = {}
            sent: dict[str, tuple[str, str | None, str | None]] = {}
            for session_id, (name, api_url, prefix) in doomed.items():
                problem = self._send_delete(session_id, api_url, prefix)
                if problem:
                    left[session_id] = (name, problem)
                else:
                    sent[session_id] = (name, api_url, prefix)
            unresolved: list[str] = []
            if scenario is not None:
                unresolved = self._delete_molecule(scenario, sent, left)
        finally:
            if how == "was interrupted" and previous_sigint is not None:
                signal.signal(signal.SIGINT, previous_sigint)
        for session_id, (name, api_url, prefix) in sent.items():
            problem = self._wait_gone(session_id, api_url, prefix)
            if problem:
                left[session_id] = (name, problem)
        deleted = dict((k, v) for k, v in sent.items() if k not in left)
        if deleted:
            whose = "of Molecule scenario %s" % scenario.name if scenario is not None else "it created"
            self._say("microvm.sandbox.cleanup: the run %s; deleted the %d session(s) %s: %s"
                      % (how, len(deleted), whose, self._names(deleted)))
        for session_id, (name, problem) in sorted(left.items()):
            self._warn(
                "microvm.sandbox.cleanup: session %s (%s), created by this run, may still be running: %s. Delete it "
                "with the task microvm.sandbox.session name=%s state=absent, or microvm.sandbox.teardown."
                % (name or "-", session_id, problem, session_id))
        for name in unresolved:
            self._warn("microvm.sandbox.cleanup: could not look up session %s of Molecule scenario %s; it stays in "
                       "the ledger for the next `molecule destroy`." % (name, scenario.name if scenario else "-"))

    def _delete_molecule(self, scenario: MoleculeScenario, sent: dict[str, tuple[str, str | None, str | None]],
                         left: dict[str, tuple[str, str]]) -> list[str]:
        """Delete the live sessions of the scenario's ledger and instance config (by name; a name may also be an id
        in an instance config written by hand); then forget them as Molecule's destroy does -> names not looked up."""
        unresolved: list[str] = []
        found: set[str] = set()
        names = scenario.session_names()
        for attempt in range(2):
            for name in names:
                if name in found or name in unresolved:
                    continue
                try:
                    matches = self._client(None, None).sessions_named(name, live_only=True)
                except ApiError:
                    unresolved.append(name)
                    continue
                for session in matches:
                    found.add(name)
                    session_id = session.get("session_id")
                    if not session_id or session_id in sent or session_id in left:
                        continue
                    problem = self._send_delete(session_id, None, None)
                    if problem:
                        left[session_id] = (name, problem)
                    else:
                        sent[session_id] = (name, None, None)
            if attempt == 0 and [n for n in names if n not in found and n not in unresolved]:
                time.sleep(MOLECULE_SECOND_LOOK)
            else:
                break
        if not left and not unresolved:
            scenario.forget()
        return unresolved

    def _say(self, message: str) -> None:
        # Molecule stops reading the run's output at Ctrl-C: a closed pipe must not stop what follows.
        try:
            self._display.display(message)
        except OSError:
            pass

    def _warn(self, message: str) -> None:
        try:
            self._display.warning(message)
        except OSError:
            pass

    @staticmethod
    def _names(sessions: dict) -> str:
        return ", ".join(v[0] or k for k, v in sessions.items())

    def _client(self, api_url: str | None, prefix: str | None) -> ApiClient:
        return ApiClient(api_url=api_url or self.get_option("api_url"), api_token=self.get_option("api_token"),
                         prefix=prefix or self.get_option("route_prefix"), timeout=self.get_option("request_timeout"),
                         validate_certs=self.get_option("validate_certs"))

    def _send_delete(self, session_id: str, api_url: str | None, prefix: str | None) -> str | None:
        """Ask for one session's deletion -> None (asked, or already gone), or what went wrong (never the token)."""
        try:
            self._client(api_url, prefix).delete_session(session_id)
            return None
        except ApiError as e:
            if e.gone:
                return None  # deleted by the run itself, or by someone else: the goal is reached
            return str(e)

    def _wait_gone(self, session_id: str, api_url: str | None, prefix: str | None) -> str | None:
        """Wait until a deleted session is gone (wait_timeout) -> None, or what went wrong."""
        timeout = self.get_option("wait_timeout")
        if timeout <= 0:
            return None
        try:
            self._client(api_url, prefix).wait_session(session_id, until=frozenset(["DESTROYED"]), timeout=timeout,
                                                       gone_ok=True)
            return None
        except (ApiError, WaitTimeout) as e:
            return str(e)


class MoleculeScenario:
    """The files of one Molecule scenario's run that name its sessions, from the environment Molecule gives every
    playbook: the ledger of microvm.sandbox.molecule_create, Molecule's instance config and its state file."""

    def __init__(self, ephemeral: str, instance_config: str | None, state_file: str | None, name: str) -> None:
        self.ledger = os.path.join(ephemeral, MOLECULE_LEDGER)
        self.instance_config = instance_config
        self.state_file = state_file
        self.name = name

    @classmethod
    def from_env(cls, env: t.Mapping[str, str]) -> MoleculeScenario | None:
        ephemeral = env.get("MOLECULE_EPHEMERAL_DIRECTORY")
        if not ephemeral:
            return None  # not run by Molecule: nothing but the run's own sessions is known
        return cls(ephemeral, env.get("MOLECULE_INSTANCE_CONFIG") or None, env.get("MOLECULE_STATE_FILE") or None,
                   env.get("MOLECULE_SCENARIO_NAME") or os.path.basename(ephemeral))

    def session_names(self) -> list[str]:
        """The names in the ledger, then those of the instance config (entries with `session`), each once."""
        names: list[str] = []
        for entry in _yaml_list(self.ledger):
            if isinstance(entry, dict) and entry.get("name"):
                names.append(str(entry["name"]))
        if self.instance_config:
            for entry in _yaml_list(self.instance_config):
                if isinstance(entry, dict) and entry.get("session"):
                    names.append(str(entry["session"]))
        return list(dict.fromkeys(names))

    def forget(self) -> None:
        """What molecule_destroy and Molecule's destroy step do once the sessions are deleted: no ledger, an empty
        instance config, the scenario not created (else the next `molecule converge` would skip create)."""
        try:
            os.unlink(self.ledger)
        except FileNotFoundError:
            pass
        if self.instance_config and os.path.exists(self.instance_config):
            _write_atomic(self.instance_config, "# Molecule managed\n\n[]\n")
        if self.state_file and os.path.exists(self.state_file):
            with open(self.state_file) as f:
                state = yaml.safe_load(f) or {}
            if isinstance(state, dict):
                state.update(created=False, converged=False, prepared=False)
                _write_atomic(self.state_file, "# Molecule managed\n\n" + yaml.safe_dump(state, explicit_start=True,
                                                                                         default_flow_style=False))


def _yaml_list(path: str) -> list:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return []
    return data if isinstance(data, list) else []


def _write_atomic(path: str, text: str) -> None:
    # Molecule reads these files at its next start: never half-written.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".microvm-cleanup-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def created_sessions(action: str, result: t.Mapping[str, t.Any]) -> list[dict]:
    """The sessions (with an id) that one task result says it created; check mode predicts no ids."""
    if action == "microvm.sandbox.session":
        session = result.get("session") or {}
        return [session] if result.get("created") and session.get("session_id") else []
    names = set(result.get("created") or [])
    return [s for s in result.get("sessions") or [] if s.get("session_id") and s.get("name") in names]
