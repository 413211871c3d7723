"""The shared multiplexer: many sessions in one mux process, each with its own channel, none disturbing another.

Every test pins the pool to one process (MICROVM_MUX_PROCESSES=1), so all its sessions share it.
"""
import glob
import os
import re

import pytest

from microvm_plane_testing import mux_pids

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
