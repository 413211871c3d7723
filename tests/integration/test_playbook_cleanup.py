"""The shipped playbooks leave nothing running whatever happens to the work (issue 29), and reruns on a kept
session with a retaken checkpoint fork this run's state, not the first run's."""
import os
import textwrap

import pytest

from roles_util import LOCALHOST, runner, unique

GONE = ("DESTROYING", "DESTROYED")

ROLES = {
    "fails_inside": "- name: Fail inside the sandbox\n  ansible.builtin.command: sh -c 'exit 3'\n",
    "writes_version": textwrap.dedent("""\
        - name: Write this run's version into the workspace
          ansible.builtin.copy:
            dest: /workspace/version.txt
            content: "{{ version }}\\n"
            mode: "0644"
        """),
    "reads_version": textwrap.dedent("""\
        - name: Read the version this copy has
          ansible.builtin.command: cat /workspace/version.txt
          register: copy_version
          changed_when: false

        - name: Show it
          ansible.builtin.debug:
            msg: "VERSION={{ copy_version.stdout }}"
        """),
}


@pytest.fixture(scope="module")
def env(plane, tmp_path_factory):
    roles = tmp_path_factory.mktemp("roles")
    for name, tasks in ROLES.items():
        os.makedirs(roles / name / "tasks")
        (roles / name / "tasks" / "main.yml").write_text("---\n" + tasks)
    mux = tmp_path_factory.mktemp("cleanup-mux")
    return dict(plane.env, ANSIBLE_ROLES_PATH=str(roles), MICROVM_MUX_DIR=str(mux), MICROVM_PERSIST="20")


def playbook(name, env, tmp_path, **extra):
    args = []
    for key, value in extra.items():
        args += ["-e", "%s=%s" % (key, value)]
    return runner()("- ansible.builtin.import_playbook: microvm.sandbox.%s\n" % name, LOCALHOST, env,
                    extra_args=args, workdir=str(tmp_path))


def live(plane, name):
    s = plane.client().find_session(name)
    return s if s and not s["status"].endswith(GONE) else None


def test_provision_whose_role_fails_deletes_the_session_it_created(plane, env, tmp_path):
    name = unique("prov")
    res = playbook("provision", env, tmp_path, session_name=name, provision_role="fails_inside")
    assert res.rc == 2, res.output[-4000:]
    assert "Delete the session this run created" in res.output
    assert live(plane, name) is None
    assert "Take the checkpoint" not in res.output


def test_provision_keeps_a_session_that_existed_before(plane, env, tmp_path):
    name = unique("prov")
    plane.client().create_session({"name": name, "agent": "custom"})
    try:
        res = playbook("provision", env, tmp_path, session_name=name, provision_role="fails_inside")
        assert res.rc == 2, res.output[-4000:]
        assert live(plane, name) is not None
    finally:
        playbook("teardown", env, tmp_path, session_name=name)


def test_fanout_whose_role_fails_in_every_copy_still_deletes_them(plane, env, tmp_path):
    name = unique("fan")
    assert playbook("provision", env, tmp_path, session_name=name, checkpoint_label="ready").rc == 0
    try:
        res = playbook("fanout", env, tmp_path, session_name=name, checkpoint_label="ready", fanout_count=2,
                       fanout_role="fails_inside", fanout_cleanup="true")
        assert res.rc == 2, res.output[-4000:]
        assert "The work failed or the copy was unreachable in" in res.output, res.output[-4000:]
        source = live(plane, name)
        assert source is not None
        assert plane.client().forks_of(source["session_id"]) == []
    finally:
        playbook("teardown", env, tmp_path, session_name=name)


def test_rerun_with_a_retaken_checkpoint_forks_this_runs_state(plane, env, tmp_path):
    name = unique("rerun")
    try:
        for version in ("1", "2"):
            res = playbook("provision", env, tmp_path, session_name=name, provision_role="writes_version",
                           version=version, checkpoint_label="deps", checkpoint_retake="true")
            assert res.rc == 0, res.output[-4000:]
            # the copies are kept between runs (no fanout_cleanup), like a pipeline's kept forks
            res = playbook("fanout", env, tmp_path, session_name=name, checkpoint_label="deps", fanout_count=1,
                           fanout_role="reads_version")
            assert res.rc == 0, res.output[-4000:]
            assert "VERSION=%s" % version in res.output, res.output[-4000:]
        source = live(plane, name)
        checkpoints = [c for c in plane.client().list_checkpoints(source["session_id"]) if c.get("label") == "deps"]
        assert len(checkpoints) == 1  # the retake replaced the first run's
        forks = plane.client().forks_of(source["session_id"])
        # the first run's copy is not reused for the second checkpoint: it is still there beside the new one
        assert sorted(f["fork_from_checkpoint_id"] == checkpoints[0]["checkpoint_id"] for f in forks) == [False, True]
    finally:
        source = live(plane, name)
        if source:
            for f in plane.client().forks_of(source["session_id"]):
                plane.client().delete_session(f["session_id"])
        playbook("teardown", env, tmp_path, session_name=name)


def test_restore_that_fails_deletes_the_session_it_created(plane, env, tmp_path):
    name = unique("rest")
    res = playbook("restore", env, tmp_path, session_name=name, restore_src=str(tmp_path / "no-such-snapshot.tar.gz"))
    assert res.rc == 2, res.output[-4000:]
    assert "Delete the session this run created, since the restore failed" in res.output
    assert live(plane, name) is None
