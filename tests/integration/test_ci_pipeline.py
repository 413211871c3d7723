"""A CI job on sandboxes, end to end (issue 29): the whole flow through the real stack, failures injected at each
play, and after every run a check with `microvm-localplane status` that no session, guest, container or mount
is left. Its own plane, so that "nothing left" means this test's runs only.

pytest comes into the sandbox as wheels pushed by sync (no network inside): they are fetched once into
.local/wheels with the controller's pip (its cache, or the configured index); without them the test skips.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from ansible_runner_util import ROOT, ansible_env, run_playbook
from microvm_plane_testing import start_local_plane, stop_local_plane, unique_name

PIPELINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ci_pipeline.yml")
PROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ci_project")
WHEELS = os.path.join(ROOT, ".local", "wheels")


@pytest.fixture(scope="module")
def wheels():
    if not (os.path.isdir(WHEELS) and any(n.startswith("pytest-") for n in os.listdir(WHEELS))):
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                               "--python-version", "3.11", "--dest", WHEELS, "pytest"],
                              capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            pytest.skip("no pytest wheels for the sandbox (pip download failed: %s)" % proc.stderr[-300:])
    return WHEELS


@pytest.fixture(scope="module")
def ci_plane(tmp_path_factory):
    state = str(tmp_path_factory.mktemp("ci-plane"))
    handle = start_local_plane(state)
    try:
        yield handle
    finally:
        stop_local_plane(handle)


def status(plane):
    proc = subprocess.run([sys.executable, "-m", "microvm_localplane", "status", "--json", "--state-dir",
                           plane.state_dir], capture_output=True, text=True, timeout=60, check=True,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "localplane")))
    return json.loads(proc.stdout)


def assert_nothing_left(plane, running=True):
    """No session, guest, container or mount; the plane's own dir under /run stays (empty) while it runs."""
    st = status(plane)
    left = {k: st[k] for k in ("live_sessions", "guests", "containers", "mounts") if st[k]}
    assert st["plane"]["running"] is running, st
    assert not left, left
    for d in st["run_dirs"]:
        assert running and os.listdir(d) == [], st


def pipeline(plane, tmp_path, wheels, args=(), env=None):
    run = unique_name("ci")
    results = tmp_path / "results"
    play = "- ansible.builtin.import_playbook: %s\n" % PIPELINE
    extra = ["-e", "run=%s project=%s wheels=%s results=%s" % (run, PROJECT, wheels, results)] + list(args)
    return run, results, run_playbook(plane, tmp_path, play, args=extra, env=env, timeout=600)


def failures(out):
    """What failed, for an assertion message."""
    return [(r["task"], r["host"], r["status"], r["result"].get("msg"), r["result"].get("stderr", "")[-800:])
            for r in out.records if r["status"] in ("failed", "unreachable")]


def test_the_whole_flow_and_nothing_left(ci_plane, tmp_path, wheels):
    run, results, out = pipeline(ci_plane, tmp_path, wheels)
    assert out.rc == 0, failures(out)
    assert "4 passed" in out.result("Run the suite")["stdout"]
    forks = out.result("Fork two copies from it")["names"]
    assert len(forks) == 2
    for name in forks:
        junit = (results / name / "junit.xml").read_text()
        assert 'tests="2"' in junit and 'failures="0"' in junit, junit
    assert "def add" in out.result("Read the file again")["stdout"]
    assert_nothing_left(ci_plane)


@pytest.mark.parametrize("where", ["start", "work", "checkpoint", "forks", "rollback"])
def test_a_failure_at_each_play_fails_the_run_and_leaves_nothing(ci_plane, tmp_path, wheels, where):
    _run, _results, out = pipeline(ci_plane, tmp_path, wheels, ["-e", "fail_at=%s" % where])
    assert out.rc == 2, out
    assert "injected" in out.stdout, out
    assert out.result("Delete the session")["changed"] is True
    assert_nothing_left(ci_plane)


@pytest.mark.parametrize("where", ["work", "forks"])
def test_every_host_unreachable_still_tears_down(ci_plane, tmp_path, wheels, where):
    _run, _results, out = pipeline(ci_plane, tmp_path, wheels, ["-e", "unreachable_at=%s" % where])
    assert out.rc in (2, 4), out
    assert "UNREACHABLE" in out.stdout, out
    assert out.result("Delete the session")["changed"] is True
    assert_nothing_left(ci_plane)


CALLBACK = {"ANSIBLE_CALLBACKS_ENABLED": "microvm_recorder,microvm.sandbox.cleanup"}


def test_cleanup_callback_deletes_what_a_failed_run_created_and_keeps_the_rest(ci_plane, tmp_path, wheels):
    kept = ci_plane.client().create_session({"name": unique_name("kept"), "agent": "custom"})
    try:
        # keep=true: the playbook's own teardown is off, so only the callback can delete the session and forks
        _run, _results, out = pipeline(ci_plane, tmp_path, wheels, ["-e", "fail_at=rollback", "-e", "keep=true"],
                                       env=CALLBACK)
        assert out.rc == 2, out
        assert "microvm.sandbox.cleanup: the run failed; deleted the 3 session(s) it created" in out.stdout, out
        st = status(ci_plane)
        assert [s["session_id"] for s in st["live_sessions"]] == [kept["session_id"]]
    finally:
        ci_plane.client().delete_session(kept["session_id"])
        ci_plane.client().wait_session(kept["session_id"], until=frozenset(["DESTROYED"]), gone_ok=True)
    assert_nothing_left(ci_plane)


def test_cleanup_callback_when_failure_keeps_a_successful_runs_sessions(ci_plane, tmp_path, wheels):
    run, _results, out = pipeline(ci_plane, tmp_path, wheels, ["-e", "keep=true"],
                                  env=dict(CALLBACK, MICROVM_CLEANUP_WHEN="failure"))
    assert out.rc == 0, out
    assert "keeping the 3 session(s) it created (when=failure)" in out.stdout
    client = ci_plane.client()
    session = client.find_session(run)
    assert session is not None
    for fork in client.forks_of(session["session_id"]):
        client.delete_session(fork["session_id"])
    client.delete_session(session["session_id"])
    for s in client.list_sessions():
        client.wait_session(s["session_id"], until=frozenset(["DESTROYED"]), gone_ok=True)
    assert_nothing_left(ci_plane)


@pytest.mark.parametrize("sig, how", [(signal.SIGINT, "was interrupted"), (signal.SIGTERM, "was terminated")])
def test_cleanup_callback_on_ctrl_c_or_a_cancelled_job(ci_plane, tmp_path, wheels, sig, how):
    """SIGINT (Ctrl-C) or SIGTERM (a CI runner cancelling the job) while the job works: ansible-playbook stops
    without a recap, and the callback still deletes what the run created."""
    (tmp_path / "callbacks").mkdir()
    run = unique_name("ci")
    env = ansible_env(ci_plane, tmp_path, {"ANSIBLE_CALLBACKS_ENABLED": "microvm.sandbox.cleanup"})
    play = tmp_path / "slow.yml"
    marker = tmp_path / "created"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - microvm.sandbox.session: {name: %s}\n"
        "    - ansible.builtin.file: {path: %s, state: touch, mode: '0644'}\n"
        "    - ansible.builtin.pause: {seconds: 120}\n" % (run, marker))
    # A terminal's Ctrl-C reaches a process that handles SIGINT; a test run started in the background (a CI
    # runner's shell, `make test &`) inherits SIGINT ignored, and an exec keeps it ignored: handle it here while
    # the playbook starts, so it starts with the default disposition, as from a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([os.path.join(ROOT, ".venv", "bin", "ansible-playbook"), "-i", "localhost,", "-c",
                                 "local", str(play)], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        # the session task has reported (a task interrupted before it reports is the callback's documented limit)
        deadline = time.time() + 120
        while time.time() < deadline and not marker.exists() and proc.poll() is None:
            time.sleep(0.2)
        assert marker.exists() and ci_plane.client().find_session(run) is not None
        proc.send_signal(sig)
        out, _err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "microvm.sandbox.cleanup: the run %s; deleted the 1 session(s) it created" % how in out, out
    assert_nothing_left(ci_plane)


CI_PYTHON = "/workspace/venv/bin/python"


def ci_playbook(plane, tmp_path, wheels, project=PROJECT, shards=3, extra=None):
    """The shipped playbook microvm.sandbox.ci by its FQCN, on `project` (pytest from the pushed wheels)."""
    run = unique_name("cij")
    results = tmp_path / "ci-results"
    args = {
        "ci_name": run, "ci_project": str(project), "ci_shards": shards, "ci_results_dir": str(results),
        "ci_push": [{"src": wheels, "dest": "/workspace/wheels"}],
        "ci_setup_command": "python3 -m venv /workspace/venv && /workspace/venv/bin/pip install --quiet --no-index "
                            "--find-links /workspace/wheels pytest",
        "ci_python": CI_PYTHON, "ci_pytest_args": "-o python_files=check_*.py tests",
        "ci_env": {"PYTHONPATH": "/workspace/project/src"},
        # the shard's own view of its index, as an artifact: the shards must each have had another one
        "ci_command": 'echo "$SHARD_INDEX/$SHARD_COUNT" > shard.txt && %s -m pytest -p microvm_ci_shard '
                      '-p no:cacheprovider --junitxml="$CI_JUNIT_XML" -o python_files=check_*.py tests' % CI_PYTHON,
        "ci_artifacts": ["shard.txt", "src/calc"],
    }
    args.update(extra or {})
    play = "- ansible.builtin.import_playbook: microvm.sandbox.ci\n"
    return run, results, run_playbook(plane, tmp_path, play, args=["-e", json.dumps(args)], timeout=600)


def junit_cases(path):
    """{suite name: [test names]} of a merged JUnit file."""
    import xml.etree.ElementTree as ET
    root = ET.parse(str(path)).getroot()
    assert root.tag == "testsuites", root.tag
    return {s.get("name"): [c.get("name") for c in s.iter("testcase")] for s in root.findall("testsuite")}


def test_ci_playbook_shards_merge_artifacts_and_nothing_left(ci_plane, tmp_path, wheels):
    run, results, out = ci_playbook(ci_plane, tmp_path, wheels)
    assert out.rc == 0, failures(out)
    forks = out.result("Fork the shards")["names"]
    assert len(forks) == 3
    cases = junit_cases(results / "junit.xml")
    assert sorted(cases) == ["shard-0/pytest", "shard-1/pytest", "shard-2/pytest"], cases
    every = [name for names in cases.values() for name in names]
    # every test of the suite ran once, in exactly one shard, and every shard ran some
    assert sorted(every) == ["test_add", "test_mul", "test_runs_in_a_venv", "test_version"], cases
    assert all(cases.values()), cases
    merged = out.result("Merge the shards' JUnit files")
    assert (merged["tests"], merged["failures"], merged["errors"]) == (4, 0, 0), merged
    seen = sorted((results / "shards" / ("shard-%d" % i) / "artifacts" / "shard.txt").read_text().strip()
                  for i in range(3))
    assert seen == ["0/3", "1/3", "2/3"], seen
    for i in range(3):
        assert "def add" in (results / "shards" / ("shard-%d" % i) / "artifacts" / "src" / "calc" / "__init__.py").read_text()
    assert sorted(r["host"] for r in out.records if r["task"] == "Delete the shard" and r["result"].get("changed")) \
        == sorted(forks)
    assert ci_plane.client().find_session(run) is None
    assert_nothing_left(ci_plane)


def test_ci_playbook_a_failing_shard_fails_the_run_names_it_and_cleans_up(ci_plane, tmp_path, wheels):
    project = tmp_path / "project"
    shutil.copytree(PROJECT, str(project))
    # collected last (5th item): round robin over 2 shards puts it in shard-0, alone with a failure
    (project / "tests" / "check_zz_broken.py").write_text("def test_broken():\n    assert 1 + 1 == 3\n")
    _run, results, out = ci_playbook(ci_plane, tmp_path, wheels, project=project, shards=2)
    assert out.rc == 2, out
    fail = out.result("Fail the run when any part failed")
    assert "Failed shards: shard-0." in fail["msg"], fail
    assert "shard-0 (1 of 2" in out.stdout and "exit code 1" in out.stdout, out
    cases = junit_cases(results / "junit.xml")
    assert "test_broken" in cases["shard-0/pytest"] and "test_broken" not in cases["shard-1/pytest"], cases
    merged = out.result("Merge the shards' JUnit files")
    assert (merged["tests"], merged["failures"]) == (5, 1), merged
    assert len([r for r in out.records if r["task"] == "Delete the shard" and r["result"].get("changed")]) == 2
    assert_nothing_left(ci_plane)


def test_ci_playbook_a_failing_setup_fails_the_run_and_leaves_nothing(ci_plane, tmp_path, wheels):
    _run, _results, out = ci_playbook(ci_plane, tmp_path, wheels, extra={"ci_setup_command": "exit 7"})
    assert out.rc == 2, out
    assert "The session was not prepared." in out.result("Fail the run when any part failed")["msg"]
    assert not [r for r in out.records if r["task"] == "Fork the shards" and r["status"] == "ok"]
    assert_nothing_left(ci_plane)


def test_ci_playbook_kept_session_reruns_on_new_sources(ci_plane, tmp_path, wheels):
    """ci_keep with a labelled checkpoint: the session stays (no shard does), and a rerun on it tests the new
    sources (the checkpoint is retaken), not those the kept checkpoint holds."""
    project = tmp_path / "project"
    shutil.copytree(PROJECT, str(project))
    extra = {"ci_keep": True, "ci_checkpoint_label": "ci-ready"}
    run, results, out = ci_playbook(ci_plane, tmp_path, wheels, project=project, shards=2, extra=extra)
    assert out.rc == 0, failures(out)
    client = ci_plane.client()
    try:
        session = client.find_session(run)
        assert session is not None and not client.forks_of(session["session_id"])
        (project / "tests" / "check_more.py").write_text("def test_new():\n    pass\n")
        extra["ci_name"] = run
        _run, results, again = ci_playbook(ci_plane, tmp_path, wheels, project=project, shards=2, extra=extra)
        assert again.rc == 0, failures(again)
        assert again.result("Start the session")["created"] is False
        every = sorted(n for names in junit_cases(results / "junit.xml").values() for n in names)
        assert every == ["test_add", "test_mul", "test_new", "test_runs_in_a_venv", "test_version"], every
        assert [cp["label"] for cp in client.list_checkpoints(session["session_id"])] == ["ci-ready"]
    finally:
        left = client.find_session(run)
        if left is not None:
            client.delete_session(left["session_id"])
            client.wait_session(left["session_id"], until=frozenset(["DESTROYED"]), gone_ok=True)
    assert_nothing_left(ci_plane)


def test_ci_playbook_an_unreachable_shard_is_deleted_by_the_last_play(ci_plane, tmp_path, wheels):
    """Shard 1 kills every process of its guest, the agent included: it goes unreachable, so its own deletion
    (in `always`, which an unreachable host never runs) does not happen, and the last play deletes it."""
    command = ('if [ "$SHARD_INDEX" = 1 ]; then kill -9 -1; sleep 5; fi; %s -m pytest -p microvm_ci_shard '
               '--junitxml="$CI_JUNIT_XML" -o python_files=check_*.py tests' % CI_PYTHON)
    _run, results, out = ci_playbook(ci_plane, tmp_path, wheels, shards=2, extra={"ci_command": command})
    assert out.rc == 4, out
    assert out.result("Fail the run when any part failed")["msg"] == "The CI job failed. Failed shards: shard-1."
    left = out.result("Delete the shards not deleted yet (unreachable, or their deletion failed)")
    assert [r["item"]["ci_shard_name"] for r in left["results"]] == ["shard-1"], left
    assert list(junit_cases(results / "junit.xml")) == ["shard-0/pytest"]
    assert_nothing_left(ci_plane)


def test_down_leaves_nothing_behind(ci_plane, tmp_path, wheels):
    """Last: a session running when the plane stops; afterwards not even its dir under /run is left."""
    client = ci_plane.client()
    session = client.create_session({"name": unique_name("left"), "agent": "custom"})
    client.wait_session(session["session_id"])
    st = status(ci_plane)
    assert st["containers"] and st["mounts"] and st["run_dirs"] and st["guests"], st
    down = subprocess.run([sys.executable, "-m", "microvm_localplane", "down", "--state-dir", ci_plane.state_dir],
                          capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "localplane")))
    assert down.returncode == 0 and "stopped the local control plane" in down.stdout, down
    st = status(ci_plane)
    assert not st["plane"]["running"] and not st["containers"] and not st["mounts"] and not st["run_dirs"], st
    # the session's state stays for a restarted plane (guests lists state dirs), but nothing runs or is mounted
    assert st["guests"] == [session["session_id"]]
