"""Secrets at -vvvv everywhere a run writes, and a control plane restart under a live mux."""
import glob
import json
import os
import signal
import stat
import uuid

import pytest

from microvm_plane_testing import start_local_plane, stop_local_plane, stop_muxes, unique_name

from faultproxy import FaultProxy


def inventory(session, **extra):
    lines = ["[sbx]", "box ansible_host=%s" % session, "", "[sbx:vars]",
             "ansible_connection=microvm.sandbox.agent", "ansible_python_interpreter=/usr/bin/python3"]
    return "\n".join(lines + ["%s=%s" % kv for kv in extra.items()]) + "\n"


SECRET_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: Work with a staged credential, then fail
      block:
        - ansible.builtin.include_role:
            name: microvm.sandbox.credentials
          vars:
            credentials_files:
              - path: .netrc
                content: "machine example login me password {{ secret }}\\n"
        - name: Use it
          ansible.builtin.command: "grep -c password {{ credentials_env.HOME }}/.netrc"
          environment: "{{ credentials_env }}"
        - ansible.builtin.copy: {content: "work\\n", dest: /workspace/work.txt}
        - ansible.builtin.fail: {msg: the work failed}
      always:
        - ansible.builtin.include_role:
            name: microvm.sandbox.credentials
            tasks_from: cleanup
    - name: Never reached
      ansible.builtin.debug: {msg: unreachable}
"""


def test_token_and_credential_never_written_anywhere(plane, sandbox, mux_dir, tmp_path, run_playbook):
    secret = "cred-" + uuid.uuid4().hex
    secrets = tmp_path / "secrets.json"   # a vars file: -vvvv prints -e key=value arguments
    secrets.write_text(json.dumps({"secret": secret}))
    log_path = tmp_path / "ansible.log"
    (tmp_path / "run").mkdir()
    env = dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="20", ANSIBLE_LOG_PATH=str(log_path),
               ANSIBLE_KEEP_REMOTE_FILES="0")
    res = run_playbook(SECRET_PLAY, inventory(sandbox["name"]), env, extra_args=["-vvvv", "-e", "@%s" % secrets],
                       workdir=str(tmp_path / "run"))
    assert res.rc == 2 and "the work failed" in res.stdout, res
    assert log_path.stat().st_size > 0

    places = {"stdout": res.stdout, "stderr": res.stderr, "ANSIBLE_LOG_PATH": log_path.read_text(errors="replace")}
    if plane.state_dir:
        places["plane.log"] = open(os.path.join(plane.state_dir, "plane.log"), errors="replace").read()
    for root in (mux_dir, res.workdir):
        for dirpath, _dirnames, files in os.walk(root):
            for name in files:
                path = os.path.join(dirpath, name)
                if name == "secrets.json" or stat.S_ISSOCK(os.lstat(path).st_mode):
                    continue
                places[path] = open(path, "rb").read().decode("utf-8", "replace")
    assert any(p.endswith("mux.log") for p in places), sorted(places)
    for where, text in places.items():
        assert plane.token not in text, "the API token leaked into %s" % where
        assert secret not in text, "the staged credential leaked into %s" % where

    # the mux's socket is private (also tests/unit/plugins/plugin_utils/test_mux.py::test_socket_is_0600_in_a_0700_dir)
    socks = glob.glob(os.path.join(mux_dir, "*", "mux.sock"))
    assert socks
    for sock in socks:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700
    # and nothing of the credential is left in the guest after the failed play
    left = plane.client().request("POST", "/sessions/%s/sandbox/exec" % sandbox["session_id"],
                                  body={"argv": ["sh", "-c", "ls -A /workspace/.scratch | grep -c '^credentials' ; "
                                                 "grep -rl %s /workspace || true" % secret]})
    assert left["stdout"].split() == ["0"], left


RESTART_TASKS = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.shell: "echo {{ step }} >> /workspace/steps.txt"
    - ansible.builtin.copy: {content: "{{ step }}\\n", dest: "/workspace/copied-{{ step }}.txt"}
    - ansible.builtin.command: cat /workspace/steps.txt
      register: steps
    - ansible.builtin.debug: {msg: "STEPS={{ steps.stdout_lines | join(',') }}"}
"""


@pytest.mark.parametrize("how", ["graceful", "crash"])
def test_plane_restart_keeps_sessions_and_the_next_task_works(tmp_path, mux_dir, how, run_playbook):
    state = str(tmp_path / "plane")
    os.makedirs(state)
    handle = start_local_plane(state)
    proxy = FaultProxy(handle.url).start()   # a stable URL for the client across the restart's new port
    try:
        client = handle.client()
        name = unique_name("restart")
        sid = client.create_session({"name": name, "agent": "custom"})["session_id"]
        client.wait_session(sid, timeout=120)
        env = {"DO_AGENTS_API_URL": proxy.url, "DO_AGENTS_API_TOKEN": handle.token, "MICROVM_MUX_DIR": mux_dir,
               "MICROVM_PERSIST": "60", "MICROVM_TRANSPORT": "agent"}
        first = run_playbook(RESTART_TASKS, inventory(name), env, extra_args=["-e", "step=one"])
        assert first.rc == 0 and "STEPS=one" in first.stdout, first
        mux_before = glob.glob(os.path.join(mux_dir, "*", "mux.pid"))
        assert mux_before, "the first run left no mux to carry across the restart"

        if how == "graceful":
            stop_local_plane(handle)
        else:
            handle.process.send_signal(signal.SIGKILL)
            handle.process.wait(10)
        handle = start_local_plane(state, token=handle.token)
        proxy.set_upstream(handle.url)

        second = run_playbook(RESTART_TASKS, inventory(name), env, extra_args=["-e", "step=two"])
        assert second.rc == 0 and "STEPS=one,two" in second.stdout, second
        session = handle.client().get_session(sid)
        assert session["name"] == name and session["status"].endswith("READY"), session
        got = handle.client().request("POST", "/sessions/%s/sandbox/exec" % sid,
                                      body={"argv": ["cat", "/workspace/copied-one.txt", "/workspace/copied-two.txt"]})
        assert got["stdout"] == "one\ntwo\n", got
    finally:
        stop_muxes(mux_dir)
        proxy.stop()
        stop_local_plane(handle)
