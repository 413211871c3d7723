# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The template pipeline's reruns and clean-up, for real (buildah, a local docker-registry, the local plane):

- template_image's build context: every file's content and mode is in the recipe, so adding, removing,
  chmod-ing or editing one rebuilds, and an unchanged directory does not;
- an unchanged template_register rerun changes nothing and starts no check session;
- register_template leaves no build container, stops the registry it started, and keeps only the newest
  image of the name in local storage.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roles_util import LOCALHOST, markers, runner  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHED_BASE = os.path.join(ROOT, ".local", "template_image", "base", "bookworm-minbase.tar")
STATUS_ALL = "SESSION_STATUS_ALL"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def registry_answers(registry: str) -> bool:
    try:
        with urllib.request.urlopen("http://127.0.0.1:%s/v2/" % registry.rsplit(":", 1)[1], timeout=3):
            return True
    except urllib.error.HTTPError:
        return True  # it answered, if only with an error
    except OSError:
        return False


def buildah_lines(*args: str) -> list[str]:
    out = subprocess.run(["buildah", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True)
    return out.stdout.split()


def images_of(ref: str) -> list[str]:
    """Ids of the images (intermediate layers aside) the role labelled as built for `ref`, tagged or not."""
    return buildah_lines("images", "--noheading", "--no-trunc", "--quiet", "--filter", "label=io.microvm.sandbox.image=%s" % ref)


def image_exists(image_id: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", image_id], capture_output=True, check=False).returncode == 0


def changed_tasks(output: str) -> list[str]:
    """Names of the tasks the default callback reported as changed (without their role's prefix)."""
    names, current = [], None
    for line in output.splitlines():
        m = re.match(r"^TASK \[(.*)\] \*+$", line)
        if m:
            current = m.group(1).split(" : ", 1)[-1]
        elif line.startswith("changed: ") and current is not None:
            names.append(current)
    return names


def recap_changed(output: str) -> int:
    m = re.search(r"^localhost\s+: ok=\d+\s+changed=(\d+)", output, re.M)
    assert m, output[-3000:]
    return int(m.group(1))


@pytest.fixture(scope="module")
def image_env(plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    missing = [t for t in ("buildah", "skopeo", "docker-registry") if shutil.which(t) is None]
    if missing:
        pytest.skip("image tools missing (make system-deps installs them): %s" % ", ".join(missing))
    state = tmp_path_factory.mktemp("lifecycle-state")
    base_dir = state / "template_image" / "base"
    base_dir.mkdir(parents=True)
    if os.path.exists(CACHED_BASE):  # reuse the demo's debootstrap cache instead of bootstrapping again
        os.symlink(CACHED_BASE, str(base_dir / "bookworm-minbase.tar"))
    env = dict(plane.env, MICROVM_SANDBOX_STATE_DIR=str(state),
               MICROVM_MUX_DIR=str(tmp_path_factory.mktemp("lifecycle-mux")), MICROVM_PERSIST="20")
    registry = "localhost:%d" % free_port()
    repository = "microvm/life%s" % uuid.uuid4().hex[:6]
    yield {"env": env, "registry": registry, "state": str(state), "repository": repository}
    stopped = runner()("""
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: microvm.sandbox.template_image
        tasks_from: registry_stop
""", LOCALHOST, env, workdir=str(tmp_path_factory.mktemp("lifecycle-stop")))
    assert stopped.rc == 0, stopped.output[-3000:]
    # This module's tags go; the shared base layers stay cached for other runs.
    for tag in buildah_lines("images", "--format", "{{.Name}}:{{.Tag}}"):
        if tag.startswith("%s/%s:" % (registry, repository)):
            subprocess.run(["buildah", "rmi", tag], capture_output=True, check=False)


@pytest.fixture
def template_cleanup(plane: Any) -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    client = plane.client()
    for name in names:
        tpl = client.find_template(name)
        if tpl:
            client.delete_template(tpl["template_id"])


def session_ids(plane: Any) -> set[str]:
    """Every session the plane knows, deleted ones included (a check session is deleted at once)."""
    return {s["session_id"] for s in plane.client().list_sessions(status=STATUS_ALL)}


def test_build_context_is_in_the_recipe(image_env: dict[str, Any], tmp_path: Any, playbook_runner: Callable[..., Any]) -> None:
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "hello.txt").write_text("hello\n")
    (ctx / "app" / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(ctx / "app" / "run.sh", 0o644)
    ref = "%s/%s:ctx" % (image_env["registry"], image_env["repository"])
    playbook = """
- hosts: localhost
  gather_facts: false
  roles:
    - role: microvm.sandbox.template_image
      template_image_registry: %s
      template_image_repository: %s
      template_image_tag: ctx
      template_image_context_dir: %s
      template_image_extra_steps:
        - COPY app/ /opt/app/
  post_tasks:
    - ansible.builtin.debug:
        msg: "RECIPE={{ template_image_recipe }}"
    - ansible.builtin.include_role:
        name: microvm.sandbox.template_image
        tasks_from: registry_stop
""" % (image_env["registry"], image_env["repository"], ctx)

    def build(expect: str) -> str:
        res = playbook_runner(playbook, LOCALHOST, image_env["env"], workdir=str(tmp_path), timeout=1500)
        assert res.rc == 0, res.output[-5000:]
        assert expect in res.output, res.output[-3000:]
        return str(markers(res.output, "RECIPE")[-1])

    recipes = [build("built, checked and pushed")]
    recipes.append(build("reused (same recipe already in the registry)"))  # nothing in the context changed
    assert recipes[1] == recipes[0]

    steps: list[tuple[str, Callable[[], None]]] = [
        ("chmod", lambda: os.chmod(ctx / "app" / "run.sh", 0o755)),
        ("add", lambda: (ctx / "app" / "extra.txt").write_text("extra\n")),
        ("edit", lambda: (ctx / "app" / "hello.txt").write_text("hello again\n")),
        ("remove", lambda: os.remove(ctx / "app" / "extra.txt")),
    ]
    for what, change in steps:
        change()
        recipes.append(build("built, checked and pushed"))
        assert recipes[-1] != recipes[-2], "%s in the build context did not change the recipe" % what
    assert len(set(recipes[1:])) == len(recipes) - 1

    # The image holds the context as it is now (edited, executable, without the removed file).
    # Read back through a mounted directory: buildah's chroot isolation loses a short command's stdout now and then.
    seen = tmp_path / "seen"
    seen.mkdir()
    ctr = buildah_lines("from", "--quiet", "--pull-never", ref)[0]
    try:
        subprocess.run(["buildah", "run", "--isolation", "chroot", "--volume", "%s:/run/seen:rw" % seen, ctr, "--",
                        "/bin/sh", "-c", "{ cat /opt/app/hello.txt; ls /opt/app; stat -c %a /opt/app/run.sh; } > /run/seen/out"],
                       stdin=subprocess.DEVNULL,  # buildah run makes an inherited stdin non-blocking
                       capture_output=True, text=True, check=True)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, check=False)
    out = (seen / "out").read_text().split()
    assert out == ["hello", "again", "hello.txt", "run.sh", "755"], out
    # Each rebuild removed the image it superseded: one image of this reference is left.
    assert len(images_of(ref)) == 1


def test_rerun_is_a_no_op_and_cleans_up(plane: Any, image_env: dict[str, Any], tmp_path: Any,
                                        playbook_runner: Callable[..., Any], template_cleanup: list[str]) -> None:
    name = "itest-%s" % uuid.uuid4().hex[:8]
    template_cleanup.append(name)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "motd").write_text("one\n")
    ref = "%s/%s:life" % (image_env["registry"], image_env["repository"])
    containers_before = set(buildah_lines("containers", "--quiet", "--all"))
    assert not registry_answers(image_env["registry"])
    args = ["-e", "template_name=%s" % name, "-e", "template_image_registry=%s" % image_env["registry"],
            "-e", "template_image_repository=%s" % image_env["repository"], "-e", "template_image_tag=life",
            "-e", "template_image_context_dir=%s" % ctx, "-e", '{"template_image_extra_steps": ["COPY motd /etc/motd"]}']

    def register() -> Any:
        res = playbook_runner("- ansible.builtin.import_playbook: microvm.sandbox.register_template\n", LOCALHOST,
                              image_env["env"], workdir=str(tmp_path), timeout=1500, extra_args=args)
        assert res.rc == 0, res.output[-5000:]
        # Clean-up after every run: no build container of ours, the registry this run started is stopped.
        assert set(buildah_lines("containers", "--quiet", "--all")) <= containers_before
        assert not registry_answers(image_env["registry"]), "the registry the run started is still up"
        return res

    res = register()
    assert "built, checked and pushed" in res.output and "checked in a session as" in res.output
    tid = plane.client().find_template(name)["template_id"]
    assert len(plane.client().list_builds(tid)) == 1
    first_image = buildah_lines("images", "--noheading", "--no-trunc", "--quiet", ref)
    assert images_of(ref) == first_image

    # The role alone, rerun with the image unchanged: nothing changes, no session, no registry needed.
    digest = markers(playbook_runner("""
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.debug:
        msg: "DIGEST={{ (lookup('ansible.builtin.file', '%s/template_register/%s.json') | from_json).source_digest }}"
""" % (image_env["state"], name), LOCALHOST, image_env["env"], workdir=str(tmp_path)).output, "DIGEST")[0]
    assert str(digest).startswith("sha256:")
    sessions = session_ids(plane)
    started = time.monotonic()
    res = playbook_runner("""
- hosts: localhost
  gather_facts: false
  roles:
    - role: microvm.sandbox.template_register
      template_register_name: %s
      template_register_source_oci_ref: %s
      template_register_source_digest: %s
""" % (name, ref, digest), LOCALHOST, image_env["env"], workdir=str(tmp_path))
    elapsed = time.monotonic() - started
    print("unchanged template_register rerun: %.1f s (ansible-playbook wall time)" % elapsed)
    assert res.rc == 0, res.output[-5000:]
    assert recap_changed(res.output) == 0, changed_tasks(res.output)
    assert "unchanged since the last run" in res.output
    assert session_ids(plane) == sessions, "the unchanged rerun started a check session"
    assert len(plane.client().list_builds(tid)) == 1
    assert elapsed < 60  # a sanity bound only; the measured time is printed

    # The whole playbook, rerun unchanged: the image is reused, the template is left alone; only the
    # registry it needed for the lookup was started and stopped.
    res = register()
    assert "reused (same recipe already in the registry)" in res.output
    assert "unchanged since the last run" in res.output
    assert set(changed_tasks(res.output)) <= {"Start docker-registry in the background", "Stop the registry"}, \
        changed_tasks(res.output)
    assert session_ids(plane) == sessions
    assert len(plane.client().list_builds(tid)) == 1

    # A changed build context: a new image, the template rebuilt from it and checked again, the old image gone.
    (ctx / "motd").write_text("two\n")
    res = register()
    assert "built, checked and pushed" in res.output and "checked in a session as" in res.output
    assert len(plane.client().list_builds(tid)) == 2
    assert len(session_ids(plane) - sessions) == 1
    newest = buildah_lines("images", "--noheading", "--no-trunc", "--quiet", ref)
    assert images_of(ref) == newest != first_image
    assert not image_exists(first_image[0]), "the superseded image is still in local storage"
