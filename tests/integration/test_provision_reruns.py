"""Fresh checkpoints on a rerun (issue 42): the provision playbook retakes its checkpoint when the session changed.

A kept session provisioned again must not leave its label on the state of an older run: the fan-out that follows
would test that older state. One session, five provision runs and one fan-out, through the real stack:
ansible-playbook -> microvm.sandbox.provision (role_digest lookup, checkpoint module) -> local plane -> guest.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roles_util import LOCALHOST, markers, runner, unique  # noqa: E402

ROLE_TASKS = """---
- name: Write the version
  ansible.builtin.copy:
    content: "{{ prov_version }}\\n"
    dest: /workspace/version.txt
    mode: "0644"
- name: Write the stamp (from the environment, which is not an input the controller can digest)
  ansible.builtin.copy:
    content: "{{ lookup('ansible.builtin.env', 'PROV_STAMP') }}\\n"
    dest: /workspace/stamp.txt
    mode: "0644"
"""

FORK_READ_PLAY = """
- ansible.builtin.import_playbook: microvm.sandbox.fanout

- name: Read the version in the copy
  hosts: microvm_forks
  gather_facts: false
  tasks:
    - name: Read it
      ansible.builtin.command: cat /workspace/version.txt
      register: seen
      changed_when: false
    - name: Report
      ansible.builtin.debug:
        msg: "VERSION={{ seen.stdout | to_json }}"

- name: Delete the copies
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Delete them
      microvm.sandbox.session_fork:
        source: "{{ session_name }}"
        checkpoint: "{{ checkpoint_label }}"
        state: absent
"""


def write_role(roles_dir, version, comment=""):
    tasks = roles_dir / "prov" / "tasks"
    defaults = roles_dir / "prov" / "defaults"
    tasks.mkdir(parents=True, exist_ok=True)
    defaults.mkdir(parents=True, exist_ok=True)
    (tasks / "main.yml").write_text(ROLE_TASKS + comment)
    (defaults / "main.yml").write_text("---\nprov_version: %s\n" % version)


@pytest.fixture(scope="module")
def rerun_env(plane, tmp_path_factory):
    base = tmp_path_factory.mktemp("reruns")
    roles = base / "roles"
    return dict(plane.env, MICROVM_MUX_DIR=str(base / "mux"), MICROVM_PERSIST="20", ANSIBLE_ROLES_PATH=str(roles)), roles


def test_provision_retakes_its_checkpoint_when_the_session_changed_and_fanout_forks_the_new_one(plane, rerun_env,
                                                                                                tmp_path):
    env, roles = rerun_env
    run_playbook = runner()
    name = unique("rerun")
    client = plane.client()

    def provision(stamp, expect_retake):
        res = run_playbook("- ansible.builtin.import_playbook: microvm.sandbox.provision\n", LOCALHOST,
                           dict(env, PROV_STAMP=stamp),
                           extra_args=["-e", "session_name=%s" % name, "-e", "session_template=base",
                                       "-e", "provision_role=prov", "-e", "checkpoint_label=deps"], workdir=str(tmp_path))
        assert res.rc == 0, res.output[-5000:]
        sid = client.find_session(name)["session_id"]
        cps = [c for c in client.list_checkpoints(sid) if c.get("label") == "deps"]
        assert len(cps) == 1, cps  # a retake replaces the older checkpoint with the label
        task = res.stdout.split("TASK [Take the checkpoint")[1].split("TASK [")[0]
        assert ("changed: [localhost]" in task) == expect_retake, (stamp, expect_retake, task)
        return cps[0]["checkpoint_id"]

    try:
        write_role(roles, "v1")
        first = provision("a", True)
        assert provision("a", False) == first, "an unchanged rerun must keep the checkpoint"
        write_role(roles, "v1", comment="# a comment: the role's files changed, nothing it does\n")
        third = provision("a", True)
        assert third != first, "a change in the role's files retakes the checkpoint"
        fourth = provision("b", True)
        assert fourth != third, "a change the role reported retakes the checkpoint"
        write_role(roles, "v2")
        fifth = provision("b", True)
        assert fifth != fourth

        res = run_playbook(FORK_READ_PLAY, LOCALHOST, env, workdir=str(tmp_path),
                           extra_args=["-e", "session_name=%s" % name, "-e", "checkpoint_label=deps",
                                       "-e", "fanout_count=1"])
        assert res.rc == 0, res.output[-5000:]
        assert markers(res.stdout, "VERSION") == ["v2"], res.stdout[-3000:]
    finally:
        session = client.find_session(name)
        if session:
            client.delete_session(session["session_id"])
