"""Faults of the shared multiplexer: killed under tasks of several sessions, and one session's WebSocket cut
while another's tasks run in the same process."""
import os
import re
import signal
import threading
import time

import pytest

from microvm_plane_testing import mux_pids, unique_name


@pytest.fixture
def sessions(plane):
    """sessions(n): n READY sessions, deleted after the test."""
    client = plane.client()
    made = []

    def make(n):
        ids = [client.create_session({"name": unique_name("shared"), "agent": "custom"})["session_id"]
               for _count in range(n)]
        made.extend(ids)
        return [client.wait_session(sid, timeout=120) for sid in ids]

    yield make
    for sid in made:
        try:
            client.delete_session(sid)
        except Exception:  # already gone
            pass


def inventory(hosts):
    lines = ["[sbx]"] + ["%s ansible_host=%s" % (name, s["session_id"]) for name, s in hosts.items()]
    lines += ["", "[sbx:vars]", "ansible_connection=microvm.sandbox.agent", "ansible_python_interpreter=/usr/bin/python3"]
    return "\n".join(lines) + "\n"


def guest(plane, sid, script):
    return plane.client().request("POST", "/sessions/%s/sandbox/exec" % sid, body={"argv": ["sh", "-c", script]})


def recap(res, host):
    line = [x for x in res.stdout.splitlines() if x.startswith(host + " ") and "ok=" in x]
    assert line, res
    return dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", line[0]))


LONG = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.shell: "echo run >> /workspace/runs.txt; sleep 20"
"""
NEXT = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: cat /workspace/runs.txt
      register: runs
    - ansible.builtin.assert: {that: ["runs.stdout == 'run'"]}
"""


def test_killed_mux_reports_every_inflight_command_lost_and_reruns_none(plane, sessions, mux_dir, run_playbook):
    boxes = dict(zip("abc", sessions(3)))
    env = dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30", MICROVM_MUX_PROCESSES="1")
    result = {}
    play = threading.Thread(target=lambda: result.update(res=run_playbook(LONG, inventory(boxes), env,
                                                                          extra_args=["-f", "3"])))
    play.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # every command has started in its guest
        if all(guest(plane, s["session_id"], "cat /workspace/runs.txt 2>/dev/null")["stdout"] == "run\n"
               for s in boxes.values()):
            break
        time.sleep(0.5)
    pids = mux_pids(mux_dir)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    play.join(180)
    res = result["res"]
    assert res.rc == 4, res
    for host in boxes:
        assert recap(res, host)["unreachable"] == 1, res
    assert res.stdout.count("not re-run") >= 3, res

    again = run_playbook(NEXT, inventory(boxes), env, extra_args=["-f", "3"])
    assert again.rc == 0, again  # a new mux serves them, and no command ran twice
    assert mux_pids(mux_dir) and mux_pids(mux_dir) != pids


CUT_ONE = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.raw: "{{ 'echo run >> /workspace/runs.txt; head -c 4000000 /dev/zero; sleep 1'
                               if inventory_hostname == 'a' else 'sleep 2; echo small' }}"
    - ansible.builtin.command: echo two
    - ansible.builtin.copy: {content: "three\\n", dest: /workspace/three.txt}
    - ansible.builtin.command: cat /workspace/three.txt
      register: three
    - ansible.builtin.assert: {that: ["three.stdout == 'three'"]}
"""


def test_a_cut_session_leaves_the_other_sessions_tasks_alone(plane, sessions, proxy, mux_dir, run_playbook):
    boxes = dict(zip("ab", sessions(2)))
    env = {"DO_AGENTS_API_URL": proxy.url, "DO_AGENTS_API_TOKEN": plane.token, "MICROVM_MUX_DIR": mux_dir,
           "MICROVM_PERSIST": "20", "MICROVM_CONNECT_TIMEOUT": "20", "MICROVM_MUX_PROCESSES": "1"}
    proxy.cut_ws(down=256 * 1024)   # a's WebSocket: the only one carrying that much output
    res = run_playbook(CUT_ONE, inventory(boxes), env, extra_args=["-f", "2"])
    assert proxy.cuts == ["cut-down"], proxy.cuts
    assert recap(res, "a")["unreachable"] == 1 and "not re-run" in res.stdout, res
    assert recap(res, "b") == dict(recap(res, "b"), ok=5, failed=0, unreachable=0), res
    assert guest(plane, boxes["a"]["session_id"], "cat /workspace/runs.txt")["stdout"] == "run\n"
