"""The microvm.sandbox.agent connection through the real stack: ansible-playbook -> worker -> mux ->
gRPC -> port-forward WebSocket -> local control plane -> guest agent."""
import contextlib
import glob
import hashlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest

from microvm_plane_testing import mux_pids, run_transport, stop_muxes, team


def sha1(path):
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inventory(hosts, **extra):
    """hosts: {inventory name: session id or name}."""
    lines = ["[sbx]"] + ["%s ansible_host=%s" % (name, sid) for name, sid in hosts.items()]
    lines += ["", "[sbx:vars]", "ansible_connection=microvm.sandbox.agent", "ansible_python_interpreter=/usr/bin/python3"]
    lines += ["%s=%s" % kv for kv in extra.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def mux_dir(tmp_path):
    """A private mux dir per test; the muxes started in it are stopped afterwards."""
    d = str(tmp_path / "mux")
    yield d
    stop_muxes(d)


@pytest.fixture
def env(plane, mux_dir):
    return dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30")


def new_session(plane, name):
    client = plane.client()
    s = client.create_session({"name": "%s-%s" % (name, os.urandom(4).hex()), "agent": "custom"})
    return client.wait_session(s["session_id"], timeout=120)


BATTERY = r"""
- name: connection battery (pipelining {{ ansible_pipelining }})
  hosts: sbx
  gather_facts: false
  vars:
    uni: "{{ 'ünïcödé ☃ file' }}"
    src: "{{ playbook_dir }}"
  tasks:
    - name: raw with unicode
      ansible.builtin.raw: "echo 'héllo wörld ☃'"
      register: r
    - ansible.builtin.assert:
        that: ["'héllo wörld ☃' in r.stdout"]

    - name: command, rc and stderr apart
      ansible.builtin.shell: "echo out; echo err >&2; exit 3"
      register: c
      failed_when: false
    - ansible.builtin.assert:
        that: ["c.rc == 3", "c.stdout == 'out'", "c.stderr == 'err'"]

    - name: loops
      ansible.builtin.command: "echo {{ item }}"
      loop: [1, 2, 3]
      register: l
    - ansible.builtin.assert:
        that: ["l.results | map(attribute='stdout') | list == ['1', '2', '3']"]

    - name: environment reaches the module, TMPDIR stays in the run's scratch
      ansible.builtin.shell: 'echo "$MY_VAR $TMPDIR"'
      environment: {MY_VAR: "vålue with spaces", TMPDIR: /tmp}
      register: e
    - ansible.builtin.assert:
        that:
          - "e.stdout.startswith('vålue with spaces /workspace/.scratch/run.')"

    - name: copy a file with a unicode name and spaces
      ansible.builtin.copy:
        content: "contënt ☃\n"
        dest: "/workspace/{{ uni }} {{ ansible_pipelining }}.txt"
    - name: fetch it back
      ansible.builtin.fetch:
        src: "/workspace/{{ uni }} {{ ansible_pipelining }}.txt"
        dest: "{{ src }}/back/{{ uni }}.txt"
        flat: true
    - ansible.builtin.assert:
        that: ["lookup('file', src ~ '/back/' ~ uni ~ '.txt') == 'contënt ☃'"]

    - name: empty file in
      ansible.builtin.copy: {src: "{{ src }}/empty", dest: /workspace/empty}
    - name: empty file out
      ansible.builtin.fetch: {src: /workspace/empty, dest: "{{ src }}/back/empty", flat: true}
    - ansible.builtin.stat: {path: /workspace/empty}
      register: es
    - ansible.builtin.assert:
        that: ["es.stat.size == 0"]

    - name: mktemp, then fetch what it made
      ansible.builtin.shell: 'f=$(mktemp) && echo made-by-mktemp > "$f" && echo "$f"'
      register: t
    - ansible.builtin.fetch: {src: "{{ t.stdout }}", dest: "{{ src }}/back/mktemp.txt", flat: true}
    - ansible.builtin.assert:
        that:
          - "t.stdout.startswith('/workspace/.scratch/run.')"
          - "lookup('file', src ~ '/back/mktemp.txt') == 'made-by-mktemp'"

    - name: fetch from outside /workspace
      ansible.builtin.fetch: {src: /etc/os-release, dest: "{{ src }}/back/os-release", flat: true}
    - name: copy to outside /workspace
      ansible.builtin.copy: {content: "outside\n", dest: "/etc/microvm-test-{{ ansible_pipelining }}", mode: "0640"}
    - ansible.builtin.command: "cat /etc/microvm-test-{{ ansible_pipelining }}"
      register: o
    - ansible.builtin.assert:
        that: ["o.stdout == 'outside'"]

    - name: become with su
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      register: b1
    - name: become with su to an unprivileged user
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      become_user: nobody
      become_flags: "-s /bin/sh"
      register: b2
    - ansible.builtin.assert:
        that: ["b1.stdout == 'root'", "b2.stdout == 'nobody'"]
    - name: is sudo there?
      ansible.builtin.raw: command -v sudo
      register: has_sudo
      failed_when: false
    - name: become with sudo
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.sudo
      become_user: nobody
      register: b3
      when: has_sudo.rc == 0
    - ansible.builtin.assert:
        that: ["b3.stdout == 'nobody'"]
      when: has_sudo.rc == 0
"""

BIG = r"""
- name: 100 MiB both ways
  hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.copy: {src: "{{ playbook_dir }}/big.bin", dest: /workspace/big.bin}
      register: up
    - ansible.builtin.stat: {path: /workspace/big.bin, checksum_algorithm: sha1}
      register: st
    - ansible.builtin.fetch: {src: /workspace/big.bin, dest: "{{ playbook_dir }}/big.back", flat: true}
      register: down
    - ansible.builtin.debug: {msg: "UP={{ up.checksum }} REMOTE={{ st.stat.checksum }} DOWN={{ down.checksum }}"}
"""


def test_battery_pipelining_on_and_off(plane, sandbox, env, tmp_path, playbook_runner):
    work = tmp_path / "work"
    work.mkdir()
    (work / "empty").write_bytes(b"")
    inv = inventory({"box": sandbox["name"]})
    for pipelining in ("true", "false"):
        res = playbook_runner(BATTERY, inv, env, extra_args=["-e", "ansible_pipelining=%s" % pipelining], workdir=str(work))
        assert res.rc == 0, res
        assert "failed=0" in res.stdout and "unreachable=0" in res.stdout, res
    assert (work / "back" / "os-release").read_text().startswith("PRETTY_NAME") or \
        "Debian" in (work / "back" / "os-release").read_text()
    assert (work / "back" / "empty").read_bytes() == b""


BECOME_PASSWORD = r"""
- name: become with passwords, connected as the base template's unprivileged user
  hosts: sbx
  gather_facts: false
  tasks:
    - name: the connection's user is sandbox
      ansible.builtin.command: id -un
      register: plain
    - name: sandbox sudoes to root with its own password (sudo prompts; the plugin answers)
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.sudo
      become_user: root
      vars: {ansible_become_password: "{{ user_password }}"}
      register: by_sudo
    - name: sandbox su's to root with root's password (su prompts; the plugin answers)
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      become_user: root
      vars: {ansible_become_password: "{{ root_password }}"}
      register: by_su
    - name: a module (not only a command) runs as root through sudo and through su
      ansible.builtin.copy: {content: "by {{ item }}\n", dest: "/root/from-{{ item }}", mode: "0600"}
      become: true
      become_method: "ansible.builtin.{{ item }}"
      become_user: root
      vars: {ansible_become_password: "{{ user_password if item == 'sudo' else root_password }}"}
      loop: [sudo, su]
    - ansible.builtin.stat: {path: "/root/from-{{ item }}"}
      become: true
      vars: {ansible_become_password: "{{ user_password }}"}
      loop: [sudo, su]
      register: made
    - name: and back to sandbox, with su and sandbox's password
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      become_user: sandbox
      vars: {ansible_become_password: "{{ user_password }}"}
      register: back
    - name: a task without become runs as sandbox again
      ansible.builtin.command: id -un
      register: after
    - name: a wrong password is refused (su checks it; nothing runs as root)
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      become_user: root
      vars: {ansible_become_password: "not-{{ root_password }}"}
      register: wrong
      ignore_errors: true
    - ansible.builtin.assert:
        that:
          - plain.stdout == 'sandbox'
          - by_sudo.stdout == 'root'
          - by_su.stdout == 'root'
          - made.results | map(attribute='stat.pw_name') | list == ['root', 'root']
          - back.stdout == 'sandbox'
          - after.stdout == 'sandbox'
          - wrong is failed
"""


def test_become_with_passwords_as_the_unprivileged_user(plane, env, playbook_runner):
    """Connected as the base template's `sandbox` user (ansible_user), become with sudo (its own password) and su
    (root's) answers each prompt end to end, pipelined or not; the passwords come from the session's secrets
    (setuid sudo and su work: no_new_privs is off in guests) and never appear in the output."""
    client = plane.client()
    user_password, root_password = "pw-%s" % os.urandom(6).hex(), "root-%s" % os.urandom(6).hex()
    session = client.create_session({"name": "become-%s" % os.urandom(4).hex(), "agent": "custom", "secrets": {
        "SANDBOX_USER_PASSWORD": user_password, "SANDBOX_ROOT_PASSWORD": root_password}})
    # su has no -S: on the api road its password prompt needs the team's interactive stdin (sudo's goes first on the
    # one-shot stdin either way; test_connection_api.py has a team without it)

    def streaming():
        return team(plane, interactive_stdin=True, closed_ports=[8443]) if run_transport() == "api" else contextlib.nullcontext()

    try:
        client.wait_session(session["session_id"], timeout=120)
        inv = inventory({"box": session["session_id"]}, ansible_user="sandbox")
        for pipelining in ("true", "false"):
            with streaming():
                res = playbook_runner(BECOME_PASSWORD, inv, env, extra_args=[
                    "-e", "ansible_pipelining=%s" % pipelining, "-e", "user_password=%s" % user_password,
                    "-e", "root_password=%s" % root_password])
            assert res.rc == 0, res
            assert "failed=0" in res.stdout and "ignored=1" in res.stdout, res
            assert user_password not in res.stdout + res.stderr and root_password not in res.stdout + res.stderr
    finally:
        client.delete_session(session["session_id"])


def test_become_with_a_password_through_the_plugin(plane, sandbox, env, playbook_runner):
    """From root, sudo as a user made in the task asks that user's password and the plugin answers it."""
    inv = inventory({"box": sandbox["name"]})
    password = "pw-%s" % os.urandom(6).hex()
    res = playbook_runner(BECOME_FROM_ROOT, inv, env, extra_args=["-e", "dev_password=%s" % password])
    assert res.rc == 0, res
    assert "failed=0" in res.stdout, res
    assert password not in res.stdout + res.stderr


BECOME_FROM_ROOT = r"""
- name: become with a password, from an unprivileged user made in the play
  hosts: sbx
  gather_facts: false
  tasks:
    - name: an unprivileged user with a password, allowed to sudo (as on a real machine)
      ansible.builtin.shell: |
        id dev >/dev/null 2>&1 || useradd --create-home --shell /bin/bash --groups sudo dev
        echo 'dev:{{ dev_password }}' | chpasswd
    - name: dev sudoes to root with its password (sudo prompts; the plugin answers)
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.sudo
      become_exe: sudo -u dev sudo
      become_user: root
      vars: {ansible_become_password: "{{ dev_password }}"}
      register: up
    - ansible.builtin.assert:
        that: ["up.stdout == 'root'"]
"""


def test_100mib_binary_both_ways(plane, sandbox, env, tmp_path, playbook_runner):
    work = tmp_path / "work"
    work.mkdir()
    with open(work / "big.bin", "wb") as f:
        for _dummy in range(100):
            f.write(os.urandom(1 << 20))
    want = sha1(work / "big.bin")
    res = playbook_runner(BIG, inventory({"box": sandbox["session_id"]}), env, workdir=str(work))
    assert res.rc == 0, res
    assert "UP=%s REMOTE=%s DOWN=%s" % (want, want, want) in res.stdout, res
    assert sha1(work / "big.back") == want
    assert not glob.glob(str(work / ".*.part")), "no partial download left behind"


def test_run_tmpdir_removed_after_the_run_and_mux_perms(plane, sandbox, env, mux_dir, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: mktemp
      register: t
    - ansible.builtin.debug: {msg: "TMP={{ t.stdout | dirname }}"}
"""
    inv = inventory({"box": sandbox["name"]})
    res = playbook_runner(pb, inv, env)
    assert res.rc == 0, res
    run_dir = res.stdout.split("TMP=")[1].split('"')[0]
    assert run_dir.startswith("/workspace/.scratch/run.")
    # the mux outlives the run, and removes the run's TMPDIR once ansible-playbook is gone
    check = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.stat: {path: "%s"}
      register: s
      until: not s.stat.exists
      retries: 20
      delay: 1
""" % run_dir
    res = playbook_runner(check, inv, env)
    assert res.rc == 0, res
    # private mux dir and socket
    assert stat.S_IMODE(os.stat(mux_dir).st_mode) == 0o700
    dirs = [d for d in glob.glob(os.path.join(mux_dir, "*")) if os.path.isdir(d)]
    assert len(dirs) == 1
    assert stat.S_IMODE(os.stat(dirs[0]).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(dirs[0], "mux.sock")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(dirs[0], "mux.log")).st_mode) == 0o600


def test_scratch_outside_workspace_fails_clearly(plane, sandbox, env, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: "true"
"""
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}, ansible_microvm_scratch_dir="/tmp/scratch"), env)
    assert res.rc != 0
    assert "scratch dir '/tmp/scratch' must be an absolute directory inside /workspace" in res.output, res
    # remote_tmp may be anywhere (its files are staged like any transfer): tests/integration/test_ssh_habits.py
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}, ansible_remote_tmp="/tmp/ansible"), env,
                          extra_args=["-e", "ansible_pipelining=false"])
    assert res.rc == 0, res


def test_token_never_printed(plane, sandbox, env, mux_dir, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: "true"
    - ansible.builtin.copy: {content: "x", dest: /workspace/t.txt}
"""
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}), env, extra_args=["-vvvv"])
    assert res.rc == 0, res
    assert plane.token not in res.output
    for log in glob.glob(os.path.join(mux_dir, "*", "mux.log")):
        assert plane.token not in open(log).read()
    for pid in mux_pids(mux_dir):
        assert plane.token.encode() not in open("/proc/%d/cmdline" % pid, "rb").read()
        assert plane.token.encode() not in open("/proc/%d/environ" % pid, "rb").read()


@pytest.mark.parametrize("variable", ["DIGITALOCEAN_TOKEN", "DIGITALOCEAN_ACCESS_TOKEN"])
def test_token_from_doctl_variables(plane, sandbox, env, mux_dir, playbook_runner, variable):
    """The token may come from doctl's or community.digitalocean's variable, and still reaches no process env."""
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: "true"
"""
    env = dict(env)
    env[variable] = env.pop("DO_AGENTS_API_TOKEN")
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}), env)
    assert res.rc == 0, res
    pids = mux_pids(mux_dir)
    assert pids
    for pid in pids:
        assert plane.token.encode() not in open("/proc/%d/environ" % pid, "rb").read()


def test_paused_between_tasks(plane, sandbox, env, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo before
    - name: pause the session
      ansible.builtin.command: >-
        {{ ansible_playbook_python }} -c "import os, time;
        from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient;
        c = ApiClient(os.environ['DO_AGENTS_API_URL'], os.environ['DO_AGENTS_API_TOKEN']);
        c.pause_session('%(sid)s'); c.wait_session('%(sid)s', until={'PAUSED'}, timeout=60)"
      delegate_to: localhost
      vars: {ansible_connection: local, ansible_python_interpreter: "{{ ansible_playbook_python }}"}
    - ansible.builtin.command: echo after
      register: after
    - ansible.builtin.assert:
        that: ["after.stdout == 'after'"]
""" % {"sid": sandbox["session_id"]}
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}), env)
    assert res.rc == 0, res
    assert "failed=0" in res.stdout and "unreachable=0" in res.stdout


def test_deleted_mid_play_is_unreachable(plane, env, mux_dir, playbook_runner):
    s = new_session(plane, "del")
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo before
    - name: delete the session
      ansible.builtin.command: >-
        {{ ansible_playbook_python }} -c "import os;
        from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient;
        c = ApiClient(os.environ['DO_AGENTS_API_URL'], os.environ['DO_AGENTS_API_TOKEN']);
        c.delete_session('%(sid)s'); c.wait_session('%(sid)s', until={'DESTROYED'}, timeout=60, gone_ok=True)"
      delegate_to: localhost
      vars: {ansible_connection: local, ansible_python_interpreter: "{{ ansible_playbook_python }}"}
    - ansible.builtin.command: echo after
""" % {"sid": s["session_id"]}
    res = playbook_runner(pb, inventory({"box": s["name"]}), env)
    assert res.rc != 0
    assert "UNREACHABLE!" in res.stdout, res
    assert "unreachable=1" in res.stdout
    assert s["session_id"] in res.stdout, res.stdout  # the whole output: which message left the id out
    assert ("DESTROY" in res.stdout or "deleted" in res.stdout or "not found" in res.stdout), res
    # the mux notices and exits soon after
    deadline = time.time() + 20
    while mux_pids(mux_dir) and time.time() < deadline:
        time.sleep(0.5)
    assert not mux_pids(mux_dir)


def test_deleted_during_a_command_is_lost_not_rerun(plane, env, playbook_runner):
    s = new_session(plane, "lost")
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.shell: "echo run >> /workspace/runs; sleep 30"
"""
    client = plane.client()

    def delete_later():
        time.sleep(6)
        client.delete_session(s["session_id"])

    t = threading.Thread(target=delete_later)
    t.start()
    res = playbook_runner(pb, inventory({"box": s["session_id"]}), env)
    t.join()
    assert res.rc != 0
    assert "UNREACHABLE!" in res.stdout, res
    assert s["session_id"] in res.stdout


def test_several_sessions_with_forks(plane, env, tmp_path, playbook_runner):
    sessions = [new_session(plane, "fork%d" % i) for i in range(3)]
    client = plane.client()
    try:
        pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.copy: {content: "{{ inventory_hostname }}\\n", dest: /workspace/who}
    - ansible.builtin.command: cat /workspace/who
      register: who
    - ansible.builtin.assert: {that: ["who.stdout == inventory_hostname"]}
    - ansible.builtin.fetch: {src: /workspace/who, dest: "{{ playbook_dir }}/out/{{ inventory_hostname }}", flat: true}
"""
        hosts = {"h%d" % i: s["name"] for i, s in enumerate(sessions)}
        res = playbook_runner(pb, inventory(hosts), env, extra_args=["-f", "3"], workdir=str(tmp_path))
        assert res.rc == 0, res
        for name in hosts:
            assert (tmp_path / "out" / name).read_text() == name + "\n"
    finally:
        for s in sessions:
            client.delete_session(s["session_id"])


def test_reset_connection_and_crashed_mux(plane, sandbox, env, mux_dir, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: mktemp
      register: t
    - ansible.builtin.set_fact:
        before: "{{ lookup('ansible.builtin.pipe', opened) }}"
    - ansible.builtin.meta: reset_connection
    - ansible.builtin.fetch: {src: "{{ t.stdout }}", dest: "{{ playbook_dir }}/after-reset", flat: true}
    - ansible.builtin.assert:
        that:
          - "lookup('ansible.builtin.pipe', opened) | int == before | int + 1"
  vars:
    # how many times the shared mux opened this session's channel (its log says so)
    opened: "cat {{ lookup('ansible.builtin.env', 'MICROVM_MUX_DIR') }}/*/mux.log | grep -c ': link [0-9]* open'"
"""
    inv = inventory({"box": sandbox["name"]})
    res = playbook_runner(pb, inv, env)
    assert res.rc == 0, res
    pids = mux_pids(mux_dir)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)  # a crashed mux leaves a stale socket and pid file behind
    time.sleep(0.5)
    res = playbook_runner(pb, inv, env)
    assert res.rc == 0, res
    assert mux_pids(mux_dir) and mux_pids(mux_dir) != pids


def test_command_timeout_names_the_timeout(plane, sandbox, env, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: sleep 20
"""
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}, ansible_microvm_command_timeout=2), env)
    assert res.rc != 0
    assert "timed out after 2s (option command_timeout)" in res.stdout, res


def test_unknown_session_is_unreachable(plane, env, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: "true"
"""
    res = playbook_runner(pb, inventory({"box": "no-such-session-xyz"}), env)
    assert res.rc != 0
    assert "UNREACHABLE!" in res.stdout
    assert "session no-such-session-xyz does not exist" in res.stdout, res


def test_worker_stays_light():
    """The worker imports the plugin; neither grpc, websockets nor requests may come with it."""
    code = ("import sys; import ansible.plugins.connection;"
            "import ansible_collections.microvm.sandbox.plugins.connection.agent;"
            "print(sorted(m for m in ('grpc', 'websockets', 'requests', 'google.protobuf', 'aiohttp') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, ".local", "collections"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_task_timeout_stops_the_command_in_the_guest(plane, sandbox, env, playbook_runner):
    """A task timeout stops the command in the guest: its process is gone soon after (within 10 s, a bound that
    holds on a loaded machine) and never does what it would have done later."""
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.shell: "sleep 40; echo late > /workspace/late-marker"
      timeout: 2
      ignore_errors: true
    - name: The command is gone from the guest
      ansible.builtin.shell: |
        for i in $(seq 50); do
          pgrep -f '[s]leep 40; echo late' >/dev/null || exit 0
          sleep 0.2
        done
        ps -eo pid,pgid,args; exit 1
      changed_when: false
    - ansible.builtin.stat: {path: /workspace/late-marker}
      register: m
    - ansible.builtin.assert: {that: ["not m.stat.exists"]}
"""
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}), env)
    assert res.rc == 0, res


def test_stale_run_dirs_of_crashed_runs_are_swept(plane, sandbox, env, playbook_runner):
    """A run dir of this controller whose ansible-playbook is gone is removed by the next mux that starts."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".local", "collections"))
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import host_tag
    stale = "/workspace/.scratch/run.%s-%d-12345" % (host_tag(), 2 ** 22 + 7)  # no such pid
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.file: {path: "%(stale)s/junk", state: directory}
    - ansible.builtin.meta: reset_connection
    - ansible.builtin.command: "true"
    - ansible.builtin.stat: {path: "%(stale)s"}
      register: s
      until: not s.stat.exists
      retries: 20
      delay: 1
""" % {"stale": stale}
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}), env)
    assert res.rc == 0, res


AS_USER = r"""
- hosts: sbx
  gather_facts: false
  remote_user: root
  tasks:
    - name: make the user (as root)
      ansible.builtin.shell: id mvtester >/dev/null 2>&1 || useradd -m -s /bin/sh mvtester

- hosts: sbx
  gather_facts: false
  tasks:
    - name: who
      ansible.builtin.shell: 'echo "$(id -un) $(id -u) $HOME $USER"; t=$(mktemp); echo "$t"; ls -ld "$t" | cut -d" " -f3'
      register: who
    - ansible.builtin.assert:
        that:
          - "who.stdout_lines[0].startswith('mvtester ')"
          - "who.stdout_lines[0].endswith(' /home/mvtester mvtester')"
          - "who.stdout_lines[1].startswith('/workspace/.scratch/run.')"
          - "who.stdout_lines[2] == 'mvtester'"
    - name: copy into the user's home (a transfer when pipelining is off)
      ansible.builtin.copy: {content: "mine\n", dest: "/home/mvtester/owned-{{ ansible_pipelining }}.txt", mode: "0640"}
    - ansible.builtin.stat: {path: "/home/mvtester/owned-{{ ansible_pipelining }}.txt"}
      register: st
    - ansible.builtin.assert:
        that: ["st.stat.pw_name == 'mvtester'", "st.stat.mode == '0640'"]
    - name: fetch it back
      ansible.builtin.fetch: {src: "/home/mvtester/owned-{{ ansible_pipelining }}.txt", dest: "{{ playbook_dir }}/back/", flat: true}
    - name: root's files stay root's
      ansible.builtin.command: touch /root/not-mine
      register: denied
      failed_when: denied.rc == 0
"""


@pytest.mark.parametrize("pipelining", ["true", "false"])
def test_tasks_run_as_the_requested_user(plane, sandbox, env, tmp_path, playbook_runner, pipelining):
    res = playbook_runner(AS_USER, inventory({"box": sandbox["name"]}), env, workdir=str(tmp_path),
                          extra_args=["-u", "mvtester", "-e", "ansible_pipelining=%s" % pipelining])
    assert res.rc == 0, res.output[-4000:]
    assert open(os.path.join(str(tmp_path), "back", "owned-%s.txt" % pipelining)).read() == "mine\n"


def test_a_user_missing_in_the_guest_fails_and_nothing_runs_as_root(plane, sandbox, env, playbook_runner):
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: touch /workspace/ran-as-someone-else
"""
    res = playbook_runner(pb, inventory({"box": sandbox["name"]}, ansible_user="ghost-user"), env)
    assert res.rc != 0
    assert "user 'ghost-user' (ansible_user / -u / remote_user) does not exist in the guest" in res.output, res.output
    out = plane.client().request("POST", "/sessions/%s/sandbox/exec" % sandbox["session_id"],
                                 body={"argv": ["ls", "/workspace"]})
    assert "ran-as-someone-else" not in out["stdout"]


ADD_HOST = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.add_host:
        name: box
        ansible_connection: microvm.sandbox.agent
        ansible_host: "%s"
- hosts: box
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo ran
      register: r
    - ansible.builtin.debug: {msg: "PY={{ ansible_facts.discovered_interpreter_python | default('none') }}"}
    - ansible.builtin.assert: {that: ["r.stdout == 'ran'"]}
"""
LOCALHOST = 'localhost ansible_connection=local ansible_python_interpreter="{{ ansible_playbook_python }}"\n'


def test_a_host_without_an_interpreter_discovers_it_silently(plane, sandbox, env, playbook_runner):
    """add_host with only the connection and the session: the guest's Python is found, with no warning; what the user
    sets (a host var, ANSIBLE_PYTHON_INTERPRETER) still wins, and `auto` still warns."""
    pb = ADD_HOST % sandbox["name"]
    res = playbook_runner(pb, LOCALHOST, env)
    assert res.rc == 0, res
    assert "PY=/usr/bin/python3" in res.stdout, res  # discovered in the guest (once per host), silently
    assert "[WARNING]" not in res.output and "interpreter" not in res.output.lower().replace("discovered_interpreter", ""), res
    loud = playbook_runner(pb.replace('ansible_host: "', 'ansible_python_interpreter: auto\n        ansible_host: "'),
                           LOCALHOST, env)
    assert loud.rc == 0 and "discovered Python interpreter" in loud.output, loud  # the user's `auto` is kept
    pinned = playbook_runner(pb, LOCALHOST, dict(env, ANSIBLE_PYTHON_INTERPRETER="/usr/bin/python3"))
    assert pinned.rc == 0 and "PY=none" in pinned.stdout, pinned  # the user's setting: no discovery at all
