"""`make clean-images` removes the images this checkout built and no other checkout's.

Real buildah images in the machine's containers store: one labelled as ours (with a build
container on it and a superseded build), one labelled as another checkout's, one unlabelled
with a name the old pattern matched. Each test uses labels of its own, so it never touches the
demo's or the execution environment's images.
"""
import os
import shutil
import subprocess
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah is not installed")


def buildah(*args: str) -> str:
    return subprocess.run(["buildah", *args], check=True, capture_output=True, text=True).stdout.strip()


def image(name: str, label: str | None) -> str:
    """A tiny image from scratch (no registry), committed as `name`; returns its id."""
    ctr = buildah("from", "--quiet", "scratch")
    try:
        if label:
            buildah("config", "--label", label, ctr)
        buildah("config", "--cmd", "/bin/true", "--env", "NONCE=%s" % uuid.uuid4().hex, ctr)
        return buildah("commit", "--quiet", ctr, name)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, check=False)


def exists(image_id: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", image_id], capture_output=True, check=False).returncode == 0


def test_clean_images_removes_only_this_checkouts_images():
    tag = uuid.uuid4().hex[:8]
    ours = "io.microvm.sandbox.checkout=test%s" % tag
    theirs = "io.microvm.sandbox.checkout=other%s" % tag
    mine_old = image("localhost/microvm-cleantest-%s:v1" % tag, ours)
    mine = image("localhost/microvm-cleantest-%s:v1" % tag, ours)  # supersedes mine_old: it is dangling now
    in_use = buildah("from", "--quiet", mine)                      # a build container on our image
    other = image("localhost/microvm-cleantest-other-%s:v1" % tag, theirs)
    unlabelled = image("localhost:5000/microvm/cleantest-%s:v1" % tag, None)
    try:
        out = subprocess.run(["bash", os.path.join(ROOT, "hack", "clean-images.sh")], capture_output=True,
                             text=True, env=dict(os.environ, MICROVM_CHECKOUT_LABEL=ours), timeout=300, check=False)
        assert out.returncode == 0, out.stderr
        assert not exists(mine) and not exists(mine_old), out.stdout
        assert subprocess.run(["buildah", "inspect", in_use], capture_output=True, check=False).returncode != 0
        assert "removed image localhost/microvm-cleantest-%s:v1" % tag in out.stdout
        assert exists(other), "another checkout's image was removed"
        assert exists(unlabelled), "an image this checkout did not label was removed"
        again = subprocess.run(["bash", os.path.join(ROOT, "hack", "clean-images.sh")], capture_output=True,
                               text=True, env=dict(os.environ, MICROVM_CHECKOUT_LABEL=ours), timeout=300, check=False)
        assert again.returncode == 0 and "no images of this checkout" in again.stdout
    finally:
        for ref in (in_use,):
            subprocess.run(["buildah", "rm", ref], capture_output=True, check=False)
        for ref in (mine, mine_old, other, unlabelled):
            subprocess.run(["buildah", "rmi", "-f", ref], capture_output=True, check=False)
