"""The connection over `transport: api` (the documented exec and file API) through the real stack.

The tests imported from the agent road's suites (test_connection.py, test_sync.py) run here again with
MICROVM_TRANSPORT=api: a representative subset, because every test there boots guests and runs
ansible-playbook (the whole suites twice would double the slowest part of the run). The rest here is
what only this road has: its refusals, the team's interactive stdin, and a run with the agent port closed.
"""
import contextlib
import glob
import os

import pytest
from test_connection import (  # noqa: F401  (collected again here, with this module's `env`)  # pylint: disable=unused-import
    BIG,
    inventory,
    sha1,
    test_battery_pipelining_on_and_off,
    test_become_with_passwords_as_the_unprivileged_user,
    test_command_timeout_names_the_timeout,
    test_deleted_during_a_command_is_lost_not_rerun,
    test_tasks_run_as_the_requested_user,
)

from microvm_localplane import dataplane
from microvm_plane_testing import stop_muxes


@pytest.fixture
def mux_dir(tmp_path):
    d = str(tmp_path / "mux")
    yield d
    stop_muxes(d)


@contextlib.contextmanager
def team(plane, **values):
    """The local plane's team switches for one test (interactive stdin, closed guest ports), then back."""
    dataplane.write_settings(plane.state_dir, **values)
    try:
        yield
    finally:
        dataplane.write_settings(plane.state_dir, interactive_stdin=False, closed_ports=[])


@pytest.fixture
def env(plane, mux_dir):
    """Every test of this module runs on the api road, for a team with interactive stdin, the agent port closed."""
    with team(plane, interactive_stdin=True, closed_ports=[8443]):
        yield dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30", MICROVM_TRANSPORT="api")


ROAD = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo on the api road
      register: r
    - ansible.builtin.copy: {content: "x\n", dest: /etc/microvm-api-road}
    - ansible.builtin.slurp: {src: /etc/microvm-api-road}
      register: s
    - ansible.builtin.assert:
        that: ["r.stdout == 'on the api road'", "s.content | b64decode == 'x\n'"]
"""


def test_agent_road_is_refused_but_api_and_auto_work(plane, sandbox, env, playbook_runner):
    """With guest port 8443 closed (the plane's team setting), agent fails, api and auto run the play."""
    inv = inventory({"box": sandbox["session_id"]})
    res = playbook_runner(ROAD, inv, dict(env, MICROVM_TRANSPORT="agent", MICROVM_CONNECT_TIMEOUT="5"))
    assert res.rc != 0 and "unreachable=1" in res.stdout, res
    for transport in ("api", "auto"):
        res = playbook_runner(ROAD, inv, dict(env, MICROVM_TRANSPORT=transport), extra_args=["-vvv"])
        assert res.rc == 0 and "failed=0" in res.stdout, res
        assert "WARM RUNNER" not in res.stdout or "running cold" in res.stdout


BECOME = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.sudo
      vars: {ansible_become_password: "{{ user_password }}"}
"""


def test_become_with_a_password_names_the_team_setting_without_interactive_stdin(plane, env, playbook_runner):
    client = plane.client()
    password = "pw-%s" % os.urandom(6).hex()
    session = client.create_session({"name": "api-become-%s" % os.urandom(4).hex(), "agent": "custom",
                                     "secrets": {"SANDBOX_USER_PASSWORD": password}})
    try:
        client.wait_session(session["session_id"], timeout=120)
        inv = inventory({"box": session["session_id"]}, ansible_user="sandbox")
        with team(plane, interactive_stdin=False, closed_ports=[8443]):
            res = playbook_runner(BECOME, inv, env, extra_args=["-e", "user_password=%s" % password])
        assert res.rc != 0, res
        assert "interactive stdin (keep_stdin_open)" in res.stdout and "Nothing was run" in res.stdout, res
        assert password not in res.stdout + res.stderr
    finally:
        client.delete_session(session["session_id"])


LONG_STDIN = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - name: a module payload bigger than one request's one-shot stdin is staged, then piped
      ansible.builtin.copy: {content: "{{ lookup('ansible.builtin.file', playbook_dir ~ '/blob.txt') }}", dest: /workspace/blob.txt}
    - ansible.builtin.stat: {path: /workspace/blob.txt, checksum_algorithm: sha1}
      register: st
    - ansible.builtin.debug: {msg: "REMOTE={{ st.stat.checksum }}"}
"""


def test_a_payload_too_big_for_one_shot_stdin_is_staged(plane, sandbox, env, tmp_path, playbook_runner):
    import hashlib
    work = tmp_path / "work"
    work.mkdir()
    text = (os.urandom(600 * 1024).hex()[:900 * 1024])
    (work / "blob.txt").write_text(text)
    with team(plane, interactive_stdin=False, closed_ports=[8443]):
        res = playbook_runner(LONG_STDIN, inventory({"box": sandbox["session_id"]}), env, workdir=str(work))
    assert res.rc == 0, res
    assert "REMOTE=%s" % hashlib.sha1(text.encode()).hexdigest() in res.stdout, res


def test_auto_keeps_the_agent_road_when_the_agent_answers(plane, sandbox, env, playbook_runner):
    """auto with the agent port open: the agent road (its warm runner runs the modules), not the api."""
    with team(plane, interactive_stdin=False, closed_ports=[]):
        res = playbook_runner(ROAD, inventory({"box": sandbox["session_id"]}), dict(env, MICROVM_TRANSPORT="auto"),
                              extra_args=["-vvv"])
    assert res.rc == 0 and "failed=0" in res.stdout, res
    assert "WARM RUNNER ran the module" in res.stdout and "the api transport has no warm runner" not in res.stdout, res


def test_big_files_within_the_streaming_bound_both_ways_and_a_clear_refusal_past_it(plane, sandbox, env, tmp_path,
                                                                                    playbook_runner):
    """The documented streaming download stops at about 50 MiB (larger payloads are staged transfers, which the
    api road does not do yet): 40 MiB go both ways intact; 60 MiB go up, and their fetch fails naming the bound
    and the road that carries it (transport agent), leaving no partial file behind."""
    for size, fits in ((40, True), (60, False)):
        work = tmp_path / ("work%d" % size)
        work.mkdir()
        with open(work / "big.bin", "wb") as f:
            for _dummy in range(size):
                f.write(os.urandom(1 << 20))
        want = sha1(work / "big.bin")
        res = playbook_runner(BIG, inventory({"box": sandbox["session_id"]}), env, workdir=str(work))
        if fits:
            assert res.rc == 0, res
            assert "UP=%s REMOTE=%s DOWN=%s" % (want, want, want) in res.stdout, res
            assert sha1(work / "big.back") == want
        else:
            assert res.rc != 0, res
            assert "REMOTE=" not in res.stdout
            assert "52428800 bytes" in res.stdout and "guest agent" in res.stdout, res
            assert not (work / "big.back").exists()
        assert not glob.glob(str(work / ".*.part")), "no partial download left behind"
