"""The base template's rootfs is cached under a digest of its recipe: a changed recipe is built anew."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from microvm_localplane import baseimage


def test_the_rootfs_dir_is_named_by_the_recipe_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(baseimage.CACHE_ENV, str(tmp_path / "cache"))
    digest = baseimage.recipe_digest()
    assert len(digest) == 12 and digest == baseimage.recipe_digest()
    assert baseimage.rootfs_path("/nowhere") == os.path.join(str(tmp_path / "cache"), "base-bookworm-" + digest,
                                                             "rootfs")
    assert not baseimage.ready("/nowhere")


def test_the_digest_changes_with_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = baseimage.recipe_digest()
    monkeypatch.setattr(baseimage, "PACKAGES", baseimage.PACKAGES + ("curl",))
    assert baseimage.recipe_digest() != digest
    assert baseimage.recipe_digest() in baseimage.rootfs_path("/nowhere")


def test_the_digest_changes_with_finish_and_its_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    digest = baseimage.recipe_digest()

    def _finish(root: str) -> None:
        """Another recipe."""
        os.mkdir(os.path.join(root, "more"))

    with monkeypatch.context() as m:
        m.setattr(baseimage, "_finish", _finish)
        changed = baseimage.recipe_digest()
        assert changed != digest and changed in baseimage.rootfs_path("/nowhere")
    assert baseimage.recipe_digest() == digest
    for name, value in (("GUEST_USER", "other"), ("ROOT_HOME", "/root"), ("VERSION", "4"), ("SUITE", "trixie")):
        with monkeypatch.context() as m:
            m.setattr(baseimage, name, value)
            assert baseimage.recipe_digest() != digest, name
