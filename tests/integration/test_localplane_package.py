"""The local control plane from an installed collection, as its README says: the
tarball installed into an empty home, `pip install <collection>/localplane` into a
fresh virtualenv (nothing of this checkout on any path), `microvm-localplane up`,
the README's example playbook run against it with the env file sourced, and
`microvm-localplane down`."""
import os
import shlex
import subprocess
import sys

import pytest

from test_readme_example import project, readme_section
from user_env import UserHome, run

GONE = ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED", "SESSION_STATUS_FAILED")


@pytest.fixture
def user():
    home = UserHome("plane")
    yield home
    home.remove()


def env_file_values(path):
    values = {}
    with open(path) as f:
        for line in f:
            name, _sep, value = line.strip().removeprefix("export ").partition("=")
            if name:
                values[name] = shlex.split(value)[0] if value else ""
    return values


def test_plane_installs_from_the_collection_and_serves_a_playbook(user):
    venv = os.path.join(user.root, "plane-venv")
    made = run([sys.executable, "-m", "venv", venv], env=user.env)
    assert made.returncode == 0, made.stderr
    # The one documented command (README, localplane/README.md).
    inst = run([os.path.join(venv, "bin", "pip"), "install", "-q", os.path.join(user.collection, "localplane")],
               env=user.env, timeout=900)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    plane_cli = os.path.join(venv, "bin", "microvm-localplane")
    # The package is the plane alone: no test or bench helpers, no collection import.
    listing = run([os.path.join(venv, "bin", "python"), "-c",
                   "import microvm_localplane, os, sys; d = os.path.dirname(microvm_localplane.__file__); "
                   "print(sorted(os.listdir(d))); import microvm_localplane.server, microvm_localplane.agent; "
                   "print(sorted(m for m in sys.modules if m.startswith('ansible')))"], env=user.env)
    assert listing.returncode == 0, listing.stderr
    for helper in ("testing.py", "wsbridge.py", "guestbench.py"):
        assert helper not in listing.stdout
    assert listing.stdout.strip().endswith("[]"), listing.stdout

    state = os.path.join(user.root, "plane")
    envfile = os.path.join(user.root, "plane.env")
    up = run([plane_cli, "up", "--state-dir", state, "--env-file", envfile], env=user.env)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        plane_env = env_file_values(envfile)
        assert plane_env["DO_AGENTS_API_URL"].startswith("http://127.0.0.1:")
        work, command = project(user, readme_section())
        res = run(command, env=dict(user.env, **plane_env), cwd=work)
        output = res.stdout + res.stderr
        assert res.returncode == 0, output[-6000:]
        assert "[WARNING]" not in output, output[-6000:]
        assert plane_env["DO_AGENTS_API_TOKEN"] not in output
        with open(os.path.join(work, "out", "build.log")) as f:
            assert f.read().startswith("built on Linux by ")
    finally:
        down = run([plane_cli, "down", "--state-dir", state], env=user.env)
    assert down.returncode == 0, down.stdout + down.stderr
    # Nothing of the plane keeps running.
    left = subprocess.run(["pgrep", "-f", state], capture_output=True, text=True, check=False)
    assert left.stdout.strip() == "", left.stdout
