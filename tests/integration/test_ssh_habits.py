"""Playbooks written for SSH run unchanged (issue 25), through the real stack, pipelining on and off.

The behaviours ansible-core's own integration targets check (connection, async, script, file, copy,
fetch, command_shell, lineinfile, stat, unarchive, user, tempfile, become_sudo, become_su,
become_unprivileged), written anew as one playbook per group, plus the habits users carry over from SSH
inventories and ansible.cfg files: `ansible_user: root`, a `remote_tmp` outside /workspace, files from
`tempfile` used by a later run, a wrong become password, facts about the machine. Runs with the
ansible-core of the interpreter running pytest (`make test-newest` runs it with the newest core).
"""
import contextlib
import os
import re
import tarfile
import time

import pytest

from microvm_plane_testing import run_transport, stop_muxes, team

PIPELINING = pytest.mark.parametrize("pipelining", ["true", "false"])


def inventory(session, **extra):
    lines = ["[sbx]", "box ansible_host=%s" % session, "", "[sbx:vars]", "ansible_connection=microvm.sandbox.agent",
             "ansible_python_interpreter=/usr/bin/python3"]
    lines += ["%s=%s" % kv for kv in extra.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def mux_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("habits-mux"))
    yield d
    stop_muxes(d)


@pytest.fixture(scope="module")
def env(plane, mux_dir):
    return dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="60")


@pytest.fixture(scope="module")
def box(plane):
    """One session for the groups that need no passwords (each group writes under its own names)."""
    client = plane.client()
    session = client.create_session({"name": "habits-%s" % os.urandom(4).hex(), "agent": "custom"})
    try:
        yield client.wait_session(session["session_id"], timeout=120)
    finally:
        client.delete_session(session["session_id"])


@pytest.fixture(scope="module")
def passwords():
    return {"user": "pw-%s" % os.urandom(6).hex(), "root": "root-%s" % os.urandom(6).hex()}


@pytest.fixture(scope="module")
def become_box(plane, passwords):
    """A session whose `sandbox` user and root have passwords (the base template's secrets), for become."""
    client = plane.client()
    session = client.create_session({"name": "habits-become-%s" % os.urandom(4).hex(), "agent": "custom", "secrets": {
        "SANDBOX_USER_PASSWORD": passwords["user"], "SANDBOX_ROOT_PASSWORD": passwords["root"]}})
    try:
        yield client.wait_session(session["session_id"], timeout=120)
    finally:
        client.delete_session(session["session_id"])


def failures(res):
    """The failed tasks' lines of a run's output (pytest cuts long messages in the middle)."""
    lines = res.output.splitlines()
    picked = [i for i, line in enumerate(lines) if line.startswith(("fatal:", "failed:", "[ERROR]", "ERROR!"))]
    return "\n".join("\n".join(lines[max(0, i - 2):i + 12]) for i in picked)[-8000:] or res.output[-4000:]


def ok(res, ignored=0):
    assert res.rc == 0, failures(res)
    assert "failed=0" in res.stdout and "unreachable=0" in res.stdout, failures(res)
    assert ("ignored=%d" % ignored) in res.stdout, failures(res)


# ---------------------------------------------------------------------------------------------------------------
# command_shell, file, copy, fetch, lineinfile, stat, unarchive, script, user

FILES_AND_COMMANDS = r"""
- name: core targets' behaviours (pipelining {{ ansible_pipelining }})
  hosts: sbx
  gather_facts: false
  vars:
    p: "{{ ansible_pipelining }}"
    w: "/workspace/habits-{{ p }}"
    o: "/opt/habits-{{ p }}"
  tasks:
    - ansible.builtin.file: {path: "{{ w }}", state: directory}
    # -- command_shell
    - name: command takes argv, chdir and stdin
      ansible.builtin.command:
        argv: [/bin/sh, -c, 'pwd; cat; echo "$1"', sh, "an arg with spaces"]
        chdir: /etc
        stdin: from stdin
      register: c1
    - name: creates skips, removes skips
      ansible.builtin.command: {cmd: "false", creates: /etc/passwd}
      register: c2
    - ansible.builtin.command: {cmd: "false", removes: /nonexistent}
      register: c3
    - name: shell with a pipe and another executable
      ansible.builtin.shell: 'set -o pipefail; echo $0 | tr a-z A-Z'
      args: {executable: /bin/bash}
      register: c4
    - name: a failing command fails with its rc
      ansible.builtin.command: /bin/sh -c 'echo oops >&2; exit 7'
      register: c5
      ignore_errors: true
    - ansible.builtin.assert:
        that:
          - c1.stdout_lines == ['/etc', 'from stdin', 'an arg with spaces']
          - c2 is not changed and c2 is not failed
          - c3 is not changed and c3 is not failed
          - c4.stdout == '/BIN/BASH'
          - c5 is failed and c5.rc == 7 and c5.stderr == 'oops'

    # -- file
    - name: a directory, then again (no change)
      ansible.builtin.file: {path: "{{ o }}/d", state: directory, mode: "0750"}
      register: f1
    - ansible.builtin.file: {path: "{{ o }}/d", state: directory, mode: "0750"}
      register: f2
    - name: touch, symlink, hard link
      ansible.builtin.file: {path: "{{ o }}/d/t", state: touch, mode: "0604"}
    - ansible.builtin.file: {src: "{{ o }}/d/t", dest: "{{ o }}/d/sym", state: link}
    - ansible.builtin.file: {src: "{{ o }}/d/t", dest: "{{ o }}/d/hard", state: hard}
    - ansible.builtin.stat: {path: "{{ o }}/d/sym"}
      register: f3
    - ansible.builtin.stat: {path: "{{ o }}/d/hard"}
      register: f4
    - name: absent, then absent again
      ansible.builtin.file: {path: "{{ o }}/d/hard", state: absent}
      register: f5
    - ansible.builtin.file: {path: "{{ o }}/d/hard", state: absent}
      register: f6
    - name: file in check mode changes nothing
      ansible.builtin.file: {path: "{{ o }}/d/never", state: touch}
      check_mode: true
      register: f7
    - ansible.builtin.stat: {path: "{{ o }}/d/never"}
      register: f8
    - ansible.builtin.assert:
        that:
          - f1 is changed and f2 is not changed
          - f3.stat.islnk and f3.stat.lnk_source == o ~ '/d/t'
          - f4.stat.nlink == 2 and f4.stat.mode == '0604'
          - f5 is changed and f6 is not changed
          - f7 is changed and not f8.stat.exists

    # -- copy
    - name: copy content outside /workspace, then again (no change), then new content with a backup
      ansible.builtin.copy: {content: "one\n", dest: "{{ o }}/c.txt", mode: "0640"}
      register: cp1
    - ansible.builtin.copy: {content: "one\n", dest: "{{ o }}/c.txt", mode: "0640"}
      register: cp2
    - ansible.builtin.copy: {content: "two\n", dest: "{{ o }}/c.txt", backup: true, validate: "grep -q two %s"}
      register: cp3
    - name: copy in check mode with diff changes nothing
      ansible.builtin.copy: {content: "three\n", dest: "{{ o }}/c.txt"}
      check_mode: true
      diff: true
      register: cp4
    - name: copy a controller directory, and a remote file to another remote place
      ansible.builtin.copy: {src: "{{ playbook_dir }}/tree/", dest: "{{ o }}/tree/"}
      register: cp5
    - ansible.builtin.copy: {src: "{{ o }}/c.txt", dest: "{{ w }}/c-remote.txt", remote_src: true}
    - ansible.builtin.command: cat {{ o }}/c.txt {{ cp3.backup_file }} {{ o }}/tree/sub/leaf.txt {{ w }}/c-remote.txt
      register: cp6
    - ansible.builtin.assert:
        that:
          - cp1 is changed and cp2 is not changed and cp3 is changed
          - cp4 is changed and (cp4.diff[0].after | trim) == 'three'
          - cp5 is changed
          - cp6.stdout_lines == ['two', 'one', 'leaf', 'two']

    # -- fetch
    - name: fetch flat and per host, checksummed; a missing file fails
      ansible.builtin.fetch: {src: "{{ o }}/c.txt", dest: "{{ playbook_dir }}/back/flat-{{ p }}.txt", flat: true}
      register: fe1
    - ansible.builtin.fetch: {src: "{{ o }}/c.txt", dest: "{{ playbook_dir }}/back/"}
      register: fe2
    - ansible.builtin.fetch: {src: "{{ o }}/c.txt", dest: "{{ playbook_dir }}/back/flat-{{ p }}.txt", flat: true}
      register: fe3
    - ansible.builtin.fetch: {src: "{{ o }}/missing", dest: "{{ playbook_dir }}/back/"}
      register: fe4
      ignore_errors: true
    - ansible.builtin.assert:
        that:
          - fe1 is changed and fe3 is not changed
          - fe2.dest.endswith('/back/box' ~ o ~ '/c.txt')
          - lookup('file', playbook_dir ~ '/back/box' ~ o ~ '/c.txt') == 'two'
          - fe4 is failed

    # -- lineinfile
    - name: lineinfile creates, inserts, replaces with backrefs, removes; each twice
      ansible.builtin.lineinfile: {path: "{{ o }}/l.conf", line: "a=1", create: true, mode: "0644"}
      register: l1
    - ansible.builtin.lineinfile: {path: "{{ o }}/l.conf", line: "a=1"}
      register: l2
    - ansible.builtin.lineinfile: {path: "{{ o }}/l.conf", line: "first", insertbefore: BOF}
    - ansible.builtin.lineinfile: {path: "{{ o }}/l.conf", regexp: '^a=(\d+)$', line: 'a=\g<1>0', backrefs: true}
      register: l3
    - ansible.builtin.lineinfile: {path: "{{ o }}/l.conf", regexp: '^a=(\d+)$', line: 'a=\g<1>0', backrefs: true}
      register: l4
    - ansible.builtin.lineinfile: {path: "{{ o }}/l.conf", line: "first", state: absent}
      register: l5
    - ansible.builtin.slurp: {src: "{{ o }}/l.conf"}
      register: l6
    - ansible.builtin.assert:
        that:
          - l1 is changed and l2 is not changed
          - l3 is changed and l4 is changed
          - l5 is changed and l5.found == 1
          - (l6.content | b64decode).splitlines() == ['a=100']

    # -- stat
    - name: stat a missing path, a directory, a file with its checksum
      ansible.builtin.stat: {path: "{{ o }}/nope"}
      register: s1
    - ansible.builtin.stat: {path: "{{ o }}/d"}
      register: s2
    - ansible.builtin.stat: {path: "{{ o }}/c.txt", checksum_algorithm: sha256}
      register: s3
    - ansible.builtin.slurp: {src: "{{ o }}/c.txt"}
      register: s4
    - ansible.builtin.assert:
        that:
          - not s1.stat.exists
          - s2.stat.isdir and s2.stat.mode == '0750'
          - s3.stat.checksum == (s4.content | b64decode | hash('sha256'))

    # -- unarchive
    - name: unarchive a controller tar.gz outside /workspace and into it, then a remote one with creates
      ansible.builtin.unarchive: {src: "{{ playbook_dir }}/a.tar.gz", dest: "{{ o }}/d", list_files: true}
      register: u1
    - ansible.builtin.unarchive: {src: "{{ playbook_dir }}/a.tar.gz", dest: "{{ o }}/d"}
      register: u2
    - ansible.builtin.copy: {src: "{{ playbook_dir }}/a.tar.gz", dest: "{{ w }}/a.tar.gz"}
    - ansible.builtin.file: {path: "{{ w }}/x", state: directory}
    - ansible.builtin.unarchive: {src: "{{ w }}/a.tar.gz", dest: "{{ w }}/x", remote_src: true, creates: "{{ w }}/x/arch"}
      register: u3
    - ansible.builtin.unarchive: {src: "{{ w }}/a.tar.gz", dest: "{{ w }}/x", remote_src: true, creates: "{{ w }}/x/arch"}
      register: u4
    - ansible.builtin.command: cat {{ o }}/d/arch/inside.txt {{ w }}/x/arch/inside.txt
      register: u5
    - ansible.builtin.assert:
        that:
          - u1 is changed and 'arch/inside.txt' in u1.files
          - u2 is not changed
          - u3 is changed and u4 is not changed
          - u5.stdout_lines == ['inside', 'inside']

    # -- script
    - name: script with arguments, chdir and creates
      ansible.builtin.script: "{{ playbook_dir }}/s.sh 'two words' {{ p }}"
      args: {chdir: /etc}
      register: sc1
    - ansible.builtin.script: "{{ playbook_dir }}/s.sh again"
      args: {creates: /etc/passwd}
      register: sc2
    - ansible.builtin.assert:
        that:
          - sc1.rc == 0 and sc1.stdout_lines == ['/etc', 'two words', p]
          - sc2 is skipped or sc2 is not changed

    # -- user
    - name: a user with a group and a home, then removed
      ansible.builtin.user: {name: "habit{{ p }}", groups: [users], create_home: true, shell: /bin/sh}
      register: us1
    - ansible.builtin.user: {name: "habit{{ p }}", groups: [users], create_home: true, shell: /bin/sh}
      register: us2
    - ansible.builtin.command: id -Gn habit{{ p }}
      register: us3
    - ansible.builtin.user: {name: "habit{{ p }}", state: absent, remove: true}
      register: us4
    - ansible.builtin.stat: {path: "{{ us1.home }}"}
      register: us5
    - ansible.builtin.assert:
        that:
          - us1 is changed and us2 is not changed
          - "'users' in us3.stdout.split()"
          - us4 is changed and not us5.stat.exists
"""


def _controller_files(work):
    (work / "tree" / "sub").mkdir(parents=True)
    (work / "tree" / "top.txt").write_text("top\n")
    (work / "tree" / "sub" / "leaf.txt").write_text("leaf\n")
    (work / "s.sh").write_text('#!/bin/sh\npwd\nfor a in "$@"; do echo "$a"; done\n')
    src = work / "arch"
    src.mkdir()
    (src / "inside.txt").write_text("inside\n")
    with tarfile.open(str(work / "a.tar.gz"), "w:gz") as tar:
        tar.add(str(src), arcname="arch")


@PIPELINING
def test_files_and_commands(box, env, tmp_path, playbook_runner, pipelining):
    _controller_files(tmp_path)
    res = playbook_runner(FILES_AND_COMMANDS, inventory(box["name"]), env, workdir=str(tmp_path),
                          extra_args=["-e", "ansible_pipelining=%s" % pipelining])
    ok(res, ignored=2)


# ---------------------------------------------------------------------------------------------------------------
# ansible_user: root: one home; async with poll and with async_status; facts

HOME_AND_ASYNC = r"""
- name: one home for root whatever the inventory says, async (pipelining {{ ansible_pipelining }})
  hosts: sbx
  gather_facts: true
  gather_subset: [min, hardware]
  vars:
    p: "{{ ansible_pipelining }}"
  tasks:
    - name: copy and file reach the same ~/ file, and so does the shell's HOME
      ansible.builtin.copy: {content: "home\n", dest: "~/habit-home-{{ p }}.txt"}
      register: h1
    - ansible.builtin.file: {path: "~/habit-home-{{ p }}.txt", mode: "0600"}
      register: h2
    - ansible.builtin.shell: 'cat "$HOME/habit-home-{{ p }}.txt"; echo "$HOME"; stat -c %a "$HOME/habit-home-{{ p }}.txt"; echo ~root'
      register: h3
    - ansible.builtin.stat: {path: "~/habit-home-{{ p }}.txt"}
      register: h4
    - ansible.builtin.assert:
        that:
          - h1.dest == h2.path == h4.stat.path
          - h3.stdout_lines == ['home', ansible_env.HOME, '600', ansible_env.HOME]
          - ansible_user_dir == ansible_env.HOME
          - h1.dest == ansible_env.HOME ~ '/habit-home-' ~ p ~ '.txt'

    - name: async with poll
      ansible.builtin.shell: 'sleep 1; echo polled'
      async: 30
      poll: 1
      register: a1
    - name: async fire and forget, then async_status until it is done
      ansible.builtin.shell: 'sleep 2; echo later'
      async: 60
      poll: 0
      register: a2
    - ansible.builtin.async_status: {jid: "{{ a2.ansible_job_id }}"}
      register: a3
      until: a3 is finished
      retries: 30
      delay: 1
    - name: a failing async job is reported failed
      ansible.builtin.command: /bin/false
      async: 30
      poll: 1
      register: a4
      ignore_errors: true
    - name: async_status cleans up
      ansible.builtin.async_status: {jid: "{{ a2.ansible_job_id }}", mode: cleanup}
    - ansible.builtin.assert:
        that:
          - a1.stdout == 'polled'
          - a2.ansible_job_id and a2.results_file.startswith(ansible_env.HOME ~ '/.ansible_async/')
          - a3.stdout == 'later'
          - a4 is failed
        fail_msg: "async results: a1={{ a1 | to_json }} a2={{ a2 | to_json }} a3={{ a3 | to_json }}"

    - name: the facts describe the session's size and the guest's init
      ansible.builtin.assert:
        that:
          - ansible_memtotal_mb == expected_memory_mb | int
          - ansible_processor_vcpus == expected_vcpus | int
          - ansible_service_mgr == 'guest_init'
          - ansible_memfree_mb > 0 and ansible_memfree_mb <= ansible_memtotal_mb
"""


@pytest.mark.parametrize("pipelining, user", [("true", "root"), ("false", "root"), ("true", None)])
def test_one_home_async_and_facts(plane, box, env, playbook_runner, pipelining, user):
    """`ansible_user: root` (as in inventories copied from SSH) and no user at all give one home."""
    from microvm_localplane import contract
    size = [s for s in contract.SIZES if s["slug"] == (box.get("size_slug") or contract.DEFAULT_SIZE)][0]
    extra = {"ansible_user": user} if user else {}
    res = playbook_runner(HOME_AND_ASYNC, inventory(box["name"], **extra), env, extra_args=[
        "-e", "ansible_pipelining=%s" % pipelining, "-e", "expected_memory_mb=%d" % size["memory_mb"],
        "-e", "expected_vcpus=%d" % size["vcpus"]])
    ok(res, ignored=1)


# ---------------------------------------------------------------------------------------------------------------
# remote_tmp outside /workspace

REMOTE_TMP = r"""
- name: a remote_tmp outside /workspace works (pipelining {{ ansible_pipelining }})
  hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.raw: echo raw-ran
      register: r1
    - ansible.builtin.command: echo command-ran
      register: r2
    - ansible.builtin.copy: {content: "tmp\n", dest: "/workspace/habits-rtmp-{{ ansible_pipelining }}.txt"}
    - ansible.builtin.template: {src: "{{ playbook_dir }}/t.j2", dest: "/opt/habits-rtmp-{{ ansible_pipelining }}.txt"}
    - ansible.builtin.command: echo async-ran
      async: 20
      poll: 1
      register: r3
    - ansible.builtin.assert:
        that: ["'raw-ran' in r1.stdout", "r2.stdout == 'command-ran'", "'async-ran' in r3.stdout"]
"""


@pytest.mark.parametrize("pipelining, remote_tmp", [("true", "/tmp/.ansible/tmp"), ("false", "/tmp/.ansible/tmp"),
                                                    ("false", "./ansible")])
def test_remote_tmp_outside_the_workspace(box, env, tmp_path, playbook_runner, pipelining, remote_tmp):
    (tmp_path / "t.j2").write_text("{{ ansible_pipelining }}\n")
    res = playbook_runner(REMOTE_TMP, inventory(box["name"]), dict(env, ANSIBLE_REMOTE_TMP=remote_tmp),
                          workdir=str(tmp_path), extra_args=["-e", "ansible_pipelining=%s" % pipelining, "-vvv"])
    ok(res)
    if pipelining == "false" and remote_tmp.startswith("/"):  # the module files went there, staged
        assert "PUT " in res.stdout and " TO %s/ansible-tmp-" % remote_tmp in res.stdout, res


# ---------------------------------------------------------------------------------------------------------------
# tempfile: what it makes outlives the run, as over SSH

TEMPFILE_MAKE = r"""
- name: make temporary files for a later run (pipelining {{ ansible_pipelining }})
  hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.tempfile: {state: file, suffix: .habit}
      register: t1
    - ansible.builtin.tempfile: {state: directory, prefix: habit.}
      register: t2
    - ansible.builtin.copy: {content: "kept\n", dest: "{{ t1.path }}"}
    - name: everything else still gets the run's TMPDIR
      ansible.builtin.shell: 'echo "$TMPDIR"; mktemp'
      register: t3
    - ansible.builtin.assert:
        that:
          - t1.path.startswith('/tmp/') and t2.path.startswith('/tmp/')
          - t3.stdout_lines[0].startswith('/workspace/.scratch/run.')
          - t3.stdout_lines[1].startswith(t3.stdout_lines[0] ~ '/')
    - ansible.builtin.copy:
        content: "{{ {'file': t1.path, 'dir': t2.path, 'run_tmp': t3.stdout_lines[0]} | to_json }}"
        dest: "{{ playbook_dir }}/made.json"
      delegate_to: localhost
      vars: {ansible_connection: local, ansible_python_interpreter: "{{ ansible_playbook_python }}"}
"""

TEMPFILE_USE = r"""
- name: use them in another run
  hosts: sbx
  gather_facts: false
  vars:
    made: "{{ lookup('file', playbook_dir ~ '/made.json') | from_json }}"
  tasks:
    - ansible.builtin.stat: {path: "{{ made.file }}"}
      register: u1
    - ansible.builtin.stat: {path: "{{ made.dir }}"}
      register: u2
    - name: the first run's TMPDIR is gone (the mux removes it at the session's next use, this run)
      ansible.builtin.stat: {path: "{{ made.run_tmp }}"}
      register: u3
      until: not u3.stat.exists
      retries: 30
      delay: 0.5
    - ansible.builtin.fetch: {src: "{{ made.file }}", dest: "{{ playbook_dir }}/kept.txt", flat: true}
    - ansible.builtin.assert:
        that:
          - u1.stat.exists and u1.stat.isreg
          - u2.stat.exists and u2.stat.isdir
          - not u3.stat.exists
"""


@PIPELINING
def test_tempfile_results_outlive_the_run(box, env, tmp_path, playbook_runner, pipelining):
    args = ["-e", "ansible_pipelining=%s" % pipelining]
    inv = inventory(box["name"])
    ok(playbook_runner(TEMPFILE_MAKE, inv, env, workdir=str(tmp_path), extra_args=args))
    ok(playbook_runner(TEMPFILE_USE, inv, env, workdir=str(tmp_path), extra_args=args))
    assert (tmp_path / "kept.txt").read_text() == "kept\n"


# ---------------------------------------------------------------------------------------------------------------
# become_sudo, become_su, become_unprivileged

BECOME = r"""
- name: become as over SSH (pipelining {{ ansible_pipelining }})
  hosts: sbx
  gather_facts: false
  vars:
    p: "{{ ansible_pipelining }}"
  tasks:
    - name: sudo to root with the user's password, a module and a command
      ansible.builtin.command: id -un
      become: true
      vars: {ansible_become_password: "{{ user_password }}"}
      register: b1
    - ansible.builtin.copy: {content: "root's\n", dest: "/root/habit-{{ p }}", mode: "0600"}
      become: true
      vars: {ansible_become_password: "{{ user_password }}"}
    - name: su to root with root's password
      ansible.builtin.stat: {path: "/root/habit-{{ p }}"}
      become: true
      become_method: ansible.builtin.su
      vars: {ansible_become_password: "{{ root_password }}"}
      register: b2
    - name: become_unprivileged, from root to an unprivileged user (module temp files must be readable by it)
      ansible.builtin.command: id -un
      become: true
      become_user: nobody
      become_flags: "-H -S -n"
      vars: {ansible_user: root}
      register: b3
    - ansible.builtin.copy: {content: "nobody's\n", dest: "/tmp/habit-nobody-{{ p }}"}
      become: true
      become_user: nobody
      vars: {ansible_user: root}
      register: b4
    - ansible.builtin.stat: {path: "/tmp/habit-nobody-{{ p }}"}
      register: b5

    - name: a wrong sudo password fails at once with core's words
      ansible.builtin.command: id -un
      become: true
      vars: {ansible_become_password: "not-{{ user_password }}"}
      register: w1
      ignore_errors: true
    - name: a wrong su password too
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      vars: {ansible_become_password: "not-{{ root_password }}"}
      register: w2
      ignore_errors: true
    - name: a su prompt that never matches ends after the become timeout
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      vars:
        ansible_become_password: "{{ root_password }}"
        ansible_su_prompt_l10n: [Kennwort]
        ansible_become_timeout: 3
      register: w3
      ignore_errors: true
      ignore_unreachable: true
    - name: the host still works afterwards
      ansible.builtin.command: id -un
      register: after

    - ansible.builtin.assert:
        that:
          - b1.stdout == 'root'
          - b2.stat.exists and b2.stat.pw_name == 'root'
          - b3.stdout == 'nobody'
          - b4 is changed and b5.stat.pw_name == 'nobody'
          - w1 is failed and w1.msg is search('Incorrect sudo password')
          - w2 is failed and w2.msg is search('Incorrect su password')
          - w3 is unreachable or w3 is failed
          - w3.msg is search('Timed out \\(3s, option become_timeout\\) waiting for become success or become password prompt')
          - after.stdout == 'sandbox'
"""


@PIPELINING
def test_become_sudo_su_and_unprivileged(plane, become_box, passwords, env, playbook_runner, pipelining):
    """As the base template's `sandbox` user; a wrong password never hangs (the playbook runs under a timeout)."""
    started = time.monotonic()
    # su has no -S: on the api road its password prompt needs the team's interactive stdin (sudo's password goes
    # first on the one-shot stdin either way)
    streaming = team(plane, interactive_stdin=True, closed_ports=[8443]) if run_transport() == "api" else contextlib.nullcontext()
    with streaming:
        res = playbook_runner(BECOME, inventory(become_box["session_id"], ansible_user="sandbox"), env, timeout=300,
                              extra_args=["-e", "ansible_pipelining=%s" % pipelining,
                                          "-e", "user_password=%s" % passwords["user"],
                                          "-e", "root_password=%s" % passwords["root"]])
    assert res.rc == 0, failures(res)
    assert "failed=0" in res.stdout, failures(res)
    for secret in passwords.values():
        assert secret not in res.stdout + res.stderr
    assert not re.search(r"Duplicate become password prompt", res.stdout), res
    assert time.monotonic() - started < 240
