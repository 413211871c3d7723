"""tests/support/microvm_tarball.py: the collection tarball is built once per content of the tree, and again when a
file changes (a tmp git repo, and a stand-in for ansible-galaxy that counts its builds)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import microvm_tarball
import pytest


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    root = tmp_path / "repo"
    (root / "plugins").mkdir(parents=True)
    (root / "galaxy.yml").write_text("name: sandbox\n")
    (root / "plugins" / "a.py").write_text("A = 1\n")
    (root / ".gitignore").write_text("ignored.txt\n.local/\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    builds = tmp_path / "builds.log"
    fake = tmp_path / "ansible-galaxy"
    # collection build --output-path DIR ROOT
    fake.write_text('#!/bin/sh\nmkdir -p "$4" && echo "$5" >"$4/microvm-sandbox-0.1.0.tar.gz" && echo "$4" >>%s\n'
                    % builds)
    fake.chmod(0o755)
    monkeypatch.setattr(microvm_tarball, "galaxy", lambda: str(fake))
    return root, builds


def build_count(builds: Path) -> int:
    return len(builds.read_text().splitlines()) if builds.exists() else 0


def test_the_digest_follows_the_tracked_and_untracked_files_not_the_ignored(repo: tuple[Path, Path]) -> None:
    root = repo[0]
    digest = microvm_tarball.tree_digest(str(root))
    assert microvm_tarball.tree_digest(str(root)) == digest
    (root / "ignored.txt").write_text("x")
    (root / ".local").mkdir()
    (root / ".local" / "junk").write_text("x")
    assert microvm_tarball.tree_digest(str(root)) == digest
    (root / "plugins" / "a.py").write_text("A = 2\n")   # tracked, changed in the work tree
    changed = microvm_tarball.tree_digest(str(root))
    assert changed != digest
    (root / "plugins" / "a.py").chmod(0o755)
    assert microvm_tarball.tree_digest(str(root)) != changed
    (root / "plugins" / "new.py").write_text("")      # untracked, not ignored: galaxy would pack it
    assert "plugins/new.py" in microvm_tarball.tree_files(str(root))


def test_the_same_digest_reuses_the_build_and_a_change_builds_anew(repo: tuple[Path, Path]) -> None:
    root, builds = repo
    first = microvm_tarball.collection_tarball(str(root))
    digest = microvm_tarball.tree_digest(str(root))
    assert first == os.path.join(str(root), ".local", "dist", digest[:16], "microvm-sandbox-0.1.0.tar.gz")
    assert microvm_tarball.collection_tarball(str(root)) == first and build_count(builds) == 1
    (root / "plugins" / "a.py").write_text("A = 3\n")
    second = microvm_tarball.collection_tarball(str(root))
    assert second != first and os.path.isfile(second) and build_count(builds) == 2
    assert not [n for n in os.listdir(root / ".local" / "dist") if ".tmp-" in n]


def test_without_git_the_tree_is_walked(tmp_path: Path) -> None:
    for rel in ("galaxy.yml", "plugins/a.py", ".git/config", ".local/x", ".venv-newest/y", "docs/.venv/z"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    assert microvm_tarball.tree_files(str(tmp_path)) == ["docs/.venv/z", "galaxy.yml", "plugins/a.py"]
