"""The README's "Using this collection" example, verbatim: its inventory.ini and
sandbox.yml blocks and its `ansible-playbook` command line, run by a user with
the collection installed from the built tarball (tests/integration/user_env.py),
against a local control plane whose env file the user sourced (here: the plane
fixture's URL and token). The plane's own lines (`pip install .../localplane`,
`microvm-localplane up/down`) are tested in test_localplane_package.py."""
import os
import re
import shlex

import pytest

from user_env import ROOT, UserHome, run

GONE = ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED", "SESSION_STATUS_FAILED")


def readme_section():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Using this collection", 1)[1].split("\n## ", 1)[0]
    blocks = dict((lang, body) for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S))
    assert set(blocks) >= {"console", "ini", "yaml"}, sorted(blocks)
    return blocks


@pytest.fixture
def user():
    home = UserHome("readme")
    yield home
    home.remove()


def project(user, blocks):
    work = os.path.join(user.root, "project")
    os.makedirs(work)
    with open(os.path.join(work, "inventory.ini"), "w") as f:
        f.write(blocks["ini"])
    with open(os.path.join(work, "sandbox.yml"), "w") as f:
        f.write(blocks["yaml"])
    command = next(line[2:] for line in blocks["console"].splitlines() if line.startswith("$ ansible-playbook "))
    return work, shlex.split(command)


def test_readme_example_runs_verbatim_and_tears_down(user, plane):
    blocks = readme_section()
    work, command = project(user, blocks)
    res = run(command, env=user.with_plane(plane), cwd=work)
    output = res.stdout + res.stderr
    assert res.returncode == 0, output[-6000:]
    assert "[WARNING]" not in output, output[-6000:]
    assert plane.token not in output
    with open(os.path.join(work, "out", "build.log")) as f:
        assert f.read().startswith("built on Linux by ")
    left = [s for s in plane.client().list_sessions() if s["name"] == "build-42" and s["status"] not in GONE]
    assert left == [], left


def test_readme_example_never_sends_the_local_token_elsewhere(user, plane):
    """With DO_AGENTS_API_URL unset, the local plane's token is refused before anything is sent."""
    assert plane.token.startswith("mvlp-")
    blocks = readme_section()
    work, command = project(user, blocks)
    env = user.with_plane(plane)
    del env["DO_AGENTS_API_URL"]
    res = run(command, env=env, cwd=work)
    output = res.stdout + res.stderr
    assert res.returncode != 0
    assert "local control plane" in output and "DO_AGENTS_API_URL" in output and "is not set" in output, output[-4000:]
    assert plane.token not in output
    assert not [s for s in plane.client().list_sessions() if s["name"] == "build-42" and s["status"] not in GONE]
