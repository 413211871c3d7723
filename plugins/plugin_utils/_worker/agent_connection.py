# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The agent connection plugin's code (plugins/connection/agent.py holds its documentation and loads this).

Core loads a collection's plugin file by compiling it from source in every task's worker (3 ms for this
plugin's 1,100 lines); the modules under plugin_utils are compiled once per run (_shared/code_cache.py, core_compat
A8), so the plugin file keeps only what ansible-doc reads and this module has the rest.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from ansible import constants as C
from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import DEFAULT_POOL_SIZE, LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.core_compat import command_argv
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import become_scan
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import command_stream
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import one_shot_become
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import outcomes
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import payload_cache
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import (
    Interact, InteractTimeout, MuxClient, host_tag, run_identity)

if TYPE_CHECKING:
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.sandbox_connection import SandboxConnection

display = Display()
T = TypeVar("T")
LOADED_BY = os.getpid()  # a worker that inherited the plugin loaded (the sessions inventory loads it before the forks)
payload_cache.install()  # module payloads kept across runs (core_compat A10), used once configured

PLUGIN = "microvm.sandbox.agent"  # how the connection names itself in its messages
DEFAULT_REMOTE_TMP = "~/.ansible/tmp"
BECOME_TIMEOUT_DEFAULT = 10  # seconds, core's default for ssh's timeout and local's become_success_timeout
# Tasks whose module runs without the run's TMPDIR: what they make must outlive the run (see _keeps_tmp).
TASKS_KEEPING_TMP = frozenset(["tempfile", "ansible.builtin.tempfile", "ansible.legacy.tempfile"])
DEFAULT_PYTHON_INTERPRETER = "auto_silent"  # for hosts that name none: see Connection.update_vars


# Looks up a guest user for remote_user: prints uid:gid:home (exit 0), "self" when the agent already runs as it,
# exit 1 when there is no such user, 2 when setpriv is missing. $2, when set, is the default remote_tmp,
# made sticky and world-writable like /tmp so that the user can create its temporary directories there.
USER_LOOKUP = r"""
entry=$(getent passwd "$1") || exit 1
[ "$(id -un)" = "$1" ] && { echo self; exit 0; }
command -v setpriv >/dev/null 2>&1 || exit 2
if [ -n "$2" ]; then mkdir -p -- "$2" && chmod 1777 -- "$2" || exit 4; fi
printf '%s:%s:%s\n' "$(echo "$entry" | cut -d: -f3)" "$(echo "$entry" | cut -d: -f4)" "$(echo "$entry" | cut -d: -f6)"
"""


def remote_tmp_for(scratch_dir: str) -> str:
    return posixpath.join(scratch_dir, "ansible-tmp")


def _tmp_op_paths(op: dict[str, Any]) -> list[str]:
    """The guest paths a deferred tmp dir op (core_compat.tmp_op) acts on."""
    if op["op"] == "mkdtemp":
        return [posixpath.join(op["base"], op["name"])]
    return [p.rstrip("/") for p in op.get("paths") or []]


def become_error_message(reason: str, stdout: bytes, stderr: bytes, prompted: list[bool], become: Any = None) -> str:
    """Core's local connection's wording of a become failure, with what the become command printed.

    The password is never in it: it went to the command's stdin, and the guest has no terminal to echo it.
    """
    message = "%s waiting for become success%s." % (reason, "" if prompted else " or become password prompt")
    for title, data in (("Standard Output", stdout), ("Standard Error", stderr)):
        if become is not None:
            data = become.strip_become_prompt(data)
        text = shown(data, text=True).strip()  # the guest's text: no escape sequences onto the user's terminal
        if text:
            message += "\n>>> %s\n%s" % (title, text[-2000:])
    return message


class Connection(ConnectionBase):
    """Tasks in a sandbox session, through the session's multiplexer."""

    transport = "microvm.sandbox.agent"
    has_pipelining = True
    has_tty = False  # the agent gives commands no terminal
    _connected: bool  # set by ConnectionBase

    def __init__(self, play_context: Any, *args: Any, **kwargs: Any) -> None:
        hops.record(hops.target(), "worker", event="init", t=hops.now())
        super().__init__(play_context, *args, **kwargs)
        self._playbook_pid = kwargs.get("ansible_playbook_pid")
        self._mux_client: MuxClient | None = None
        self._run: dict[str, Any] | None = None
        self._user: dict[str, str] | None = None  # the guest user commands run as, once looked up: None = the agent's own user
        self._su_prompts = False  # su was seen to need a password here: it goes straight to interactive stdin
        # task tmp dir commands (the task's mkdtemp, a chmod of the files just put) left for the warm runner to do ahead
        # of the next module, in its request: (the command, its core_compat.tmp_op); any other operation runs them first
        # (_flush_deferred)
        self._deferred: list[tuple[str, dict[str, Any]]] = []
        self._flushing = False
        self._task_action = ""  # the task's action, from the shell's task keys (see _keeps_tmp)
        self._wrap_shell()
        if LOADED_BY != os.getpid():
            display.vvvv("%s: loaded before this worker was forked" % PLUGIN)

    def update_vars(self, variables: dict[str, Any]) -> None:
        """The connection's magic variables, plus a silent interpreter discovery for a host that names no Python.

        A sandbox's Python is whatever its template installed, so discovering it is expected and core's
        warning about it is noise: a host without ansible_python_interpreter, where neither ansible.cfg nor
        ANSIBLE_PYTHON_INTERPRETER sets interpreter_python, gets auto_silent. Anything the user set wins.
        """
        super().update_vars(variables)
        if "ansible_python_interpreter" in variables:
            return
        _value, origin = C.config.get_config_value_and_origin("INTERPRETER_PYTHON", variables=variables)
        if origin == "default":
            variables["ansible_python_interpreter"] = DEFAULT_PYTHON_INTERPRETER

    def set_options(self, task_keys: Any = None, var_options: Any = None, direct: Any = None) -> None:
        super().set_options(task_keys=task_keys, var_options=var_options, direct=direct)
        # core builds the task's module payload after this, in this worker (core_compat A10)
        payload_cache.configure(self.get_option("payload_cache"), note=lambda line: display.vvv(line, host=self._session()))

    # -- options --------------------------------------------------------------------------
    def _session(self) -> str:
        return self.get_option("remote_addr") or self._play_context.remote_addr

    def _scratch_dir(self) -> str:
        return profile.check_scratch_dir(self.get_option("scratch_dir") or profile.SCRATCH_DIR)

    def _run_info(self) -> dict[str, Any]:
        """The run's identity and TMPDIR; shared by every task of one ansible-playbook run."""
        if self._run is None:
            run_id, pid, start = run_identity(self._playbook_pid)
            self._run = {"id": run_id, "pid": pid, "start": start,
                         "dir": posixpath.join(self._scratch_dir(), "run." + run_id)}
        return self._run

    def _wrap_shell(self) -> None:
        """Default remote_tmp under the scratch dir, and put TMPDIR last in every module's environment.

        ansible-core sets the shell's options after the connection's and reads remote_tmp before it
        connects, so the default is applied right after the shell's own set_options (core_compat A5).
        """
        def run_tmpdir() -> dict[str, str]:
            if self._keeps_tmp():
                return {}  # the task's own TMPDIR, if it sets one, or the guest's
            try:
                return {"TMPDIR": self._run_info()["dir"]}
            except (KeyError, profile.TransferPathError):
                return {}  # options not set yet, or a bad scratch dir that _connect reports

        def after_shell_options(task_keys: dict[str, Any]) -> None:
            self._task_action = task_keys.get("action") or ""
            self._default_remote_tmp()

        core_compat.wrap_shell(self._shell, after_shell_options, run_tmpdir, self._own_home_alias)

    def _keeps_tmp(self) -> bool:
        """True for a task whose files belong in the guest's own temporary dir, not in the run's (which goes).

        ansible.builtin.tempfile makes files and directories for later tasks and later runs, as over SSH, where
        they land in /tmp: its module runs without the run's TMPDIR. Everything else keeps the run's TMPDIR.
        """
        return self._task_action in TASKS_KEEPING_TMP

    def _own_home_alias(self, path: str) -> str:
        """'~<connection user>[/...]' as '~[/...]': the connection user's home is the HOME its commands run with.

        ansible-core expands '~' as '~<remote_user>' (`echo ~root`), which reads the guest's passwd file, while
        the agent runs its own user's commands with the platform's HOME (profile.HOME_DIR). Asking the shell for
        plain '~' gives that HOME, so `~` in paths, the async job dir and the modules' HOME agree, whether the
        inventory names the user (ansible_user: root) or not. A become user's '~name' is left to the passwd file,
        which is where sudo and su take HOME from.
        """
        if not path.startswith("~") or path == "~":
            return path
        name, sep, rest = path[1:].partition("/")
        user = self._requested_user() or "root"
        if name != user:
            return path
        if self.become is not None:
            try:
                become_user = self.become.get_option("become_user") or "root"
            except KeyError:
                become_user = "root"
            if become_user == name:
                return path
        return "~" + sep + rest

    def _default_remote_tmp(self) -> None:
        try:
            value, origin = self._shell.get_option_and_origin("remote_tmp")
            scratch = self.get_option("scratch_dir") or profile.SCRATCH_DIR
        except KeyError:
            return
        if origin == "default" or value == DEFAULT_REMOTE_TMP:
            self._shell.set_option("remote_tmp", remote_tmp_for(scratch))

    def _check_paths(self) -> None:
        """The scratch dir must be transferable; remote_tmp may be anywhere (its files are staged like any put)."""
        self._scratch_dir()
        self._default_remote_tmp()

    # -- connecting ------------------------------------------------------------------------
    def _connect(self) -> Connection:
        if self._connected:
            return self
        session = self._session()
        try:
            self._check_paths()
        except profile.TransferPathError as e:
            raise AnsibleError("microvm.sandbox.agent: %s" % e) from e
        cfg = self._session_config(session)
        display.vvv("ESTABLISH MICROVM AGENT CONNECTION to session %s via %s%s" % (session, cfg.api_url, cfg.prefix),
                    host=session)
        self._new_mux_client = lambda: self._make_mux_client(cfg)  # microvm.sandbox.sync opens more connections
        self._mux_client = self._new_mux_client()
        try:
            self._mux_client.connect()
        except OSError as e:
            self._mux_client = None
            raise AnsibleConnectionFailure("microvm.sandbox.agent: cannot reach the multiplexer of session %s: %s"
                                           % (session, e)) from e
        except errors.SandboxError as e:
            self._mux_client = None
            raise outcomes.ansible_error(e, PLUGIN) from e
        self._connected = True
        note = (self._mux_client.attached or {}).get("road_note")
        if note:  # transport auto's choice: the mux gives it to the first task of each run on this session
            display.v(to_text(note), host=session)
        for warning in (self._mux_client.attached or {}).get("tmp_warnings") or []:  # an earlier task's unawaited rm
            display.warning("microvm.sandbox.agent: session %s, an earlier task's tmp dir: %s"
                            % (session, shown(to_text(warning), text=True)))
        self._user = self._lookup_user()
        return self

    def _attached(self) -> MuxClient:
        """The mux client _connect() attached (ansible-core connects before every call that needs it)."""
        if self._mux_client is None:
            raise AnsibleConnectionFailure("%s: the connection to session %s is not open" % (PLUGIN, self._session()))
        return self._mux_client

    def _session_config(self, session: str) -> LinkConfig:
        """The session's settings for the mux, from this connection's options (one object, read once)."""
        token = self.get_option("api_token")
        if not token:
            raise AnsibleConnectionFailure("microvm.sandbox.agent: no API token for session %s: set option api_token "
                                           "(ansible_microvm_api_token) or env %s" % (session, " / ".join(profile.API_TOKEN_ENVS)))
        api_url = self.get_option("api_url") or profile.DEFAULT_API_URL
        problem = (profile.token_destination_problem(api_url, token)
                   or profile.api_url_path_problem(api_url, self.get_option("route_prefix")))
        if problem:
            raise AnsibleConnectionFailure("microvm.sandbox.agent: session %s: %s" % (session, problem))
        return LinkConfig(session=session, token=token, api_url=self.get_option("api_url"),
                          prefix=self.get_option("route_prefix"), agent_port=self.get_option("agent_port"),
                          connect_timeout=self.get_option("connect_timeout"), persist=self.get_option("persist"),
                          scratch_dir=self._scratch_dir(), validate_certs=self.get_option("validate_certs"),
                          host_tag=host_tag(), transport=self.get_option("transport"))

    def _make_mux_client(self, cfg: LinkConfig) -> MuxClient:
        session = cfg.session
        max_output = int(self.get_option("max_output_bytes") or 0)
        if max_output < 0:
            raise AnsibleError("microvm.sandbox.agent: max_output_bytes must be 0 (no limit) or a number of bytes, "
                               "got %d" % max_output)
        return MuxClient(os.path.expanduser(self.get_option("mux_dir")), cfg,
                         pool_size=int(self.get_option("mux_processes") or 0) or DEFAULT_POOL_SIZE,
                         log=lambda msg: display.vvvv(msg, host=session),
                         max_output=max_output, run=self._run_info()["id"])

    # -- the requested user ------------------------------------------------------------------
    def _requested_user(self) -> str | None:
        try:
            user = self.get_option("remote_user")
        except KeyError:
            user = None
        return user or self._play_context.remote_user or None

    def _lookup_user(self) -> dict[str, str] | None:
        """uid, gid and home of the requested guest user (None when it is the agent's own); fails when it is missing.

        Never falls back to the agent's user: a task asked to run as someone must not run as root.
        """
        user = self._requested_user()
        if not user or user == "root":
            return None
        session = self._session()
        remote_tmp = None
        try:
            remote_tmp = self._shell.get_option("remote_tmp")
        except KeyError:
            pass
        shared_tmp = remote_tmp if remote_tmp == remote_tmp_for(self._scratch_dir()) else ""
        rc, stdout, stderr, _info = self._call("the user lookup", self._attached().exec, ["/bin/sh", "-c", USER_LOOKUP, "sh",
                                                                                          user, shared_tmp], env={})
        fields = to_text(stdout, errors="surrogate_or_strict").strip().split(":")
        if rc == 3 or (rc == 0 and fields and fields[0] == "self"):
            return None  # the agent already runs as that user
        if rc == 1:
            raise AnsibleConnectionFailure(
                "microvm.sandbox.agent: user %r (ansible_user / -u / remote_user) does not exist in the guest of session %s; "
                "create it in the guest (for example in its template), or leave ansible_user unset to run as the "
                "agent's user (root). Nothing was run as another user." % (user, session))
        if rc == 2:
            raise AnsibleConnectionFailure(
                "microvm.sandbox.agent: running tasks as user %r in session %s needs setpriv (util-linux) in the guest, "
                "which it lacks; add it to the template, or leave ansible_user unset. Nothing was run." % (user, session))
        if rc != 0 or len(fields) < 3:
            raise AnsibleConnectionFailure("microvm.sandbox.agent: cannot look up user %r in session %s: %s"
                                           % (user, session, shown(stderr or stdout, text=True).strip()[-300:]))
        display.vvv("RUN AS guest user %s (uid %s, gid %s)" % (user, fields[0], fields[1]), host=session)
        return {"name": user, "uid": fields[0], "gid": fields[1], "home": ":".join(fields[2:])}

    def _as_user(self, argv: list[str]) -> list[str]:
        """argv run as the requested user (setpriv drops to its ids and groups), or unchanged."""
        user = self._user
        if user is None:
            return argv
        return (["setpriv", "--reuid=%s" % user["uid"], "--regid=%s" % user["gid"], "--init-groups", "--",
                 "/usr/bin/env", "HOME=%s" % user["home"], "USER=%s" % user["name"], "LOGNAME=%s" % user["name"]]
                + list(argv))

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a mux call, turning its failures into the right Ansible exceptions."""
        try:
            return fn(*args, **kwargs)
        except (OSError, mp.ProtocolError) as e:  # the worker's own connection to the mux broke
            self._deferred.clear()  # the task fails here: nothing left to run at close
            self.close()
            raise AnsibleConnectionFailure("microvm.sandbox.agent: lost the multiplexer of session %s during %s: %s"
                                           % (self._session(), what, e)) from e
        except errors.WarmRefused:  # not an error: the module was not started, the caller runs it cold
            raise
        except errors.SandboxError as e:
            raise outcomes.ansible_error(e, PLUGIN) from e

    # -- commands ----------------------------------------------------------------------------
    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = True) -> tuple[int, bytes, bytes]:
        hops.record(hops.target(), "worker", event="call", t=hops.now())  # the module's payload is built by now
        # ensure_connect wraps core's abstract body, so this connects: mypy sees only the body
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)  # type: ignore[safe-super]
        session = self._session()
        executable = self._play_context.executable or "/bin/sh"
        argv = command_argv(executable, to_text(cmd, errors="surrogate_or_strict"))
        display.vvv("EXEC %s" % to_text(cmd), host=session)
        run = self._run_info()
        timeout = int(self.get_option("command_timeout") or 0)
        stdin = to_bytes(in_data) if in_data else b""
        if self.get_option("warm_runner") and self._user is None:
            if not stdin and not timeout and self.become is None:
                answered = self._defer(argv, to_text(cmd), run)
                if answered is not None:
                    return answered
            warm = self._exec_warm(argv, stdin, sudoable, timeout, run)
            if warm is not None:
                return warm
            self._flush_deferred()
            if not stdin and not timeout and self.become is None:
                warm = self._exec_tmp_op(argv, run)
            if warm is not None:
                return warm
        self._flush_deferred()
        interact = None
        become = None  # the become plugin when it answers a prompt in this command
        prompted: list[bool] = []
        succeeded: list[bool] = []
        become_timeout = 0
        one_shot = False  # sudo's password first on the api road's one-shot stdin (one_shot_become.py)
        root_marker = ""  # su on the api road, run first where it needs no password (one_shot_become.py)
        plain = argv  # the command without that guard
        if sudoable and self.become and self.become.expect_prompt():
            become = self.become
            attached = self._attached().attached
            one_shot = one_shot_become.applies(become, attached)
            if one_shot:
                argv, stdin = one_shot_become.wrap(become, argv, stdin, to_bytes(become.get_option("become_pass") or ""))
            elif one_shot_become.su_first(become, attached) and not self._su_prompts:
                one_shot = True
                argv, root_marker = one_shot_become.root_only(argv)
            else:
                interact = self._become_interaction(prompted, succeeded)
                become_timeout = self._become_timeout()
        env = {} if self._keeps_tmp() else {"TMPDIR": run["dir"]}
        try:
            # as the task's user, after the one-shot wrappers: they ask sudo, or see whether su prompts, as that user
            rc, stdout, stderr, info = self._call("a command", self._attached().exec, self._as_user(argv), env=env,
                                                  timeout=timeout, stdin=stdin, run=run, interact=interact,
                                                  interact_timeout=become_timeout)
            if root_marker and one_shot_become.su_asked(become, rc, stdout, stderr, root_marker):
                self._su_prompts, one_shot = True, False  # nothing ran: su answers its prompt on interactive stdin
                interact, become_timeout = self._become_interaction(prompted, succeeded), self._become_timeout()
                rc, stdout, stderr, info = self._call("a command", self._attached().exec, self._as_user(plain), env=env,
                                                      timeout=timeout, stdin=stdin, run=run, interact=interact,
                                                      interact_timeout=become_timeout)
        except InteractTimeout as e:
            # core's local connection words it so (ssh: "Timeout (Ns) waiting for privilege escalation prompt").
            # from None: the message already summarises the guest's output; ansible-core would append the cause
            raise AnsibleConnectionFailure(become_error_message(
                "Timed out (%ds, option become_timeout)" % become_timeout, e.stdout, e.stderr, prompted)) from None
        if info.get("timed_out"):
            limit = ("%ds (option command_timeout)" % timeout if timeout else
                     "the platform's exec limit of 240 s (transport api; use transport agent or async for longer work)")
            raise AnsibleError("microvm.sandbox.agent: the command on session %s timed out after %s and was stopped"
                               % (session, limit))
        if info.get("hitl_rejected"):
            raise AnsibleError("microvm.sandbox.agent: %s" % profile.hitl_rejected_message(session))
        if one_shot:
            one_shot_become.judge(become, stdout, stderr, prompted, succeeded)
        if become is not None and not succeeded:
            # the become command gave up before its success marker (su exits after a refused password, in
            # whatever language): nothing ran as the target user
            if prompted and (become.check_incorrect_password(stdout) or become.check_incorrect_password(stderr)):
                raise AnsibleError("Incorrect %s password" % become.name)
            raise AnsibleError(become_error_message("Premature end of stream", stdout, stderr, prompted, become))
        if become is not None and prompted:  # only an interaction answers a prompt
            stdout = become.strip_become_prompt(stdout)
            stderr = become.strip_become_prompt(stderr)
        return rc, stdout, stderr

    def _exec_warm(self, argv: list[str], stdin: bytes, sudoable: bool, timeout: int,
                   run: dict[str, Any]) -> tuple[int, bytes, bytes] | None:
        """Run a pipelined module in the warm runner: (rc, stdout, stderr), or None to run it cold."""
        session = self._session()
        shape, reason = core_compat.module_command(argv, stdin)
        if self.become is not None and reason != "async task":
            shape, reason = None, "become is used (the runner runs as the connection user)"
        if shape is not None and not sudoable:
            shape, reason = None, "not a sudoable module command"
        if shape is not None and timeout:
            shape, reason = None, "command_timeout is set"
        if shape is None:
            if stdin or "python" in argv[-1] or reason == "async task":
                display.vvv("WARM RUNNER not used, running cold: %s" % reason, host=session)
            return None
        interpreter, env = shape
        before = [op for _cmd, op in self._deferred]
        try:
            rc, stdout, stderr, _info = self._call("a module run", self._attached().warm, interpreter, env, stdin, run=run,
                                                   core=core_compat.core_version(), before=before)
        except errors.WarmRefused as e:  # see _call: the module was not started (its deferred ops run in a shell next)
            display.vvv("WARM RUNNER refused, running cold: %s" % e, host=session)
            return None
        except AnsibleError:  # lost with its module: the task fails here, and core removes the tmp dir after it
            self._deferred.clear()
            raise
        self._deferred.clear()  # done by the runner ahead of the module (a refusal would have stopped it)
        display.vvv("WARM RUNNER ran the module with %s (rc %s)%s" % (interpreter, rc, ", after %s" % ", ".join(
            op["op"] for op in before) if before else ""), host=session)
        return rc, stdout, stderr

    def _defer(self, argv: list[str], cmd: str, run: dict[str, Any]) -> tuple[int, bytes, bytes] | None:
        """Answer a task tmp dir command now, as the shell would have, and have it done later without a round trip
        of its own: (rc, stdout, stderr), or None to run it as usual.

        mkdtemp: answered with the path core asked for; the runner makes it with the next module, in its request,
        or the first other operation runs it first (_flush_deferred), a failure in core's words. chmod (core chmods
        the files it put just before the module that reads them): the same. rm (the task's end): sent to the mux,
        which does it unawaited (_forget_rm). Only what the runner does as a tmp op, so never with become (core's
        chmod/setfacl/chown dance runs as today); every other operation of the connection runs them first, and so
        does close.
        """
        version = (self._attached().attached or {}).get("version", 0)
        if self._flushing or version < mp.TMP_OP_VERSION:
            return None
        op = core_compat.tmp_op(self._shell, argv)
        if op is None:
            return None
        if op["op"] == "rm":
            return self._forget_rm(argv, op, run) if version >= mp.NOWAIT_VERSION else None
        if op["op"] == "mkdtemp":
            if version < mp.NOWAIT_VERSION:
                return None
            self._deferred.append((cmd, op))
            display.vvv("WARM RUNNER will make the task tmp dir with the next request that needs it", host=self._session())
            return 0, core_compat.mkdtemp_stdout(op), b""
        self._deferred.append((cmd, op))
        display.vvv("WARM RUNNER will do chmod ahead of the next module, in its request", host=self._session())
        return 0, b"", b""

    def _forget_rm(self, argv: list[str], op: dict[str, Any], run: dict[str, Any]) -> tuple[int, bytes, bytes] | None:
        """The task tmp dir's rm, not waited for: the mux does it after everything this connection sent before.

        A dir whose mkdtemp is still deferred was never made: both are dropped, with the chmods inside it. A failed rm
        is in the mux log and shown as a warning by the session's next task (not by this one, as core would).
        """
        gone = op["path"].rstrip("/")
        inside = [(c, o) for c, o in self._deferred if _tmp_op_paths(o) and all(
            p == gone or p.startswith(gone + "/") for p in _tmp_op_paths(o))]
        self._deferred = [d for d in self._deferred if d not in inside]  # what they would change is removed now
        if any(o["op"] == "mkdtemp" for _c, o in inside):
            display.vvv("WARM RUNNER dropped the task tmp dir it was to make: nothing used it", host=self._session())
            return 0, b"", b""
        self._flush_deferred()  # anything else still to do comes first, as core ran it
        if not self._attached().tmp_unawaited(op, argv, run=run):
            return None
        display.vvv("WARM RUNNER removes the task tmp dir after this task, unawaited", host=self._session())
        return 0, b"", b""

    def _flush_deferred(self) -> None:
        """Run the deferred tmp dir commands now, in order, as core would have run them: one that fails fails the task
        with core's own words (ActionBase._make_tmp_path, _fixup_perms2), before anything else is done."""
        if self._flushing:
            return
        while self._deferred:
            cmd, op = self._deferred.pop(0)
            self._flushing = True
            try:
                rc, out, err = self.exec_command(cmd, sudoable=False)
            finally:
                self._flushing = False
            if rc != 0:
                self._deferred_failed(cmd, op, rc, out, err)

    def _deferred_ahead(self) -> list[tuple[str, dict[str, Any], list[str]]]:
        """The deferred tmp dir commands, taken for a request that has the mux do them first: (command, op, argv).
        With a mux that cannot, they are run now, as _flush_deferred does."""
        if not self._deferred or (self._attached().attached or {}).get("version", 0) < mp.NOWAIT_VERSION:
            self._flush_deferred()
            return []
        executable = self._play_context.executable or "/bin/sh"
        taken = [(cmd, op, command_argv(executable, cmd)) for cmd, op in self._deferred]
        self._deferred.clear()
        display.vvv("WARM RUNNER will do %s ahead of the put, in its request" % ", ".join(op["op"] for _c, op, _a in taken),
                    host=self._session())
        return taken

    def _deferred_failed(self, cmd: str, op: dict[str, Any], rc: int, out: bytes, err: bytes) -> NoReturn:
        """A deferred tmp dir command failed: the task fails here, in core's words for it."""
        self._deferred.clear()
        if op["op"] == "mkdtemp":  # core names its own command, before the connection wrapped it in a shell
            script = core_compat.core_script(command_argv(self._play_context.executable or "/bin/sh", cmd))
            raise AnsibleConnectionFailure(core_compat.mkdtemp_failure(
                script or cmd, rc, to_text(out, errors="surrogate_or_strict"), to_text(err, errors="surrogate_or_strict"),
                display.verbosity))
        raise AnsibleError("Failed to set permissions on remote files (rc: %s, err: %s)"
                           % (rc, to_text(err, errors="surrogate_or_strict")))

    def _exec_tmp_op(self, argv: list[str], run: dict[str, Any]) -> tuple[int, bytes, bytes] | None:
        """A task tmp dir command (mkdtemp, chmod, rm) done by the warm runner: (rc, stdout, stderr), or None."""
        op = core_compat.tmp_op(self._shell, argv)
        if op is None or (self._attached().attached or {}).get("version", 0) < mp.TMP_OP_VERSION:
            return None  # not one of them, or a mux started by an older collection that lacks the op
        try:
            rc, stdout, stderr, _info = self._call("a tmp dir command", self._attached().tmp, op, run=run)
        except errors.WarmRefused as e:  # see _call: nothing was done
            display.vvv("WARM RUNNER did not do %s, running it in a shell: %s" % (op["op"], e), host=self._session())
            return None
        display.vvv("WARM RUNNER did %s (rc %s)" % (op["op"], rc), host=self._session())
        return rc, stdout, stderr

    def _become_timeout(self) -> int:
        """Seconds allowed until become succeeds; below 1 means the default, as core's local connection has it."""
        try:
            value = int(self.get_option("become_timeout") or 0)
        except (KeyError, TypeError, ValueError):
            value = 0
        return value if value >= 1 else BECOME_TIMEOUT_DEFAULT

    def _become_interaction(self, prompted: list[bool], succeeded: list[bool]) -> Interact:
        """Answer the become password prompt once, release stdin when become succeeded, and refuse a wrong password.

        As ansible-core's ssh and local connections do: the plugin's "incorrect password" text fails with
        "Incorrect <method> password", its "missing password" text with "Missing <method> password", and a prompt
        seen again after the answer with "Duplicate become password prompt encountered". Prompts are looked for
        only in output that arrived after the last answered one; each call looks only at the output new since the
        previous call and a bounded tail before it (become_scan), so much output before a prompt costs O(n).
        """
        become = self.become
        if become is None:  # exec_command asks for an interaction only when a become plugin is set
            raise AnsibleError("microvm.sandbox.agent: a become password interaction needs a become plugin")
        tails = (become_scan.Tail(), become_scan.Tail())  # stdout, stderr: only new output and a bounded tail

        def interact(out: bytes | bytearray, err: bytes | bytearray) -> bytes | bool | None:
            looks = (tails[0].look(out), tails[1].look(err))
            windows = [w for w in looks if w is not None]
            if looks[0] is not None and become.check_success(looks[0][0]):
                succeeded.append(True)
                return True
            if prompted and any(become.check_incorrect_password(new) for _window, new in windows):
                raise AnsibleError("Incorrect %s password" % become.name)
            if any(become.check_missing_password(window) for window, _new in windows):
                raise AnsibleError("Missing %s password" % become.name)
            if any(become.check_password_prompt(new) for _window, new in windows):
                if prompted:
                    raise AnsibleError(become_error_message("Duplicate become password prompt encountered", bytes(out),
                                                            bytes(err), prompted, become))
                prompted.append(True)
                tails[0].answered(out)
                tails[1].answered(err)
                return to_bytes(become.get_option("become_pass") or "") + b"\n"
            return None
        return interact

    # -- files ----------------------------------------------------------------------------------
    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)  # type: ignore[safe-super]  # connects (ensure_connect), see exec_command
        display.vvv("PUT %s TO %s" % (in_path, out_path), host=self._session())
        if not os.path.isfile(to_bytes(in_path, errors="surrogate_or_strict")):
            self._flush_deferred()
            raise AnsibleFileNotFound("microvm.sandbox.agent: file or module does not exist: %s" % to_text(in_path))
        ahead = self._deferred_ahead()
        moved = self._call("put_file", self._attached().put, to_text(in_path), to_text(out_path), run=self._run_info(),
                           ahead=[{"op": op, "argv": argv} for _cmd, op, argv in ahead])
        if isinstance(moved, dict) and isinstance(moved.get("ahead_failed"), dict):
            failed = moved["ahead_failed"]
            cmd, op, _argv = ahead[int(failed.get("index") or 0)]
            self._deferred_failed(cmd, op, int(failed.get("rc") or -1), to_bytes(failed.get("stdout") or ""),
                                  to_bytes(failed.get("stderr") or ""))
        self._show_moved("PUT", moved)
        if self._user is not None:
            # The agent writes as its own user: hand the file to the task's user, as a put over SSH would.
            rc, _out, err, _info = self._call("put_file", self._attached().exec, [
                "chown", "--no-dereference", "%s:%s" % (self._user["uid"], self._user["gid"]), "--",
                to_text(out_path)], env={})
            if rc != 0:
                raise AnsibleError("microvm.sandbox.agent: cannot give %s to user %s in session %s: %s"
                                   % (to_text(out_path), self._user["name"], self._session(), to_text(err).strip()))

    def put_archive(self, in_path: str, out_dir: str) -> dict[str, Any]:
        """Extract the local tar in_path into the guest directory out_dir (inside /workspace).

        Not part of Ansible's connection API: action plugins that restore a workspace call it.
        The agent refuses the whole archive, writing nothing, if a member would land outside out_dir.
        """
        self._connect()
        display.vvv("PUT ARCHIVE %s INTO %s" % (in_path, out_dir), host=self._session())
        self._flush_deferred()
        if not os.path.isfile(to_bytes(in_path, errors="surrogate_or_strict")):
            raise AnsibleFileNotFound("microvm.sandbox.agent: archive does not exist: %s" % to_text(in_path))
        return self._call("put_archive", self._attached().put_archive, to_text(in_path), to_text(out_dir))

    def exec_stream(self, argv: list[str], as_user: bool = True) -> tuple[command_stream.ExecStream, str]:
        """Start argv in the guest over its own connection to the mux; -> (command_stream.ExecStream, the run's TMPDIR).

        Not part of Ansible's connection API: microvm.sandbox.sync's steps stream a manifest out of it, or take
        their operations as one-shot stdin (written whole, then closed), beside put_archive / fetch_file. With as_user false
        it runs as the agent's user even when remote_user asks for another (the caller hands files over).
        """
        self._connect()
        run = self._run_info()
        display.vvv("EXEC STREAM %s" % argv[:4], host=self._session())
        self._flush_deferred()
        stream = self._call("a streamed command", command_stream.ExecStream, self._new_mux_client(),
                            self._as_user(argv) if as_user else argv, env={"TMPDIR": run["dir"]}, run=run)
        return stream, run["dir"]

    def guest_user(self) -> tuple[int, int] | None:
        """(uid, gid) of the remote_user commands run as, or None for the agent's own user."""
        self._connect()
        return (int(self._user["uid"]), int(self._user["gid"])) if self._user else None

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)  # type: ignore[safe-super]  # connects (ensure_connect), see exec_command
        display.vvv("FETCH %s TO %s" % (in_path, out_path), host=self._session())
        self._flush_deferred()
        moved = self._call("fetch_file", self._attached().fetch, to_text(in_path), to_text(out_path), run=self._run_info())
        self._show_moved("FETCH", moved)

    def _show_moved(self, verb: str, moved: Any) -> None:
        """At -vvv, how a transfer went: its bytes, and the path that carried them (bulk line, gRPC channel, API)."""
        if isinstance(moved, dict) and "bytes" in moved:
            staged = ", staged" if moved.get("staged") else ""
            display.vvv("%s done: %s bytes over the %s path%s" % (verb, moved["bytes"], moved.get("via", "?"), staged),
                        host=self._session())

    # -- life cycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._deferred and self._mux_client is not None:
            # no module came after them in this task (keep_remote_files, an action of its own): done now, as core asked
            try:
                self._flush_deferred()
            except AnsibleError as e:
                display.warning("microvm.sandbox.agent: %s" % e)
        if self._mux_client is not None:
            self._mux_client.close()
        self._mux_client = None
        self._connected = False

    def reset(self) -> None:
        """meta: reset_connection: close this session's channel in the mux; the next task opens a fresh one."""
        session = self._session()
        try:
            client = self._make_mux_client(self._session_config(session))
        except (KeyError, AnsibleError, profile.TransferPathError):
            return  # options not set, or no token: nothing was ever opened with them
        self.close()
        try:
            done = client.reset()
        except (OSError, mp.ProtocolError) as e:
            display.vvv("reset_connection: the multiplexer of session %s did not answer: %s" % (session, e), host=session)
            return
        if done and done.get("reset"):
            display.vvv("reset_connection: closed the channel of session %s in the multiplexer (pid %s)"
                        % (session, done.get("pid")), host=session)


if TYPE_CHECKING:  # mypy holds this class to what the action plugins call on it (_worker/sandbox_connection.py)
    _ACTIONS_VIEW: type[SandboxConnection] = Connection
