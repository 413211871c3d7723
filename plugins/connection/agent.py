# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: agent
short_description: Run tasks inside a microVM sandbox session through its guest agent
version_added: 0.1.0
author:
  - microvm.sandbox maintainers (@microvm)
description:
  - Runs commands and copies files in a sandbox session of the managed microVM platform
    (DigitalOcean Managed Agents, also called Harness Runtime) or of the local control plane,
    over the guest agent's gRPC service reached through the platform's port-forward WebSocket.
  - The first task starts the controller user's shared multiplexer process (one per O(mux_dir), or a small pool of
    them, see O(mux_processes)); it holds one WebSocket port-forward and one gRPC channel per session, opened on the
    session's first task and closed after O(persist) idle seconds. Every later task, fork and run reuses them, like
    SSH's ControlPersist, and hundreds of sessions share the process. The task worker itself only speaks a small
    framed protocol over a unix socket.
  - Pipelining is on by default, so a module runs with one round trip and no file transfer.
  - Files can be copied to and from any guest path. Paths under C(/workspace) are transferred directly;
    other paths are staged through the run's scratch directory with commands in the guest.
  - Each C(ansible-playbook) run gets its own E(TMPDIR) under O(scratch_dir), set last in the environment
    of every command, so files made with C(mktemp) or Python's C(tempfile) can be fetched by later tasks.
    It is removed when the run ends. M(ansible.builtin.tempfile) is the exception, since its files are meant to outlive
    the run, so it runs without that E(TMPDIR) and they land in the guest's C(/tmp), as over SSH.
  - C(remote_tmp) may be any guest path (for example C(/tmp/.ansible/tmp)); files ansible-core puts there are
    staged through the scratch dir like any transfer outside C(/workspace).
  - C(~) of the connection user is the C(HOME) its commands run with (the platform's C(/workspace/home) for the
    agent's own user, with or without C(ansible_user=root)), so C(~) paths, C($HOME) and the async job dir agree.
  - A PAUSED session is woken by the first task; a deleted session makes the host UNREACHABLE with a message
    naming the session and its status. A command whose stream is lost is reported and never re-run.
  - A host that sets no C(ansible_python_interpreter) gets V(auto_silent) from this connection, when neither
    C(interpreter_python) in C(ansible.cfg) nor E(ANSIBLE_PYTHON_INTERPRETER) is set. The guest's Python is then
    discovered once per host without core's warning (a sandbox's Python is whatever its template installed).
    Set C(ansible_python_interpreter) to pin one, or to V(auto) to see the warning.
notes:
  - The API token is passed to the multiplexer on its standard input, never on a command line or in a file,
    and is never printed, not even at C(-vvvv).
  - "C(meta: reset_connection) closes this session's channel in the multiplexer (other sessions keep theirs);
    the next task opens a new one."
  - The guest agent has no terminal. C(become) with C(sudo) and with C(su) works with and without a password
    (the connection answers the prompt once). A wrong password fails at once in ansible-core's words
    (C(Incorrect sudo password), C(Duplicate become password prompt encountered)), and a prompt that never comes
    fails after O(become_timeout); the command is stopped.
  - See docs/connection.md in the collection for the scratch rules and what survives what.
options:
  remote_addr:
    description:
      - The session to run in, by session id or by name.
    type: str
    default: inventory_hostname
    vars:
      - name: inventory_hostname
      - name: ansible_host
      - name: ansible_microvm_session
      - name: delegated_vars['ansible_host']
  remote_user:
    description:
      - The guest user tasks run as (C(ansible_user), C(-u), the C(remote_user) keyword).
      - The guest agent runs commands as its own user (root). When another user is asked for, every command runs as
        that user (its uid, gid, groups, C(HOME), C(USER) and C(LOGNAME), through C(setpriv) in the guest), files
        put into the guest belong to it, and the default C(remote_tmp) is a sticky world-writable directory like
        C(/tmp), so scratch, E(TMPDIR) and transfers work for it.
      - A user that does not exist in the guest fails the connection with a message naming it; tasks never run as
        someone else silently. Not set, or V(root), runs as the agent's user.
      - The warm runner runs modules as the agent's user, so it is not used for another user.
    type: str
    vars:
      - name: ansible_user
    env:
      - name: ANSIBLE_REMOTE_USER
    ini:
      - section: defaults
        key: remote_user
    keyword:
      - name: remote_user
    cli:
      - name: user
  api_url:
    description:
      - Base URL of the control plane, for example V(https://api.digitalocean.com) or the URL of the local control plane.
      - The port-forward WebSocket uses C(ws://) for C(http://) and C(wss://) for C(https://).
    type: str
    default: https://api.digitalocean.com
    env:
      - name: DO_AGENTS_API_URL
    vars:
      - name: ansible_microvm_api_url
    ini:
      - section: microvm_agent_connection
        key: api_url
  api_token:
    description:
      - Bearer token for the control plane, sent on REST calls and on the WebSocket upgrade.
      - Never printed or logged; passed to the multiplexer on its standard input.
      - Read from E(DO_AGENTS_API_TOKEN), else E(DIGITALOCEAN_TOKEN), else E(DIGITALOCEAN_ACCESS_TOKEN).
    type: str
    env:
      - name: DIGITALOCEAN_ACCESS_TOKEN
      - name: DIGITALOCEAN_TOKEN
      - name: DO_AGENTS_API_TOKEN
    vars:
      - name: ansible_microvm_api_token
  route_prefix:
    description:
      - Path prefix of the API routes under O(api_url); V(/v2/agents) selects the older routes.
    type: str
    default: /v2/harness-runtime
    env:
      - name: DO_AGENTS_API_PREFIX
    vars:
      - name: ansible_microvm_route_prefix
    ini:
      - section: microvm_agent_connection
        key: route_prefix
  transport:
    description:
      - The road into the sandbox.
      - V(agent) is the gRPC guest agent on O(agent_port) through the port-forward (the fast road, every feature).
        An agent port that refuses the platform's dial (a template without the agent) fails the task as
        UNREACHABLE within a few seconds, naming what to do (V(auto) or V(api), or O(agent_port)); it is believed 2
        seconds after the session is seen usable, so an agent still starting is not taken for none.
      - V(api) is the platform's documented exec (its buffered answer) and workspace file API only, for templates
        without the agent or networks that block the port-forward. Each command runs as a job in the scratch dir, so
        neither the answer's 1 MiB per stream nor the platform's 240 second exec limit cuts it; modules run in a
        warm runner started once per session (a detached job on a unix socket); C(sudo) with a password sends it
        first on the command's stdin; stdin while a command runs (only C(su) with a password from a user other than
        root) needs the team's interactive stdin; see docs/connection.md.
      - V(auto), the default, uses the agent where it answers, else V(api). It wakes a paused session, then decides in
        one step; a port that refuses the platform's dial (a template without the agent) falls back on that refusal
        (by the same rule as V(agent)), an agent port that takes the dial but stays silent after 5 seconds. The
        choice holds for the life of the session's link in the multiplexer; it is in the multiplexer's log and shown
        at C(-v) once per session and run. A deleted or failed session is an error, never a fallback.
      - V(agent) was the default before; set it to keep a clear UNREACHABLE where the agent is absent rather than
        the V(api) road's limits.
    type: str
    default: auto
    choices: [agent, api, auto]
    env:
      - name: MICROVM_TRANSPORT
    vars:
      - name: ansible_microvm_transport
    ini:
      - section: microvm_agent_connection
        key: transport
  agent_port:
    description:
      - Guest port of the sandbox agent.
    type: int
    default: 8443
    vars:
      - name: ansible_microvm_agent_port
    ini:
      - section: microvm_agent_connection
        key: agent_port
  scratch_dir:
    description:
      - Guest directory for the run's scratch files, staged transfers and the default C(remote_tmp).
      - Must be inside C(/workspace), the only place the platform's agent transfers files to and from;
        anything else fails when connecting, with a message naming the rule.
    type: str
    default: /workspace/.scratch
    env:
      - name: MICROVM_SCRATCH_DIR
    vars:
      - name: ansible_microvm_scratch_dir
    ini:
      - section: microvm_agent_connection
        key: scratch_dir
  connect_timeout:
    description:
      - Seconds to wait for the guest agent to answer, including waking a paused session.
    type: int
    default: 60
    env:
      - name: MICROVM_CONNECT_TIMEOUT
    vars:
      - name: ansible_microvm_connect_timeout
    ini:
      - section: microvm_agent_connection
        key: connect_timeout
  command_timeout:
    description:
      - Seconds a command may run before the agent stops it (SIGTERM, then SIGKILL) and the task fails
        naming this timeout. V(0) means no limit.
    type: int
    default: 0
    env:
      - name: MICROVM_COMMAND_TIMEOUT
    vars:
      - name: ansible_microvm_command_timeout
    ini:
      - section: microvm_agent_connection
        key: command_timeout
  become_timeout:
    description:
      - Seconds to wait for C(become) to succeed, from the start of the command until the become plugin's success
        marker, its password prompt answered. A wrong password (a second prompt, or the become plugin's
        "incorrect password" text) fails at once with ansible-core's words (C(Incorrect sudo password),
        C(Duplicate become password prompt encountered)); a prompt that never comes or never matches (for example
        a C(ansible_su_prompt_l10n) that does not fit the guest's language) fails after this many seconds, the
        command stopped, like C(ssh)'s O(ansible.builtin.ssh#connection:timeout) and C(local)'s
        C(become_success_timeout).
      - A deadline, not a silence - a become command that keeps printing without prompting or succeeding fails at
        it too. Each piece of output is searched for the prompt and the success marker once (with the 4 KiB before
        it), so much output before the prompt costs time linear in its size.
      - Only used when the become plugin expects a password prompt. Values below 1 mean the default.
    type: int
    default: 10
    env:
      - name: ANSIBLE_TIMEOUT
      - name: MICROVM_BECOME_TIMEOUT
    ini:
      - section: defaults
        key: timeout
      - section: microvm_agent_connection
        key: become_timeout
    vars:
      - name: ansible_become_timeout
      - name: ansible_microvm_become_timeout
    cli:
      - name: timeout
  payload_cache:
    description:
      - Where the connection keeps what ansible-core puts into a module's payload (AnsiballZ) across runs, so that a
        run does not rebuild, for each module it uses, a payload whose files did not change (core's own cache lasts
        one run, and a build takes 60-200 ms). Per ansible-core version, at most 256 payloads, least recently used
        dropped first.
      - Every use checks the sha256 of each file a payload was built from and that no file appeared where the import
        would find it first; a payload with a redirected module_util is not kept. A directory another user can write
        is not used.
      - Set it to an empty string to build every payload as core does.
    type: path
    default: ~/.ansible/microvm_sandbox/payloads
    env:
      - name: MICROVM_PAYLOAD_CACHE
    ini:
      - section: microvm_agent_connection
        key: payload_cache
  persist:
    description:
      - Seconds the session's channel in the multiplexer stays open without any task before it is closed.
        The multiplexer process exits soon after its last channel is closed.
    type: int
    default: 60
    env:
      - name: MICROVM_PERSIST
    vars:
      - name: ansible_microvm_persist
    ini:
      - section: microvm_agent_connection
        key: persist
  mux_dir:
    description:
      - Local directory of the multiplexers' sockets, pid files and logs (0700; sockets 0600, reachable only
        by the user who runs the play).
      - It must be the user's own directory (created 0700 when missing); a symlink or a directory of another user
        is refused, naming the path. Any length works.
    type: path
    default: ~/.ansible/microvm
    env:
      - name: MICROVM_MUX_DIR
    ini:
      - section: microvm_agent_connection
        key: mux_dir
  mux_processes:
    description:
      - How many shared multiplexer processes the controller user runs per O(mux_dir); each session is served by
        one of them, chosen by a hash of its endpoint and id. V(0) means one per CPU core, at most 4.
      - More processes let bulk transfers to several sessions use more cores; each costs about 50 MB.
      - Every play using the same O(mux_dir) should use the same value.
    type: int
    default: 0
    env:
      - name: MICROVM_MUX_PROCESSES
    ini:
      - section: microvm_agent_connection
        key: mux_processes
  max_output_bytes:
    description:
      - The most output (stdout and stderr together) of one command that a task holds in memory. A command that
        prints more is stopped in the sandbox and the task fails naming this option; V(0) means no limit.
      - Output from a sandbox is untrusted, and Ansible keeps several copies of a task's output, so without a
        limit a command printing gigabytes would take the controller's memory. Send big output to a file in
        the sandbox and fetch it (M(ansible.builtin.fetch)) instead.
    type: int
    default: 67108864
    env:
      - name: MICROVM_MAX_OUTPUT_BYTES
    vars:
      - name: ansible_microvm_max_output_bytes
    ini:
      - section: microvm_agent_connection
        key: max_output_bytes
  validate_certs:
    description:
      - Whether to verify the TLS certificate of O(api_url) (REST and WebSocket).
    type: bool
    default: true
    env:
      - name: MICROVM_VALIDATE_CERTS
    vars:
      - name: ansible_microvm_validate_certs
  warm_runner:
    description:
      - Run pipelined Python modules in a warm interpreter (the warm module runner) that the multiplexer keeps
        in the guest, one per session and interpreter; each module runs in a fresh fork of it
        with C(ansible.module_utils.basic) already imported
        (from the module payload itself, never from the controller).
      - Only used for a pipelined Python module without become, async or O(command_timeout); anything else,
        a payload whose module_utils differ from the preloaded ones, a guest without the interpreter, or a runner
        that cannot start runs as a plain pipelined command. C(-vvv) says which and why.
      - Set V(false) to run every module as a plain pipelined command. See docs/connection.md for the figures.
    type: bool
    default: true
    env:
      - name: MICROVM_WARM_RUNNER
    vars:
      - name: ansible_microvm_warm_runner
    ini:
      - section: microvm_agent_connection
        key: warm_runner
  pipelining:
    description:
      - Send module payloads over the command's standard input instead of copying them as files.
      - On by default for this connection; set V(false) to use files under C(remote_tmp) instead.
    type: bool
    default: true
    env:
      - name: ANSIBLE_PIPELINING
    ini:
      - section: defaults
        key: pipelining
      - section: connection
        key: pipelining
    vars:
      - name: ansible_pipelining
      - name: ansible_microvm_pipelining
"""

EXAMPLES = r"""
# inventory.yml: one host per session, by name or id
# all:
#   hosts:
#     build-box:
#       ansible_connection: microvm.sandbox.agent
#       ansible_host: my-session-name
#   vars:
#     ansible_microvm_api_url: http://127.0.0.1:8765

- name: Work inside a sandbox
  hosts: build-box
  gather_facts: false
  tasks:
    - name: Run a command
      ansible.builtin.command: uname -a
      changed_when: false

    - name: Make a temporary file in the guest's /tmp; it outlives the run, as over SSH
      ansible.builtin.tempfile:
        state: file
      register: tmp

    - name: Fetch it back
      ansible.builtin.fetch:
        src: "{{ tmp.path }}"
        dest: out/
        flat: true

    - name: Files outside /workspace work too (staged through the scratch dir)
      ansible.builtin.fetch:
        src: /etc/os-release
        dest: out/os-release
        flat: true
"""

import time  # noqa: E402

_IMPORT_STARTED_NS = time.time_ns()  # the worker's import of this plugin starts (MICROVM_HOPS, bench/hops_bench.py)

import os  # noqa: E402
import posixpath  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar  # noqa: E402

from ansible import constants as C  # noqa: E402
from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound  # noqa: E402
from ansible.module_utils.common.text.converters import to_bytes, to_text  # noqa: E402
from ansible.plugins.connection import ConnectionBase  # noqa: E402
from ansible.utils.display import Display  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import code_cache  # noqa: E402

code_cache.cache_collection_code()  # first: the modules below are then compiled once per run, not per task

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import profile  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import become_scan  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import command_stream  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import one_shot_become  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import option_defs  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import outcomes  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import payload_cache  # noqa: E402

if TYPE_CHECKING:
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.sandbox_connection import SandboxConnection
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import (  # noqa: E402
    Interact, InteractTimeout, MuxClient, host_tag, run_identity)
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.core_compat import command_argv  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import DEFAULT_POOL_SIZE, LinkConfig  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown  # noqa: E402

display = Display()
T = TypeVar("T")
LOADED_BY = os.getpid()  # a worker that inherited the plugin loaded (the sessions inventory loads it before the forks)
option_defs.register("connection", __name__, DOCUMENTATION)  # saves core's slow parse in every worker
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


hops.record(hops.target(), "worker", event="import", t0=_IMPORT_STARTED_NS, t1=hops.now())
