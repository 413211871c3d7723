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
    session's first task and kept while the run that uses them lives, then closed after O(persist) idle seconds.
    Every later task, fork and run reuses them, like
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
      - Seconds the session's channel in the multiplexer stays open without any task, once every
        C(ansible-playbook) run that used it has ended, before it is closed. While a run lives its channel and
        warm module runner stay open however far apart its tasks are (a play's round over many hosts can take
        longer than this).
      - The multiplexer process exits soon after its last channel is closed.
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

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import code_cache  # noqa: E402

code_cache.cache_collection_code()  # first: the plugin's code below is then compiled once per run, not per task

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import option_defs  # noqa: E402

option_defs.register("connection", __name__, DOCUMENTATION)  # saves core's slow parse in every worker

# Core compiles this file from source in every task's worker: the code is in plugin_utils, compiled once per run.
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.agent_connection import Connection  # noqa: E402

__all__ = ["Connection"]

hops.record(hops.target(), "worker", event="import", t0=_IMPORT_STARTED_NS, t1=hops.now())
