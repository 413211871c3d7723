"""The template image pipeline for real: template_image builds with buildah (no daemon), self-checks and
pushes to a local docker-registry; template_register registers it on the local plane and proves it in a
throwaway session. Two image builds in all, from a cached debootstrap base (marked slow)."""
import os
import shutil
import socket
import subprocess
import uuid

import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roles_util import LOCALHOST, runner  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHED_BASE = os.path.join(ROOT, ".local", "template_image", "base", "bookworm-minbase.tar")

pytestmark = pytest.mark.slow


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def image_env(plane, tmp_path_factory):
    missing = [t for t in ("buildah", "skopeo", "docker-registry") if shutil.which(t) is None]
    if missing:
        pytest.skip("image tools missing (make system-deps installs them): %s" % ", ".join(missing))
    state = tmp_path_factory.mktemp("image-state")
    base_dir = state / "template_image" / "base"
    base_dir.mkdir(parents=True)
    if os.path.exists(CACHED_BASE):  # reuse the demo's debootstrap cache instead of bootstrapping again
        os.symlink(CACHED_BASE, str(base_dir / "bookworm-minbase.tar"))
    env = dict(plane.env, MICROVM_SANDBOX_STATE_DIR=str(state),
               MICROVM_MUX_DIR=str(tmp_path_factory.mktemp("image-mux")), MICROVM_PERSIST="20")
    registry = "localhost:%d" % free_port()
    yield {"env": env, "registry": registry, "state": str(state)}
    run_playbook = runner()
    run_playbook("""
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: microvm.sandbox.template_image
        tasks_from: registry_stop
""", LOCALHOST, env, workdir=str(tmp_path_factory.mktemp("image-stop")))
    # Drop this run's tags from the builder's storage (the layers stay cached for the next run).
    tags = subprocess.run(["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"], capture_output=True, text=True, check=False)
    for tag in tags.stdout.split():
        if tag.startswith(registry + "/"):
            subprocess.run(["buildah", "rmi", tag], capture_output=True, check=False)


@pytest.fixture
def template_cleanup(plane):
    names = []
    yield names
    client = plane.client()
    for name in names:
        tpl = client.find_template(name)
        if tpl:
            client.delete_template(tpl["template_id"])


def live_check_sessions(plane):
    return [s for s in plane.client().list_sessions() if s["name"].startswith("tplcheck-")
            and not s["status"].endswith(("DESTROYING", "DESTROYED", "FAILED"))]


def test_build_register_and_prove_a_template(plane, image_env, tmp_path, playbook_runner, template_cleanup):
    name = "itest-%s" % uuid.uuid4().hex[:8]
    template_cleanup.append(name)
    res = playbook_runner("- ansible.builtin.import_playbook: microvm.sandbox.register_template\n", LOCALHOST,
                          image_env["env"], workdir=str(tmp_path), timeout=1500, extra_args=[
                              "-e", "template_name=%s" % name,
                              "-e", "template_image_registry=%s" % image_env["registry"],
                              "-e", "template_image_repository=microvm/itest", "-e", "template_image_tag=good"])
    assert res.rc == 0, res.output[-5000:]
    assert "built, checked and pushed" in res.output
    assert "checked in a session as" in res.output
    tpl = plane.client().find_template(name)
    assert tpl and tpl["status"] == "TEMPLATE_STATUS_READY", tpl
    assert tpl["spec"] == {"base_template": "sandbox"}  # the role's default base; the source is not reported
    assert live_check_sessions(plane) == []

    # The same template with a tool the image lacks: the session check fails, naming it, and the
    # throwaway session is deleted anyway.
    res = playbook_runner("""
- hosts: localhost
  gather_facts: false
  roles:
    - role: microvm.sandbox.template_register
      template_register_name: %s
      template_register_source_oci_ref: %s/microvm/itest:good
      template_register_tools: [sh, python3, no-such-tool]
""" % (name, image_env["registry"]), LOCALHOST, image_env["env"], workdir=str(tmp_path))
    assert res.rc != 0
    assert "missing tools: no-such-tool" in res.output, res.output[-4000:]
    assert "Delete the check session" in res.output
    assert live_check_sessions(plane) == []
    # The unchanged template was not rebuilt: its drift check reads spec from GET, since list items carry none.
    assert len(plane.client().list_builds(tpl["template_id"])) == 1


def test_self_check_rejects_a_tmp_leftover(image_env, tmp_path, playbook_runner):
    res = playbook_runner("""
- hosts: localhost
  gather_facts: false
  roles:
    - role: microvm.sandbox.template_image
      template_image_registry: %s
      template_image_repository: microvm/itest
      template_image_tag: leftover
      template_image_clean_tmp: false
      template_image_extra_steps:
        - RUN touch /tmp/leftover.lock && mkdir /tmp/.build-cache
""" % image_env["registry"], LOCALHOST, image_env["env"], workdir=str(tmp_path), timeout=1500)
    assert res.rc != 0
    assert "self-check failed" in res.output, res.output[-4000:]
    assert "/tmp/leftover.lock" in res.output and "/tmp/.build-cache" in res.output
    assert "The image was not pushed" in res.output
    pushed = subprocess.run(["skopeo", "inspect", "--tls-verify=false",
                             "docker://%s/microvm/itest:leftover" % image_env["registry"]], capture_output=True, check=False)
    assert pushed.returncode != 0, "the rejected image reached the registry"
