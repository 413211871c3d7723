"""The built tarball holds what users need, installs into an empty path and works from there."""
import json
import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)


def run(args, env=None, cwd=None):
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, check=False, text=True, timeout=600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # A leftover of Galaxy's importer (it writes importer_result.json into its working directory)
    # must never be shipped: build with one present, as a checkout may have it.
    stray = os.path.join(ROOT, "importer_result.json")
    made_stray = not os.path.exists(stray)
    if made_stray:
        with open(stray, "w") as f:
            f.write("{}")
    try:
        built = run([os.path.join(BIN, "ansible-galaxy"), "collection", "build", "--output-path", str(out), ROOT])
    finally:
        if made_stray:
            os.unlink(stray)
    assert built.returncode == 0, built.stderr
    tarball = next(p for p in out.iterdir() if p.name.endswith(".tar.gz"))
    path = tmp_path_factory.mktemp("collections")
    # Only the empty path: galaxy skips a collection it finds installed in any configured path.
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(path))
    env["PYTHONPATH"] = ""  # nothing from the checkout
    inst = run([os.path.join(BIN, "ansible-galaxy"), "collection", "install", "-p", str(path), str(tarball)], env=env)
    assert inst.returncode == 0, inst.stderr
    return tarball, path, env


def test_tarball_leaves_development_files_out(installed):
    tarball, _path, _env = installed
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
    assert "plugins/connection/agent.py" in names
    assert "plugins/plugin_utils/_mux/agent_pb/sandbox_agent_pb2.py" in names
    for unwanted in (".venv", ".local", ".git", "hack", "bench", "Makefile", "requirements-dev.txt",
                     "importer_result.json"):
        assert not any(n == unwanted or n.startswith(unwanted + "/") for n in names), unwanted
    assert not [n for n in names if ".egg-info" in n]  # setuptools' build leftovers of the local plane


def test_installed_collection_lists_its_plugins(installed):
    _tarball, path, env = installed
    assert os.path.isdir(os.path.join(path, "ansible_collections", "microvm", "sandbox"))
    listed = {}
    for kind in ("module", "connection", "inventory"):
        res = run([os.path.join(BIN, "ansible-doc"), "-t", kind, "-l", "microvm.sandbox", "-j"], env=env)
        assert res.returncode == 0, res.stderr
        listed.update(json.loads(res.stdout))
    for name in ("session", "session_info", "session_fork", "size_info", "checkpoint", "checkpoint_info", "template",
                 "template_info", "persistent_workspace", "persistent_workspace_info", "environment_config",
                 "environment_config_info", "agent", "sessions"):
        assert "microvm.sandbox." + name in listed


def test_installed_module_talks_to_the_plane(installed, plane, tmp_path):
    _tarball, _path, env = installed
    env = dict(env, **plane.env)
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - microvm.sandbox.session_info: {}\n      register: info\n"
        "    - ansible.builtin.assert:\n        that: info.sessions is sequence\n")
    res = run([os.path.join(BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local",
               "-e", "ansible_python_interpreter={{ ansible_playbook_python }}", str(play)], env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert plane.token not in res.stdout + res.stderr
