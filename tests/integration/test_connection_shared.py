"""The shared multiplexer: many sessions in one mux process, each with its own channel, none disturbing another.

Every test pins the pool to one process (MICROVM_MUX_PROCESSES=1), so all its sessions share it.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import process_dir
from microvm_plane_testing import mux_pids, stop_muxes

from test_connection import inventory, mux_dir, new_session  # noqa: F401  (fixtures are re-used)

_REUSED_FIXTURES = (mux_dir,)

PAUSE = """{{ ansible_playbook_python }} -c "import os;
        from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient;
        c = ApiClient(os.environ['DO_AGENTS_API_URL'], os.environ['DO_AGENTS_API_TOKEN']);
        c.pause_session('%(sid)s'); c.wait_session('%(sid)s', until={'PAUSED'}, timeout=60)\""""
DELETE = """{{ ansible_playbook_python }} -c "import os;
        from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient;
        c = ApiClient(os.environ['DO_AGENTS_API_URL'], os.environ['DO_AGENTS_API_TOKEN']);
        c.delete_session('%(sid)s'); c.wait_session('%(sid)s', until={'DESTROYED'}, timeout=60, gone_ok=True)\""""


@pytest.fixture
def env(plane, mux_dir):  # noqa: F811
    return dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30", MICROVM_MUX_PROCESSES="1")


@pytest.fixture
def pair(plane):
    """Two READY sessions, a and b, deleted after the test."""
    made = [new_session(plane, "pair-a"), new_session(plane, "pair-b")]
    yield made
    client = plane.client()
    for s in made:
        try:
            client.delete_session(s["session_id"])
        except Exception:  # already deleted by the test
            pass


def recap(res, host):
    line = [x for x in res.stdout.splitlines() if x.startswith(host + " ") and "ok=" in x]
    assert line, res
    return dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", line[0]))


def mux_log(mux_dir):  # noqa: F811
    return "".join(open(p).read() for p in glob.glob(os.path.join(mux_dir, "*", "mux.log")))


def troubled_play(action):
    """Host a gets into trouble (`action` on it) after its first task; b runs six tasks throughout."""
    return """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo first
    - name: trouble for a
      ansible.builtin.command: >-
        %s
      delegate_to: localhost
      when: inventory_hostname == 'a'
      vars: {ansible_connection: local, ansible_python_interpreter: "{{ ansible_playbook_python }}"}
    - ansible.builtin.shell: "echo {{ inventory_hostname }} >> /workspace/after.txt"
    - ansible.builtin.copy: {content: "x\\n", dest: /workspace/copied.txt}
    - ansible.builtin.command: cat /workspace/after.txt
      register: after
    - ansible.builtin.assert: {that: ["after.stdout == inventory_hostname"]}
""" % action


def test_two_sessions_share_one_process_with_their_own_channels(pair, env, mux_dir, playbook_runner):  # noqa: F811
    a, b = pair
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.copy: {content: "{{ inventory_hostname }}\\n", dest: /workspace/who}
    - ansible.builtin.command: cat /workspace/who
      register: who
    - ansible.builtin.assert: {that: ["who.stdout == inventory_hostname"]}
"""
    res = playbook_runner(pb, inventory({"a": a["name"], "b": b["session_id"]}), env, extra_args=["-f", "2"])
    assert res.rc == 0, res
    assert len(mux_pids(mux_dir)) == 1
    log = mux_log(mux_dir)
    assert "session %s (%s): link 1 open" % (a["name"], a["session_id"]) in log, log
    assert "session %s (%s): link 1 open" % (b["name"], b["session_id"]) in log, log


def test_a_deleted_session_leaves_the_other_sessions_tasks_alone(plane, pair, env, mux_dir, playbook_runner):  # noqa: F811
    a, b = pair
    res = playbook_runner(troubled_play(DELETE % {"sid": a["session_id"]}),
                          inventory({"a": a["name"], "b": b["name"]}), env, extra_args=["-f", "2"])
    assert "UNREACHABLE!" in res.stdout, res.stdout[-4000:]
    assert a["name"] in res.stdout, res.stdout[-4000:]  # reported by name
    assert recap(res, "a")["unreachable"] == 1
    assert recap(res, "b") == dict(recap(res, "b"), ok=5, skipped=1, failed=0, unreachable=0), res
    assert len(mux_pids(mux_dir)) == 1  # the shared process stays up for b


def test_a_paused_session_is_woken_without_disturbing_the_other(plane, pair, env, playbook_runner):
    a, b = pair
    res = playbook_runner(troubled_play(PAUSE % {"sid": a["session_id"]}),
                          inventory({"a": a["name"], "b": b["name"]}), env, extra_args=["-f", "2"])
    assert res.rc == 0, res
    assert recap(res, "a") == dict(recap(res, "a"), ok=6, failed=0, unreachable=0), res
    assert recap(res, "b") == dict(recap(res, "b"), ok=5, skipped=1, failed=0, unreachable=0), res


def test_reset_connection_resets_only_its_own_session(pair, env, mux_dir, playbook_runner):  # noqa: F811
    a, b = pair
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo before
- hosts: a
  gather_facts: false
  tasks:
    - ansible.builtin.meta: reset_connection
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo after
"""
    res = playbook_runner(pb, inventory({"a": a["name"], "b": b["name"]}), env, extra_args=["-f", "2"])
    assert res.rc == 0, res
    log = mux_log(mux_dir)
    label_a = "%s (%s)" % (a["name"], a["session_id"])
    label_b = "%s (%s)" % (b["name"], b["session_id"])
    assert "session %s: link 1 closed (reset_connection)" % label_a in log, log
    assert "session %s: link 2 open" % label_a in log, log
    assert "session %s: link 1 open" % label_b in log and "session %s: link 1 closed" % label_b not in log, log
    assert "session %s: link 2" % label_b not in log, log
    assert len(mux_pids(mux_dir)) == 1


def test_different_tokens_never_share_a_channel(plane, pair, env, mux_dir, playbook_runner):  # noqa: F811
    """A wrong token for a session whose channel is open under the right one is refused, not let through."""
    a = pair[0]
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo hi
"""
    inv = inventory({"a": a["name"]})
    assert playbook_runner(pb, inv, env).rc == 0
    res = playbook_runner(pb, inv, dict(env, DO_AGENTS_API_TOKEN="wrong-" + plane.token[:8]))
    assert res.rc != 0 and "UNREACHABLE!" in res.stdout, res
    assert "401" in res.stdout, res
    assert plane.token not in res.stdout + mux_log(mux_dir)


def label(session: dict) -> str:
    return "%s (%s)" % (session["name"], session["session_id"])


def test_tasks_further_apart_than_persist_keep_one_link_and_one_runner_for_the_run(pair, env, mux_dir,  # noqa: F811
                                                                                    playbook_runner):
    """A link and its warm runner live as long as the run that uses them: one host's tasks 4 s apart with persist
    at 2 s open one link and start one runner per session; persist counts from the run's end, then the link
    closes (a fleet's linear play round over hundreds of hosts is longer than persist)."""
    a, b = pair
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo one
    - ansible.builtin.pause: {seconds: 4}
    - ansible.builtin.command: echo two
    - ansible.builtin.pause: {seconds: 4}
    - ansible.builtin.stat: {path: /workspace}
"""
    res = playbook_runner(pb, inventory({"a": a["name"], "b": b["name"]}), dict(env, MICROVM_PERSIST="2"),
                          extra_args=["-f", "2"])
    assert res.rc == 0, res
    log_path = os.path.join(process_dir(mux_dir, 0), "mux.log")
    for session in (a, b):
        log = mux_log(mux_dir)
        name = re.escape(label(session))
        assert len(re.findall(r"session %s: link \d+ open" % name, log)) == 1, log
        assert len(re.findall(r"session %s: warm runner for \S+ started" % name, log)) == 1, log
        closed = wait_for_log(log_path, r"session %s: link 1 closed \(idle for 2s after its last run\)" % name)
        assert closed, mux_log(mux_dir)


def wait_for_log(path, pattern, seconds=60):
    """The mux log's first match of pattern, waiting for it as long as `seconds` (None if it never came)."""
    deadline = time.monotonic() + seconds
    while True:
        with open(path) as f:
            found = re.search(pattern, f.read())
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_a_session_paused_once_the_run_ended_stays_paused_and_its_tmpdir_goes_at_its_next_use(plane, sandbox, env,
                                                                                               mux_dir,  # noqa: F811
                                                                                               playbook_runner):
    """Housekeeping never wakes a paused session (any input resumes one): the user pauses the session the moment
    the playbook ended; the run's TMPDIR is not removed then but at the link's close (persist later), where the
    session is found paused, so it is left, and the session stays PAUSED; the next run (which wakes it) removes it."""
    sid = sandbox["session_id"]
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: printenv TMPDIR
      register: t
    - ansible.builtin.debug: {msg: "TMP={{ t.stdout }}="}
"""
    inv = inventory({"box": sandbox["name"]})
    res = playbook_runner(pb, inv, dict(env, MICROVM_PERSIST="8"))
    assert res.rc == 0, res
    client = plane.client()
    client.pause_session(sid)
    client.wait_session(sid, until={"PAUSED", "SESSION_STATUS_PAUSED"}, timeout=60)
    run_dir = re.search(r"TMP=(\S+?)=", res.stdout).group(1)
    log_path = os.path.join(process_dir(mux_dir, 0), "mux.log")
    assert wait_for_log(log_path, r"session %s: link 1 closed" % re.escape(label(sandbox))), mux_log(mux_dir)
    assert "%s is left to a later sweep" % run_dir in mux_log(mux_dir)
    assert plane.client().get_session(sid)["status"].endswith("PAUSED")
    check = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: the dir goes as the session is used again (the new link's sweep, beside this task)
      ansible.builtin.stat: {path: "%s"}
      register: s
      until: not s.stat.exists
      retries: 30
      delay: 0.5
""" % run_dir
    res = playbook_runner(check, inv, env)
    assert res.rc == 0, res


def test_each_session_of_a_run_gets_its_own_tmpdir_removed_after_the_run(pair, env, mux_dir, playbook_runner):  # noqa: F811
    """One run, two sessions: each gets one TMPDIR for the whole run (same for every task), and the mux
    removes both once ansible-playbook is gone."""
    a, b = pair
    pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: printenv TMPDIR
      register: first
    - ansible.builtin.shell: 'printenv TMPDIR; test -d "$TMPDIR" && echo exists'
      register: second
    - ansible.builtin.assert:
        that:
          - "first.stdout.startswith('/workspace/.scratch/run.')"
          - "second.stdout_lines == [first.stdout, 'exists']"
    - ansible.builtin.debug: {msg: "TMP {{ inventory_hostname }}={{ first.stdout }}="}
"""
    inv = inventory({"a": a["name"], "b": b["name"]})
    res = playbook_runner(pb, inv, env, extra_args=["-f", "2"])
    assert res.rc == 0, res
    dirs = dict(re.findall(r"TMP (\w+)=(\S+?)=", res.stdout))
    assert set(dirs) == {"a", "b"}, res
    log = mux_log(mux_dir)
    for host, session in (("a", a), ("b", b)):
        created = re.findall(r"session %s: run (\S+): TMPDIR (\S+) created" % re.escape(label(session)), log)
        assert len(created) == 1, log  # once per run and session, not per task
        assert created[0][1] == dirs[host], log
    check = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.stat: {path: "{{ tmp[inventory_hostname] }}"}
      register: s
      until: not s.stat.exists
      retries: 60
      delay: 1
"""
    res = playbook_runner(check, inv, env, extra_args=["-f", "2", "-e", json.dumps({"tmp": dirs})])
    assert res.rc == 0, res
    log = mux_log(mux_dir)
    for host, session in (("a", a), ("b", b)):
        assert "session %s: run" % label(session) in log
        assert re.search(r"session %s: run \S+ ended: removed %s" % (re.escape(label(session)), re.escape(dirs[host])),
                         log), log


PEER = r"""
import socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
print("CONNECTED")
body = b'{"op": "hello"}'
got = b""
try:
    s.sendall(struct.pack("!IB", len(body), 1) + body)
    s.settimeout(60)
    while b'"version"' not in got:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
except (BrokenPipeError, ConnectionResetError):
    pass
print("ANSWERED" if b'"version"' in got else "REFUSED", len(got))
"""


def test_a_peer_of_another_uid_is_refused_by_the_mux_itself(sandbox, plane, playbook_runner):
    """With the socket's file mode relaxed so another uid can connect at all, the mux still refuses it
    (SO_PEERCRED): the peer check, not only the 0600 mode, keeps other local users out."""
    if os.getuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run a client as another uid")
    # /var/tmp, not pytest's tmp dir: the other uid must be able to reach the socket through its parents
    base = tempfile.mkdtemp(prefix="mux-peer-", dir="/var/tmp")
    try:
        env = dict(plane.env, MICROVM_MUX_DIR=base, MICROVM_PERSIST="600", MICROVM_MUX_PROCESSES="1")
        pb = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo up
"""
        res = playbook_runner(pb, inventory({"box": sandbox["name"]}), env)
        assert res.rc == 0, res
        assert len(mux_pids(base)) == 1
        proc_dir = process_dir(base, 0)
        sock = os.path.join(proc_dir, mp.SOCKET_NAME)
        for path, mode in ((base, 0o711), (proc_dir, 0o711), (sock, 0o666)):
            os.chmod(path, mode)
        ours = subprocess.run(["/usr/bin/python3", "-c", PEER, sock], capture_output=True, text=True, cwd="/",
                              timeout=120, check=False)
        assert ours.stdout.split()[:2] == ["CONNECTED", "ANSWERED"], ours  # the probe itself works
        other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                "/usr/bin/python3", "-c", PEER, sock], capture_output=True, text=True, cwd="/",
                               timeout=120, check=False)
        assert other.returncode == 0 and other.stdout.split() == ["CONNECTED", "REFUSED", "0"], other  # in, then dropped
        assert "refused a connection from uid 65534" in mux_log(base)
        assert len(mux_pids(base)) == 1  # and the mux serves on
    finally:
        stop_muxes(base)
        shutil.rmtree(base, ignore_errors=True)
