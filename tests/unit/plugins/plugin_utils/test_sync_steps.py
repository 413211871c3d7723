"""The guest side's steps (sync_tree.guest_main, and the action's sh steps that make and drop a stage), run as the
guest runs them (`python3 -c <source> <json>` or `sh -c`, stdin whole and closed, TMPDIR the run's scratch dir), on
a local directory standing in for the guest's tree."""
import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from ansible_collections.microvm.sandbox.plugins.action import sync as sync_action
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import source_of
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import sync_tree as st
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import sync_plan as sp


def step(run_dir, phase, stdin=b"", **request):
    """-> (rc, stdout, stderr) of one step."""
    proc = subprocess.run([sys.executable, "-c", source_of(st), json.dumps(dict(request, phase=phase))], input=stdin,
                          capture_output=True, env=dict(os.environ, TMPDIR=str(run_dir)), timeout=60, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def sh(run_dir, script, name):
    return subprocess.run(["/bin/sh", "-c", script, "sh", name], capture_output=True, env=dict(os.environ, TMPDIR=str(run_dir)),
                          timeout=60, check=False)


@pytest.fixture()
def dirs(tmp_path):
    run, tree = tmp_path / "run", tmp_path / "tree"
    run.mkdir()
    tree.mkdir()
    (tree / "a.txt").write_text("a\n")
    (tree / "d").mkdir()
    (tree / "d" / "b.txt").write_text("b\n")
    return run, tree


def test_push_steps_manifest_stage_apply(dirs):
    run, tree = dirs
    rc, out, _err = step(run, "manifest", mode="push", root=str(tree))
    assert rc == 0
    reader = sp.ManifestReader(iter([out]))
    assert [e.path for e in reader.entries()] == [b".", b"a.txt", b"d", b"d/b.txt"] and reader.info == {"exists": True}
    assert sh(run, sync_action.STAGE_SH, "sync-1").returncode == 0
    assert oct((run / "sync-1").stat().st_mode & 0o777) == "0o700"
    (run / "sync-1" / "new.txt").write_text("new\n")  # what the agent's Upload would extract there
    rc, out, err = step(run, "apply", stdin=st.op_delete(b"d/b.txt"), mode="push", root=str(tree), stage_name="sync-1")
    assert rc == 0, err
    assert json.loads(out) == {"moved": 1, "deleted": 1, "fixed": 0}
    assert (tree / "new.txt").read_text() == "new\n" and not (tree / "d" / "b.txt").exists()
    assert os.listdir(run) == []  # the apply step removed its stage


def test_a_planted_stage_is_refused_and_removed(dirs):
    run, tree = dirs
    (run / "sync-2").mkdir()
    made = sh(run, sync_action.STAGE_SH, "sync-2")
    assert made.returncode != 0 and b"exists" in made.stderr  # made by someone else before this run named it
    os.symlink(str(tree), str(run / "sync-link"))
    assert sh(run, sync_action.STAGE_SH, "sync-link").returncode != 0  # a link is never taken for the stage
    os.chmod(run / "sync-2", 0o777)
    (run / "sync-2" / "evil").write_text("x\n")
    rc, _out, err = step(run, "apply", mode="push", root=str(tree), stage_name="sync-2")
    assert rc == 3 and b"refused the stage dir" in err
    assert not (tree / "evil").exists() and os.listdir(run) == ["sync-link"]
    assert sh(run, sync_action.DROP_SH, "sync-link").returncode == 0
    assert os.listdir(run) == [] and (tree / "a.txt").exists()  # the link went, not what it leads to


def test_pull_steps_pack_then_drop(dirs):
    run, tree = dirs
    rc, out, err = step(run, "pack", stdin=b"a.txt\0d\0d/b.txt\0", mode="pull", root=str(tree), stage_name="sync-3.tar")
    assert rc == 0, err
    assert json.loads(out)["members"] == 3
    with tarfile.open(fileobj=io.BytesIO((run / "sync-3.tar").read_bytes())) as tar:
        assert tar.getnames() == ["a.txt", "d", "d/b.txt"]
    assert oct((run / "sync-3.tar").stat().st_mode & 0o777) == "0o600"
    assert sh(run, sync_action.DROP_SH, "sync-3.tar").returncode == 0
    assert os.listdir(run) == []
    assert sh(run, sync_action.DROP_SH, "sync-3.tar").returncode == 0  # one already gone is fine


def test_a_pull_of_a_missing_root_is_named(dirs):
    run, tree = dirs
    rc, _out, err = step(run, "manifest", mode="pull", root=str(tree / "nope"))
    assert rc == 3 and b"does not exist" in err
