"""The pure parts of the workspace_archive action plugin: its clean command (run by sh on a tree like a guest's)."""
import subprocess

import pytest

from ansible_collections.microvm.sandbox.plugins.action.workspace_archive import (
    OUTSIDE_RC, clean_command, inside_workspace)


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def guestlike(tmp_path):
    """A workspace with files, a kept dir, a link out of it to the root, and a directory outside it."""
    ws = tmp_path / "ws"
    (ws / ".scratch").mkdir(parents=True)
    (ws / ".scratch" / "run").write_text("ansible's own files")
    (ws / "my dir" / "sub").mkdir(parents=True)
    (ws / "my dir" / "old.txt").write_text("old")
    (ws / "top.txt").write_text("top")
    (ws / "up").symlink_to(tmp_path)
    (ws / "alias").symlink_to(".")
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "precious").write_text("precious")
    return tmp_path


def _clean(dest, keep, root):
    ws = str(root / "ws")
    return subprocess.run(["sh", "-c", clean_command(dest.replace("/workspace", ws, 1),
                                                     [k.replace("/workspace", ws, 1) for k in keep], ws)],
                          capture_output=True, text=True, check=False)


def test_clean_refuses_a_dest_that_resolves_outside_and_removes_nothing(guestlike):
    before = _tree(guestlike)
    res = _clean("/workspace/up/victim", ["/workspace/.scratch"], guestlike)
    assert res.returncode == OUTSIDE_RC and res.stderr.strip() == str(guestlike / "victim"), res
    assert _tree(guestlike) == before


def test_clean_empties_the_real_dest_and_keeps_kept_paths_even_through_a_link(guestlike):
    res = _clean("/workspace/alias", ["/workspace/.scratch"], guestlike)
    assert res.returncode == 0, res
    assert _tree(guestlike / "ws") == [".scratch", ".scratch/run"]
    assert (guestlike / "victim" / "precious").exists()


def test_clean_of_a_subdir_with_spaces(guestlike):
    res = _clean("/workspace/my dir", ["/workspace/my dir/sub"], guestlike)
    assert res.returncode == 0, res
    assert _tree(guestlike / "ws" / "my dir") == ["sub"]
    assert (guestlike / "ws" / "top.txt").exists()


def test_clean_of_a_missing_dest_does_nothing(guestlike):
    assert _clean("/workspace/nope", [], guestlike).returncode == 0


@pytest.mark.parametrize("path, ok", [("/workspace", True), ("/workspace/a", True), ("/workspace2", False),
                                      ("/tmp", False), ("/", False)])
def test_inside_workspace(path, ok):
    assert inside_workspace(path) is ok
