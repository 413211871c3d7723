"""The collection's roles and playbooks through the real stack: ansible-playbook -> modules and the
microvm.sandbox.agent connection -> local control plane -> guest.

One session (started with the provision playbook, deleted with the teardown playbook) serves the
credentials and workspace_export tests, so the suite stays lean on a small machine.
"""
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roles_util import LOCALHOST, conftest, inventory, markers, runner, unique  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SECRET_MARK = "s3cr3t-" + uuid.uuid4().hex  # never allowed in any output


@pytest.fixture(scope="module")
def roles_env(plane, tmp_path_factory):
    mux = tmp_path_factory.mktemp("roles-mux")
    return dict(plane.env, MICROVM_MUX_DIR=str(mux), MICROVM_PERSIST="20")


@pytest.fixture(scope="module")
def provisioned(plane, roles_env, tmp_path_factory):
    """A session from the provision playbook (by FQCN), torn down by the teardown playbook."""
    run_playbook = runner()
    name = unique("roles")
    work = tmp_path_factory.mktemp("provision")
    res = run_playbook("- ansible.builtin.import_playbook: microvm.sandbox.provision\n", LOCALHOST, roles_env,
                       extra_args=["-e", "session_name=%s" % name, "-e", "session_template=base",
                                   "-e", "checkpoint_label=provisioned"], workdir=str(work))
    try:
        assert res.rc == 0, res.output[-4000:]
        session = plane.client().find_session(name)
        assert session and session["status"].endswith("READY"), session
        labels = [c.get("label") for c in plane.client().list_checkpoints(session["session_id"])]
        assert "provisioned" in labels
        yield {"name": name, "id": session["session_id"]}
    finally:
        down = run_playbook("- ansible.builtin.import_playbook: microvm.sandbox.teardown\n", LOCALHOST, roles_env,
                            extra_args=["-e", "session_name=%s" % name], workdir=str(work))
        assert down.rc == 0, down.output[-4000:]
        left = plane.client().find_session(name)
        assert not left or left["status"].endswith(("DESTROYING", "DESTROYED")), left


CREDENTIALS_FAILING_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: Seed a credential directory left by a crashed run, and a recent one
      ansible.builtin.shell: |
        mkdir -p /workspace/.scratch/credentials.crashed1/home/.aws /workspace/.scratch/credentials.recent1/home
        echo old > /workspace/.scratch/credentials.crashed1/home/.aws/credentials
        touch -d '3 hours ago' /workspace/.scratch/credentials.crashed1
      changed_when: true
    - name: Work with credentials
      block:
        - name: Stage
          ansible.builtin.include_role:
            name: microvm.sandbox.credentials
          vars:
            credentials_files:
              - path: .aws/credentials
                content: "[default]\\naws_access_key_id = AKIATEST\\naws_secret_access_key = {{ secret }}\\n"
              - path: .config/tool/token
                src: "{{ token_file }}"
                env_var: TOOL_TOKEN_FILE
                env: {TOOL_PROFILE: ci}
        - name: Use them
          ansible.builtin.command:
            argv:
              - python3
              - -c
              - |
                import json, os, stat
                env = {k: os.environ.get(k, "") for k in ("HOME", "AWS_SHARED_CREDENTIALS_FILE", "TOOL_TOKEN_FILE", "TOOL_PROFILE")}
                aws = open(env["AWS_SHARED_CREDENTIALS_FILE"]).read()
                modes = {}
                for root, dirs, files in os.walk(os.path.dirname(env["HOME"])):
                    for n in dirs + files:
                        p = os.path.join(root, n)
                        modes[p] = oct(stat.S_IMODE(os.stat(p).st_mode))
                modes[os.path.dirname(env["HOME"])] = oct(stat.S_IMODE(os.stat(os.path.dirname(env["HOME"])).st_mode))
                print(json.dumps({"env": env, "aws_has_secret": "{{ secret }}" in aws,
                                  "token_ok": open(env["TOOL_TOKEN_FILE"]).read() == "{{ secret }}-token\\n", "modes": modes}))
          environment: "{{ credentials_env }}"
          register: used
          no_log: true
        - name: Report
          ansible.builtin.debug:
            msg: "USED={{ used.stdout | replace(secret, '<hidden>') | to_json }}"
        - name: The work fails after staging
          ansible.builtin.fail:
            msg: the work failed
      always:
        - name: Remove the credentials
          ansible.builtin.include_role:
            name: microvm.sandbox.credentials
            tasks_from: cleanup
"""

CHECK_SCRATCH_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: List the scratch dir
      ansible.builtin.find:
        paths: /workspace/.scratch
        patterns: "credentials.*,export.*"
        file_type: any
        hidden: true
      register: left
    - name: Report
      ansible.builtin.debug:
        msg: "LEFT={{ left.files | map(attribute='path') | map('basename') | sort | to_json }}"
"""


def test_credentials_removed_when_the_work_fails(provisioned, roles_env, tmp_path, playbook_runner):
    secret = SECRET_MARK
    token = tmp_path / "token"
    token.write_text(secret + "-token\n")
    secrets = tmp_path / "secrets.json"  # a vars file: ansible-playbook -vvvv prints -e key=value arguments
    secrets.write_text(json.dumps({"secret": secret, "token_file": str(token)}))
    inv = inventory("sbx1", provisioned["id"])
    res = playbook_runner(CREDENTIALS_FAILING_PLAY, inv, roles_env, workdir=str(tmp_path),
                          extra_args=["-vvvv", "--diff", "-e", "@%s" % secrets])
    assert res.rc != 0, res
    assert "the work failed" in res.output
    assert secret not in res.output, "a credential leaked into the output"
    used = markers(res.stdout, "USED")
    assert used, res
    info = used[0]
    env = info["env"]
    assert re.match(r"^/workspace/\.scratch/credentials\.[a-z0-9]+/home$", env["HOME"]), env
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == env["HOME"] + "/.aws/credentials"
    assert env["TOOL_TOKEN_FILE"] == env["HOME"] + "/.config/tool/token"
    assert env["TOOL_PROFILE"] == "ci"
    assert info["aws_has_secret"] and info["token_ok"]
    staged = os.path.dirname(env["HOME"])
    for path, mode in info["modes"].items():
        is_file = path.endswith(("/credentials", "/token"))
        assert mode == ("0o600" if is_file else "0o700"), (path, mode)
    assert staged in info["modes"]

    check = playbook_runner(CHECK_SCRATCH_PLAY, inv, roles_env, workdir=str(tmp_path))
    assert check.rc == 0, check
    left = markers(check.stdout, "LEFT")[0]
    assert os.path.basename(staged) not in left, "the staged credentials survived the failed play"
    assert "credentials.crashed1" not in left, "the sweep missed a directory older than 120 minutes"
    assert "credentials.recent1" in left, "the sweep removed a recent directory"


def test_credentials_scratch_outside_workspace_fails_at_once(provisioned, roles_env, tmp_path, playbook_runner):
    play = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: microvm.sandbox.credentials
      vars:
        credentials_scratch_dir: /tmp/creds
        credentials_files:
          - path: .netrc
            content: "machine example login me password {{ secret }}"
"""
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"secret": SECRET_MARK}))
    res = playbook_runner(play, inventory("sbx2", provisioned["id"]), roles_env, workdir=str(tmp_path),
                          extra_args=["-vvv", "-e", "@%s" % secrets])
    assert res.rc != 0
    assert "/tmp/creds" in res.output and "only transfers files under /workspace" in res.output, res
    assert SECRET_MARK not in res.output


EXPORT_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: Make a project with caches, a user's own credentials file and a credential directory
      ansible.builtin.shell: |
        set -e
        mkdir -p /workspace/home/proj/.cache /workspace/home/proj/pkg/__pycache__ /workspace/data /workspace/.scratch/credentials.x1/home
        mkdir -p /workspace/home/app
        echo hello > /workspace/home/proj/a.txt
        echo data > /workspace/data/d.txt
        echo junk > /workspace/home/proj/.cache/junk
        echo pyc > /workspace/home/proj/pkg/__pycache__/m.cpython-311.pyc
        echo code > /workspace/home/proj/pkg/m.py
        echo '{"user": "mine"}' > /workspace/home/app/credentials.json
        echo secret > /workspace/.scratch/credentials.x1/home/token
      changed_when: true
    - name: Export while credentials are staged inside the exported tree
      block:
        - name: Stage credentials under home (a scratch dir the export would otherwise take)
          ansible.builtin.include_role:
            name: microvm.sandbox.credentials
          vars:
            credentials_scratch_dir: /workspace/home/.creds
            credentials_files:
              - path: .netrc
                content: "machine example login me password staged-secret"
        - name: Export
          ansible.builtin.include_role:
            name: microvm.sandbox.workspace_export
          vars:
            workspace_export_paths: ["{{ paths }}"]
            workspace_export_dest: "{{ dest }}"
        - name: Report
          ansible.builtin.debug:
            msg: "RESULT={{ workspace_export_result | to_json }}"
        - name: Report the staged directory
          ansible.builtin.debug:
            msg: "STAGED={{ credentials_dir | to_json }}"
      always:
        - name: Remove the credentials
          ansible.builtin.include_role:
            name: microvm.sandbox.credentials
            tasks_from: cleanup
    - name: Remove the seeded credential directory
      ansible.builtin.file:
        path: /workspace/.scratch/credentials.x1
        state: absent
"""


@pytest.mark.parametrize("paths", [".", "home"])
def test_workspace_export(provisioned, roles_env, tmp_path, playbook_runner, paths):
    dest = tmp_path / "out" / "ws.tar.gz"
    inv = inventory("sbx3", provisioned["id"])
    res = playbook_runner(EXPORT_PLAY, inv, roles_env, workdir=str(tmp_path),
                          extra_args=["-e", "dest=%s" % dest, "-e", "paths=%s" % paths])
    assert res.rc == 0, res
    result = markers(res.stdout, "RESULT")[0]
    assert result["dest"] == str(dest)
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    assert result["sha256"] == digest
    with tarfile.open(str(dest)) as tar:
        names = [n[2:] if n.startswith("./") else n for n in tar.getnames()]
    assert "home/proj/a.txt" in names and "home/proj/pkg/m.py" in names, names
    assert not [n for n in names if ".cache" in n or "__pycache__" in n or ".scratch" in n], names
    # exactly what the credentials role staged is left out: the user's own credentials.json stays
    staged = markers(res.stdout, "STAGED")[0]
    assert staged.startswith("/workspace/home/.creds/credentials."), staged
    assert "home/app/credentials.json" in names, names
    assert not [n for n in names if n.startswith("home/.creds/credentials.")], names
    assert ("data/d.txt" in names) == (paths == "."), names

    check = playbook_runner(CHECK_SCRATCH_PLAY, inv, roles_env, workdir=str(tmp_path))
    assert check.rc == 0, check
    left = markers(check.stdout, "LEFT")[0]
    assert not [n for n in left if n.startswith("export.")], "an export archive was left in the guest: %s" % left


def test_workspace_export_refuses_paths_outside_workspace(provisioned, roles_env, tmp_path, playbook_runner):
    res = playbook_runner(EXPORT_PLAY, inventory("sbx4", provisioned["id"]), roles_env, workdir=str(tmp_path),
                          extra_args=["-e", "dest=%s" % (tmp_path / "x.tgz"), "-e", "paths=/etc"])
    assert res.rc != 0
    assert "/etc" in res.output and "only transfers files under /workspace" in res.output, res


@pytest.mark.slow
def test_demo_playbook_on_the_base_template(plane, roles_env, tmp_path):
    """The demo by FQCN, as hack/demo.sh runs it (its inventory, deprecation warnings on) but without the image
    pipeline: it must say it fell back, pass, print no warning of its own, and leave no session."""
    helpers = conftest()
    env = helpers.ansible_env(dict(roles_env, MICROVM_DEMO_BUILD_IMAGE="false",
                                   MICROVM_SANDBOX_STATE_DIR=str(tmp_path / "state")))
    env.pop("ANSIBLE_DEPRECATION_WARNINGS", None)  # demo.sh leaves core's default (shown)
    proc = subprocess.run([os.path.join(helpers.BIN, "ansible-playbook"), "-i", os.path.join(ROOT, "hack", "demo-inventory.ini"),
                           "microvm.sandbox.demo"], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    res = helpers.Result(proc.returncode, proc.stdout, proc.stderr, str(tmp_path))
    assert res.rc == 0, res.output[-5000:]
    out = res.output
    assert "[WARNING]" not in out and "[DEPRECATION WARNING]" not in out, out
    assert "FALLBACK: MICROVM_DEMO_BUILD_IMAGE=false" in out
    assert "rollback: README.md read" in out and "version 1, written by the demo." in out
    assert "0 live demo session(s) left" in out
    assert (tmp_path / "state" / "demo" / "workspace.tar.gz").exists()
    live = [s for s in plane.client().list_sessions() if s["name"].startswith("demo-")
            and not s["status"].endswith(("DESTROYING", "DESTROYED", "FAILED"))]
    assert live == []


def test_fanout_playbook_forks_the_prepared_session(plane, provisioned, roles_env, tmp_path, playbook_runner):
    """The fanout playbook forks the provisioned session's checkpoint twice, works in each copy, then deletes them."""
    res = playbook_runner("- ansible.builtin.import_playbook: microvm.sandbox.fanout\n", LOCALHOST, roles_env,
                          extra_args=["-e", "session_name=%s" % provisioned["name"], "-e", "checkpoint_label=provisioned",
                                      "-e", "fanout_count=2", "-e", "fanout_cleanup=true"], workdir=str(tmp_path))
    assert res.rc == 0, res.output[-4000:]
    forks = ["%s-fork-%d" % (provisioned["name"], i) for i in (1, 2)]
    for name in forks:
        assert "ok: [%s]" % name in res.output, res.output[-4000:]
        left = plane.client().find_session(name)
        assert not left or left["status"].endswith(("DESTROYING", "DESTROYED")), left


FORK_WHILE_STAGED_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: Stage credentials
      ansible.builtin.include_role:
        name: microvm.sandbox.credentials
      vars:
        credentials_files:
          - path: .netrc
            content: "machine example login me password {{ secret }}"
    - name: Fork while they are staged
      microvm.sandbox.session_fork:
        source: "{{ ansible_host }}"
        count: 1
      delegate_to: localhost
      register: refused_fork
      ignore_errors: true
    - name: Checkpoint while they are staged
      microvm.sandbox.checkpoint:
        session: "{{ ansible_host }}"
        label: while-staged
      delegate_to: localhost
      register: refused_checkpoint
      ignore_errors: true
    - name: Remember the staged directory
      ansible.builtin.set_fact:
        credentials_dir_staged: "{{ credentials_dir }}"
    - name: Report the refusals
      ansible.builtin.debug:
        msg: >-
          REFUSED={{ {'fork': refused_fork.msg | default(''), 'fork_failed': refused_fork is failed,
                      'checkpoint': refused_checkpoint.msg | default(''), 'checkpoint_failed': refused_checkpoint is failed,
                      'staged': credentials_dir} | to_json }}
    - name: Remove the credentials
      ansible.builtin.include_role:
        name: microvm.sandbox.credentials
        tasks_from: cleanup
    - name: Fork once they are gone
      microvm.sandbox.session_fork:
        source: "{{ ansible_host }}"
        count: 1
      delegate_to: localhost
      register: fork
    - name: Add the copy
      ansible.builtin.add_host:
        name: the-fork
        groups: forks
        ansible_host: "{{ fork.sessions[0].session_id }}"
        ansible_connection: microvm.sandbox.agent
        ansible_python_interpreter: /usr/bin/python3
      changed_when: false

- hosts: forks
  gather_facts: false
  tasks:
    - name: List /tmp and whatever the collection could have left in the copy
      ansible.builtin.shell: |
        find /tmp -mindepth 1 -maxdepth 1 -printf 'tmp %p\\n'
        find /workspace/.scratch/.microvm/staged-credentials -mindepth 1 -printf 'manifest %p\\n' 2>/dev/null
        test ! -e "{{ hostvars['sbx5'].credentials_dir_staged }}" || echo "staged {{ hostvars['sbx5'].credentials_dir_staged }}"
      register: listing
      changed_when: false
    - name: Report
      ansible.builtin.debug:
        msg: "LISTING={{ listing.stdout_lines | to_json }}"

- hosts: sbx
  gather_facts: false
  tasks:
    - name: Delete the copy
      microvm.sandbox.session_fork:
        source: "{{ ansible_host }}"
        state: absent
      delegate_to: localhost
"""


def test_no_fork_or_checkpoint_while_credentials_are_staged_and_nothing_left_in_the_copy(
        plane, provisioned, roles_env, tmp_path, playbook_runner):
    """Issue 42: a fork (and a checkpoint) taken while credentials are staged would keep them after their cleanup.

    Both are refused, naming the staged directory and the fix; once the credentials are removed the fork is made, and
    the copy holds neither the credentials, nor their manifest, nor anything in /tmp.
    """
    secrets = tmp_path / "secrets.json"
    secrets.write_text(json.dumps({"secret": SECRET_MARK}))
    res = playbook_runner(FORK_WHILE_STAGED_PLAY, inventory("sbx5", provisioned["id"]), roles_env, workdir=str(tmp_path),
                          extra_args=["-e", "@%s" % secrets])
    assert res.rc == 0, res.output[-5000:]
    refused = markers(res.stdout, "REFUSED")[0]
    assert refused["fork_failed"] and refused["checkpoint_failed"], refused
    for what in ("fork", "checkpoint"):
        msg = refused[what]
        assert refused["staged"] in msg and "tasks_from: cleanup" in msg and "refusing to %s" % what in msg, msg
    listing = markers(res.stdout, "LISTING")[0]
    assert listing == [], "the copy holds what the collection left: %s" % listing
    assert SECRET_MARK not in res.output
    assert "while-staged" not in [c.get("label") for c in plane.client().list_checkpoints(provisioned["id"])]
