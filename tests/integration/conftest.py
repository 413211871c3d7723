"""Helpers for integration tests that run real `ansible-playbook` against the local control plane.

`run_playbook(playbook_text, inventory_text, env=None, extra_args=())` writes both texts to a
temporary directory and runs ansible-playbook there with this collection on
ANSIBLE_COLLECTIONS_PATH; it returns a Result with .rc, .stdout and .stderr.
Pass `plane.env` (or a dict that contains it) as `env` to reach the plane.
"""
import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIONS = os.path.join(ROOT, ".local", "collections")
BIN = os.path.dirname(sys.executable)


class Result:
    def __init__(self, rc, stdout, stderr, workdir):
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        self.workdir = workdir

    @property
    def output(self):
        return self.stdout + self.stderr

    def __repr__(self):
        return "Result(rc=%r)\n--- stdout\n%s\n--- stderr\n%s" % (self.rc, self.stdout[-6000:], self.stderr[-3000:])


def ansible_env(env=None):
    """The environment ansible-playbook runs with: this collection, no colours, no retry files."""
    full = dict(os.environ)
    full.update({
        "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS,
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_HOST_KEY_CHECKING": "0",
        "ANSIBLE_DEPRECATION_WARNINGS": "0",
        "PATH": BIN + os.pathsep + os.environ.get("PATH", ""),
    })
    full["PYTHONPATH"] = os.pathsep.join([COLLECTIONS, os.path.join(ROOT, "localplane")] +
                                         [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    full.update(env or {})
    return full


def run_playbook(playbook_text, inventory_text, env=None, extra_args=(), workdir=None, timeout=900):
    """Run ansible-playbook on the given playbook and inventory texts; returns a Result."""
    workdir = workdir or tempfile.mkdtemp(prefix="pb-")
    with open(os.path.join(workdir, "playbook.yml"), "w") as f:
        f.write(playbook_text)
    inventory = os.path.join(workdir, "inventory.ini" if not inventory_text.lstrip().startswith(("all:", "---"))
                             else "inventory.yml")
    with open(inventory, "w") as f:
        f.write(inventory_text)
    argv = [os.path.join(BIN, "ansible-playbook"), "-i", inventory, "playbook.yml"] + list(extra_args)
    proc = subprocess.run(argv, cwd=workdir, env=ansible_env(env), capture_output=True, text=True, timeout=timeout,
                          check=False)
    return Result(proc.returncode, proc.stdout, proc.stderr, workdir)


@pytest.fixture
def playbook_runner():
    """The run_playbook helper as a fixture."""
    return run_playbook
