"""Every printed example runs as printed (issue 42): the YAML blocks of README.md and of each role's README, each
module's EXAMPLES (one playbook per module), and the inventory and connection plugins' EXAMPLES, through
ansible-playbook (ansible-inventory for the inventory plugin) against the local plane.

Only the substitutions a reader would make:

- A module's EXAMPLES, a list of tasks, becomes the `tasks:` of one play on `localhost`, or on the `sandboxes`
  group for the tasks that run inside a sandbox (SANDBOX_TASKS); a role README's play runs as it is.
- One inventory (INVENTORY): `localhost`, and the reader's sandbox `ci-job-42` in the group `sandboxes` the role
  READMEs target; `build-box`, the connection plugin's host, is that session too (its `ansible_host`).
- One variable file (VARS, passed with -e @vars.yml) defines what the examples leave to the reader: the vault
  variables (vault_github_token, vault_aws_credentials), package_index_token, and the ids of what the reader
  already has (notes_workspace_id, notes_config_id).
- What a reader has before running them (world fixture): the sessions the examples act on (ci-job-42 and
  build-base, permissions.default allow), a template named python-3-12 (registered from a local OCI layout: no
  registry), a saved config and a free workspace for the ids above, and the reader's project files (a src/ tree,
  a .gitignore'd project, a deploy.sh and dist/ in the sandbox, results to pull, archives to restore).

EXCLUDED lists, with the reason, what cannot run on this machine; it must stay short. Every session an example
creates is deleted after it (the examples delete most of their own); the world's sessions, template, config and
workspace at the end. Run alone: `pytest -p no:xdist tests/integration/test_examples_run.py` (about a minute).
"""
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import BIN, RECORDER, PlaybookRun, ansible_env  # noqa: E402
from microvm_examples import all_examples  # noqa: E402

# What cannot run here, and why: a whole source, or (source, task name) for one task of a module's EXAMPLES.
EXCLUDED = {
    "roles/template_image/README.md": "builds an image with apt from Debian mirrors and pushes it to a registry "
                                      "(minutes, network); tests/integration/test_roles_image.py runs the role",
    "roles/template_register/README.md": "runs template_image first (as above); test_roles_image.py runs both",
    "plugins/modules/template.py": "builds from registry.example.com, a registry this machine cannot reach; "
                                   "test_modules_checkpoints_templates.py runs the module on a local OCI layout",
    "plugins/modules/workspace_object.py": "needs an S3-compatible object store (a Spaces bucket) and its credentials",
    ("plugins/modules/session.py", "A sandbox with a repository cloned in, resumed on its own after a low-balance "
                                   "pause"): "the local plane has no network to clone GitHub repositories from "
                                             "and refuses a session with repos",
}

# Module EXAMPLES whose tasks run inside a sandbox (action plugins over the agent connection).
SANDBOX_TASKS = ("plugins/modules/sync.py", "plugins/modules/workspace_archive.py")

VARS = {
    "vault_github_token": "example-github-token",
    "package_index_token": "example-index-token",
    "vault_aws_credentials": "[default]\naws_access_key_id = EXAMPLEKEY\naws_secret_access_key = EXAMPLESECRET\n",
}

INVENTORY = """
all:
  hosts:
    localhost:
      ansible_connection: local
      ansible_python_interpreter: "{{ ansible_playbook_python }}"
    build-box:
      ansible_connection: microvm.sandbox.agent
      ansible_host: ci-job-42
  children:
    sandboxes:
      hosts:
        ci-job-42:
          ansible_connection: microvm.sandbox.agent
"""

# The reader's deploy script (roles/credentials/README.md runs ./deploy.sh with the staged credentials).
DEPLOY = "#!/bin/sh\ngrep -q aws_access_key_id \"$AWS_SHARED_CREDENTIALS_FILE\" && echo deployed\n"

GONE = ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED", "SESSION_STATUS_FAILED")
WORLD_SESSIONS = ("ci-job-42", "build-base")
TEMPLATE = "python-3-12"

EXAMPLES = dict(all_examples())


def excluded_tasks(source):
    return [task for key, _why in EXCLUDED.items() if isinstance(key, tuple) and key[0] == source for task in [key[1]]]


def as_playbook(source, text):
    """The example as the playbook a reader runs: plays as printed, a task list as the tasks of one play."""
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert len(docs) == 1, "%s: one YAML document expected" % source
    doc = docs[0]
    assert isinstance(doc, list) and doc, source
    if all("hosts" in item for item in doc):
        return text
    skip = excluded_tasks(source)
    names = [t.get("name") for t in doc]
    assert set(skip) <= set(names), "EXCLUDED names tasks %s is missing: %s" % (source, set(skip) - set(names))
    if skip:  # drop the excluded tasks only, keep the printed text of the others
        doc = [t for t in doc if t.get("name") not in skip]
        body = yaml.safe_dump(doc, sort_keys=False, width=200)
    else:
        body = text
    hosts = "sandboxes" if source in SANDBOX_TASKS else "localhost"
    return "- name: %s\n  hosts: %s\n  gather_facts: false\n  tasks:\n%s" % (
        source, hosts, textwrap.indent(body.strip("\n") + "\n", "    "))


def live_sessions(client):
    return dict((s["session_id"], s["name"]) for s in client.list_sessions() if s["status"] not in GONE)


def run(args, work, plane, extra_env=None, timeout=300):
    callbacks = os.path.join(work, "callbacks")
    os.makedirs(callbacks, exist_ok=True)
    with open(os.path.join(callbacks, "microvm_recorder.py"), "w") as f:
        f.write(RECORDER)
    record = os.path.join(work, "records.jsonl")
    if os.path.exists(record):
        os.unlink(record)
    extra = {"ANSIBLE_CALLBACK_PLUGINS": callbacks, "ANSIBLE_CALLBACKS_ENABLED": "microvm_recorder",
             "MICROVM_RECORD": record}
    extra.update(extra_env or {})
    env = ansible_env(plane, None, extra)
    # The inventory names localhost's Python, as a reader's does; the sandboxes find their own.
    env.pop("ANSIBLE_PYTHON_INTERPRETER", None)
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout, cwd=work, check=False)
    records = []
    if os.path.exists(record):
        with open(record) as f:
            records = [json.loads(line) for line in f]
    return PlaybookRun(proc, records)


def failures(res):
    """What failed, task by task (the screen's tail hides it behind the recap)."""
    out = ["rc=%s" % res.rc]
    for r in res.records:
        if r["status"] in ("failed", "unreachable"):
            result = r["result"]
            out.append("%s [%s] %s: %s %s" % (r["host"], r["status"], r["task"], result.get("msg"),
                                              (result.get("stderr") or "")[-500:]))
    return "\n".join(out) + "\n--- stderr\n" + res.stderr[-3000:]


def write(path, content, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(content)
    os.chmod(path, mode)


def tarball(path, files):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            data = content.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    write(path + ".sha256", "%s  %s\n" % (digest, os.path.basename(path)))


def guest_exec(client, session_id, script):
    out = client.request("POST", "/sessions/%s/sandbox/exec" % session_id, body={"argv": ["sh", "-c", script]})
    assert out.get("exit_code", 0) == 0, out
    return out


@pytest.fixture(scope="module")
def world(plane, tmp_path_factory):
    """What a reader has before running the examples (see the module's docstring), torn down after them."""
    if not shutil.which("umoci"):
        pytest.skip("umoci is not installed (make system-deps)")
    from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
    client = plane.client()
    before = set(live_sessions(client))
    work = str(tmp_path_factory.mktemp("examples"))
    workspace = client.create_workspace(1, name="review-notes")
    config = client.create_config("notes", "name: notes\nagent: custom\npermissions:\n  default: allow\n")
    variables = dict(VARS, notes_workspace_id=workspace["workspace_id"], notes_config_id=config["id"])
    write(os.path.join(work, "vars.yml"), yaml.safe_dump(variables))
    write(os.path.join(work, "inventory.yml"), INVENTORY)
    # The reader's project: a source tree, a project with a .gitignore, and archives an export made earlier.
    write(os.path.join(work, "src", "app.py"), "print('hello')\n")
    write(os.path.join(work, "src", "deploy.sh"), DEPLOY, 0o755)
    write(os.path.join(work, "src", "dist", "app.whl"), "wheel\n")
    write(os.path.join(work, "src", "build", "junk.o"), "junk\n")
    write(os.path.join(work, "project", ".gitignore"), "*.log\n")
    write(os.path.join(work, "project", "main.c"), "int main(void) { return 0; }\n")
    write(os.path.join(work, "project", "debug.log"), "noise\n")
    tarball(os.path.join(work, "out", "ci-42-workspace.tar.gz"), {"home/notes.txt": "restored\n"})
    tarball(os.path.join(work, "out", "project.tar.gz"), {"README": "the project\n"})
    # Two shards' JUnit files, as microvm.sandbox.ci pulls them back (junit_merge.py's EXAMPLES merge them).
    for shard, cases in (("shard-0", '<testcase classname="t" name="a"/><testcase classname="t" name="b"/>'),
                         ("shard-1", '<testcase classname="t" name="c"><failure message="no"/></testcase>')):
        write(os.path.join(work, "results", "shards", shard, "junit.xml"),
              '<?xml version="1.0"?>\n<testsuites><testsuite name="pytest">%s</testsuite></testsuites>\n' % cases)
    sessions = {}
    try:
        for name in WORLD_SESSIONS:
            made = client.create_session({"name": name, "agent": "custom", "keep_warm": True,
                                          "permissions": {"default": "allow"}})
            sessions[name] = client.wait_session(made["session_id"], timeout=120)["session_id"]
        # Inside the reader's sandbox: the project as synced in (sync.py's EXAMPLES push it again, deleting what
        # src/ does not have), a build's dist/, and results to bring out.
        guest_exec(client, sessions["ci-job-42"],
                   "mkdir -p /workspace/src/dist /workspace/results && cat > /workspace/src/deploy.sh <<'EOF'\n%s"
                   "EOF\nchmod 755 /workspace/src/deploy.sh && echo wheel > /workspace/src/dist/app.whl && "
                   "echo ok > /workspace/results/junit.xml" % DEPLOY)
        yield {"work": work, "client": client, "sessions": sessions, "before": before}
    finally:
        for sid, _name in live_sessions(client).items():
            if sid not in before:
                try:
                    client.delete_session(sid)
                except ApiError:
                    pass
        for sid in list(live_sessions(client)):
            if sid not in before:
                try:
                    client.wait_session(sid, until=GONE, timeout=60)
                except Exception:  # noqa: BLE001 - best effort: a teardown must not hide the test's failure
                    pass
        for call, ident in ((client.delete_config, config["id"]), (client.delete_workspace, workspace["workspace_id"])):
            try:
                call(ident)
            except ApiError:
                pass


def run_example(world, plane, source):
    """Run one example as a playbook; returns the PlaybookRun, and deletes any session it left behind (other than
    the world's), failing the test when it did."""
    work = world["work"]
    with open(os.path.join(work, "play.yml"), "w") as f:
        f.write(as_playbook(source, EXAMPLES[source]))
    before = live_sessions(world["client"])
    res = run([os.path.join(BIN, "ansible-playbook"), "-i", "inventory.yml", "-e", "@vars.yml", "play.yml"], work, plane)
    after = live_sessions(world["client"])
    left = dict((sid, name) for sid, name in after.items() if sid not in before and sid not in world["before"])
    for sid in left:
        world["client"].delete_session(sid)
    return res, left


# In the order a reader might run them: session.py first (it creates and deletes ci-job-42 of its own, so it runs
# before the world's ci-job-42 exists: see test_session_examples), then what acts on the world.
PLAYBOOK_SOURCES = [
    "README.md",
    "plugins/modules/size_info.py",
    "plugins/modules/environment_config.py",
    "plugins/modules/environment_config_info.py",
    "plugins/modules/persistent_workspace.py",
    "plugins/modules/persistent_workspace_info.py",
    "plugins/modules/template_info.py",
    "plugins/modules/session_fork.py",
    "plugins/modules/junit_merge.py",
    "plugins/modules/checkpoint.py",
    "plugins/modules/checkpoint_info.py",
    "plugins/modules/session_info.py",
    "plugins/modules/sync.py",
    "plugins/modules/workspace_archive.py",
    "plugins/connection/agent.py",
    "roles/credentials/README.md",
    "roles/workspace_export/README.md",
    "roles/workspace_restore/README.md",
]

# Beyond "it ran": what each example must have done, read from its task results.
CHECKS = {
    "README.md": lambda r, w: open(os.path.join(w, "out", "build.log")).read().startswith("built on Linux"),
    "plugins/modules/size_info.py": lambda r, w: r.result("A session of the smallest size")["changed"],
    "plugins/modules/environment_config.py": lambda r, w: (
        r.result("Start a session from it, with a persistent workspace")["session"]["workspace_id"]
        and r.changed("Delete the config once no session from it is active")),
    "plugins/modules/persistent_workspace.py": lambda r, w: r.changed("Delete the workspace once no session holds it"),
    "plugins/modules/session_fork.py": lambda r, w: (
        len(r.result("Four copies of it, one per test shard (a rerun forks nothing more)")["names"]) == 4
        and r.changed("Delete the copies when done")),
    "plugins/modules/checkpoint.py": lambda r, w: (
        r.changed("Roll back by id") and r.changed("Delete it")
        and r.result("On a rerun after the sources changed, take it again (the label names the new state, "
                     "the old one goes)")["replaced"]),
    "plugins/modules/junit_merge.py": lambda r, w: (
        (r.result("Merge the shards' results")["tests"], r.result("Merge the shards' results")["failures"]) == (3, 1)
        and os.path.exists(os.path.join(w, "results", "junit.xml"))),
    "plugins/modules/session_info.py": lambda r, w: "ci-job-42" in [
        s["name"] for s in r.result("Every usable or paused CI session")["sessions"]],
    "plugins/modules/sync.py": lambda r, w: open(os.path.join(w, "out", "results", "junit.xml")).read() == "ok\n",
    "plugins/connection/agent.py": lambda r, w: "ID=" in open(os.path.join(w, "out", "os-release")).read(),
    "roles/credentials/README.md": lambda r, w: "deployed" in r.result("Run the deployment with them")["stdout"],
    "roles/workspace_export/README.md": lambda r, w: tarfile.open(os.path.join(w, "out", "dist.tar.gz")).getnames(),
}


def test_every_example_is_run_or_excluded():
    """A new example cannot be left out silently: each source is run here, or EXCLUDED with a reason."""
    ran = set(PLAYBOOK_SOURCES) | {"plugins/modules/session.py", "plugins/inventory/sessions.py"}
    whole = set(key for key in EXCLUDED if isinstance(key, str))
    assert set(EXAMPLES) == ran | whole, sorted(set(EXAMPLES) ^ (ran | whole))
    assert not ran & whole
    assert len(EXCLUDED) <= 6, "keep the exclusions few"


@pytest.fixture(scope="module")
def python_template(plane, tmp_path_factory):
    """The reader's template python-3-12 (session.py's EXAMPLES start from it): a tiny image of a local OCI layout
    over the `sandbox` base, so no registry is needed."""
    if not shutil.which("umoci"):
        pytest.skip("umoci is not installed (make system-deps)")
    from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
    client = plane.client()
    layout = str(tmp_path_factory.mktemp("layout") / "layout")
    subprocess.run(["umoci", "init", "--layout", layout], check=True)
    subprocess.run(["umoci", "new", "--image", "%s:v1" % layout], check=True)
    template = client.create_template(TEMPLATE, "oci:%s:v1" % layout, "sandbox")
    client.wait_build(template["template_id"], timeout=300)
    yield TEMPLATE
    try:
        client.delete_template(template["template_id"])
    except ApiError:
        pass


def test_session_examples(plane, python_template, tmp_path):
    """session.py's EXAMPLES create, pause, resume, recreate and delete ci-job-42 (from the template python-3-12),
    so they run before the world's ci-job-42 exists; they need the template and the variables only."""
    from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
    client = plane.client()
    write(str(tmp_path / "vars.yml"), yaml.safe_dump(VARS))
    write(str(tmp_path / "inventory.yml"), INVENTORY)
    write(str(tmp_path / "play.yml"), as_playbook("plugins/modules/session.py", EXAMPLES["plugins/modules/session.py"]))
    before = live_sessions(client)
    assert "ci-job-42" not in before.values()
    try:
        res = run([os.path.join(BIN, "ansible-playbook"), "-i", "inventory.yml", "-e", "@vars.yml", "play.yml"],
                  str(tmp_path), plane)
        assert res.rc == 0, failures(res)
        created = res.result("A sandbox for the CI job, created once and reused by later runs")
        assert created["changed"] and created["session"]["idle_timeout_seconds"] == 900, created["session"]
        assert res.result("Pause it while nothing runs")["session"]["status"] == "SESSION_STATUS_PAUSED"
        assert res.changed("Recreate it with a shorter idle timeout") and res.changed("Delete it")
        assert res.changed("Create") and res.changed("Delete")
    finally:
        left = [sid for sid in live_sessions(client) if sid not in before]
        for sid in left:
            try:
                client.delete_session(sid)
            except ApiError:
                pass
    assert left == [], "session.py's EXAMPLES left sessions behind: %s" % left


@pytest.mark.parametrize("source", PLAYBOOK_SOURCES)
def test_example_runs_as_printed(world, plane, source):
    res, left = run_example(world, plane, source)
    output = res.stdout + res.stderr
    assert res.rc == 0, failures(res)
    assert plane.token not in output
    assert "[WARNING]" not in output, output[-6000:]
    assert res.records and not [r for r in res.records if r["status"] in ("failed", "unreachable")], failures(res)
    assert CHECKS.get(source, lambda r, w: True)(res, world["work"]), res
    assert left == {}, "%s left sessions behind: %s" % (source, left)


def test_inventory_examples(world, plane):
    """Both inventory configs of the inventory plugin's EXAMPLES, each in the file the example names; the second
    one's cache goes under a HOME of the test's own (the example's ~/.cache/microvm-inventory)."""
    work = world["work"]
    home = os.path.join(work, "home")
    os.makedirs(home, exist_ok=True)
    docs = EXAMPLES["plugins/inventory/sessions.py"].split("\n---\n")
    assert len(docs) == 2
    seen = {}
    for doc in docs:
        filename = next(line.split(":", 1)[1].strip() for line in doc.splitlines() if line.startswith("# file:"))
        write(os.path.join(work, filename), doc)
        res = run([os.path.join(BIN, "ansible-inventory"), "-i", filename, "--list"], work, plane,
                  extra_env={"HOME": home})
        assert res.rc == 0, res
        assert "[WARNING]" not in res.stderr, res.stderr
        seen[filename] = json.loads(res.stdout)
    everything = seen["sandboxes.microvm_sessions.yml"]
    assert set(WORLD_SESSIONS) <= set(everything["_meta"]["hostvars"]), sorted(everything["_meta"]["hostvars"])
    ci = seen["ci.microvm_sessions.yml"]
    assert sorted(ci["_meta"]["hostvars"]) == ["ci-job-42"], sorted(ci["_meta"]["hostvars"])
    assert "ci-job-42" in ci["status_ready"]["hosts"], sorted(ci)
    assert os.listdir(os.path.join(home, ".cache", "microvm-inventory")), "the example's cache was not written"
