"""Molecule for a user's own role: a role in a directory of its own (no git, outside
this repository), the collection installed from the built tarball, a molecule.yml
of a few lines whose create.yml and destroy.yml import the collection's
microvm.sandbox.molecule_create / molecule_destroy, and `molecule test` against
the local control plane with nothing else set but the plane's URL and token."""
import os
import re
import textwrap

import pytest

from test_molecule import GONE, steps
from user_env import BIN, UserHome, run

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "molecule")),
                                reason="molecule is not installed in .venv (make venv)")

ROLE = {
    "meta/main.yml": """\
        ---
        galaxy_info:
          namespace: acme
          role_name: motd
          author: Acme
          description: Writes a message of the day into the workspace.
          license: GPL-3.0-or-later
          min_ansible_version: "2.19"
          platforms:
            - name: Debian
              versions: [bookworm]
        dependencies: []
        """,
    "defaults/main.yml": """\
        ---
        motd_text: hello from a sandbox
        """,
    "tasks/main.yml": """\
        ---
        - name: Write the message of the day
          ansible.builtin.copy:
            content: "{{ motd_text }}\\n"
            dest: /workspace/motd.txt
            mode: "0644"
        """,
    # The whole scenario: sandboxes come from the installed collection.
    "molecule/default/molecule.yml": """\
        ---
        driver:
          name: default
          options:
            managed: true
        platforms:
          - name: instance
            template: base
            name_prefix: motd
        ansible:
          cfg:
            defaults:
              callbacks_enabled: microvm.sandbox.cleanup
            microvm_cleanup:
              molecule: true
        scenario:
          test_sequence: [destroy, syntax, create, converge, idempotence, verify, destroy]
        """,
    "molecule/default/create.yml": """\
        ---
        - name: Create the sandboxes
          ansible.builtin.import_playbook: microvm.sandbox.molecule_create
        """,
    "molecule/default/destroy.yml": """\
        ---
        - name: Destroy the sandboxes
          ansible.builtin.import_playbook: microvm.sandbox.molecule_destroy
        """,
    "molecule/default/converge.yml": """\
        ---
        - name: Converge
          hosts: all
          gather_facts: false
          roles:
            - role: acme.motd
        """,
    "molecule/default/verify.yml": """\
        ---
        - name: Verify
          hosts: all
          gather_facts: false
          tasks:
            - name: Read the message back
              ansible.builtin.slurp:
                src: /workspace/motd.txt
              register: motd
            - name: Check it
              ansible.builtin.assert:
                that: (motd.content | b64decode) == 'hello from a sandbox\\n'
        """,
}


@pytest.fixture
def user():
    home = UserHome("molecule")
    yield home
    home.remove()


def test_molecule_test_of_a_users_role(user, plane):
    role = os.path.join(user.root, "src", "motd")
    for path, text in ROLE.items():
        os.makedirs(os.path.dirname(os.path.join(role, path)), exist_ok=True)
        with open(os.path.join(role, path), "w") as f:
            f.write(textwrap.dedent(text))
    outside = run(["git", "-C", role, "rev-parse", "--is-inside-work-tree"], env=user.env)
    assert outside.returncode != 0, "the role must not be inside a git work tree: %s" % outside.stdout
    before = {s["session_id"] for s in plane.client().list_sessions(status="SESSION_STATUS_ALL")}
    res = run([os.path.join(BIN, "molecule"), "test"], env=user.with_plane(plane), cwd=role)
    output = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout + res.stderr)
    assert res.returncode == 0, output[-8000:]
    done = steps(output)
    for step in ("create", "converge", "idempotence", "verify", "destroy"):
        assert ("default", step, "Successful") in done, (done, output[-8000:])
    assert "missing files" not in output and " missing=0 " in output, output[-8000:]
    assert "interpreter" not in output.lower(), output[-8000:]
    assert "[WARNING]" not in output, output[-8000:]
    # the installed collection's cleanup callback is loaded (Ctrl-C would delete the session) and keeps it for destroy
    assert "keeping the 1 session(s) it created (Molecule's destroy deletes them)" in output, output[-8000:]
    made = [s for s in plane.client().list_sessions(status="SESSION_STATUS_ALL") if s["session_id"] not in before]
    assert made and all(s["name"].startswith("motd-default-instance-") for s in made), made
    assert [s for s in made if s["status"] not in GONE] == []
    assert plane.token not in output
