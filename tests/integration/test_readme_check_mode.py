"""The README's sandbox.yml beyond the happy path (issue 29): with --check it runs and creates nothing, and when
the build fails, or the sandbox is unreachable, the session is still deleted and the run fails."""
import os

import pytest

from test_readme_example import GONE, project, readme_section
from user_env import UserHome, run


@pytest.fixture(scope="module")
def user():
    home = UserHome("readme-x")
    yield home
    home.remove()


def build_42_left(plane):
    return [s for s in plane.client().list_sessions() if s["name"] == "build-42" and s["status"] not in GONE]


def run_readme(user, plane, tmp_name, edit=None, args=()):
    blocks = readme_section()
    if edit:
        old, new = edit
        assert old in blocks["yaml"]
        blocks["yaml"] = blocks["yaml"].replace(old, new)
    work, command = project(user, blocks)
    os.rename(work, os.path.join(user.root, tmp_name))
    work = os.path.join(user.root, tmp_name)
    res = run(command + list(args), env=user.with_plane(plane), cwd=work)
    return res, res.stdout + res.stderr


def test_check_mode_runs_and_creates_nothing(user, plane):
    res, output = run_readme(user, plane, "check", args=["--check"])
    assert res.returncode == 0, output[-6000:]
    assert "has no attribute 'session_id'" not in output
    assert build_42_left(plane) == []


def test_a_failing_build_still_deletes_the_session_and_fails_the_run(user, plane):
    res, output = run_readme(user, plane, "fails", edit=("mkdir -p out && echo", "exit 3; echo"))
    assert res.returncode == 2, output[-6000:]
    assert "The work in build-42 failed" in output
    assert build_42_left(plane) == []


def test_an_unreachable_sandbox_still_deletes_the_session_and_fails_the_run(user, plane):
    res, output = run_readme(user, plane, "unreachable",
                             edit=('ansible_host: "{{ sandbox.session.session_id }}"', "ansible_host: no-such-session"))
    assert res.returncode in (2, 4), output[-6000:]
    assert "UNREACHABLE" in output and "The work in build-42 failed" in output, output[-6000:]
    assert build_42_left(plane) == []
