"""Molecule scenarios (extensions/molecule/) end to end against a real local control plane.

- the `default` scenario passes `molecule test` and leaves no session behind;
- when converge fails, `molecule test` (--destroy=always, the default) still
  runs destroy, which deletes the session;
- destroy deletes the sessions a crashed run recorded in its ledger even when
  the instance config never got written;
- Ctrl-C (SIGINT to Molecule's process group) during create or converge leaves
  no session of the scenario READY (the cleanup callback's `molecule` option),
  while a normal `molecule create` + `molecule converge` keeps the session.

Each run gets its own MOLECULE_EPHEMERAL_DIRECTORY, so these tests never
touch the Molecule state of interactive runs or of `make molecule`.
"""
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, ".venv", "bin")
COLLECTIONS = os.path.join(ROOT, ".local", "collections")
GONE = ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED", "SESSION_STATUS_FAILED")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "molecule")),
                                reason="molecule is not installed in .venv (make venv)")


def molecule_env(plane, ephemeral, extra_env=None):
    env = dict(os.environ)
    env.update(plane.env)
    env.update({
        "PATH": BIN + os.pathsep + env.get("PATH", ""),
        "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS,
        "PYTHONPATH": os.pathsep.join([COLLECTIONS, os.path.join(ROOT, "localplane")]),
        "MOLECULE_EPHEMERAL_DIRECTORY": str(ephemeral),
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
        "NO_COLOR": "1",
    })
    env.pop("MICROVM_MOLECULE_FAIL_CONVERGE", None)
    env.pop("MICROVM_MOLECULE_PAUSE", None)
    env.update(extra_env or {})
    return env


def molecule(plane, ephemeral, *args, extra_env=None, timeout=1200):
    env = molecule_env(plane, ephemeral, extra_env)
    proc = subprocess.run([os.path.join(BIN, "molecule"), *args], cwd=ROOT, env=env,
                          capture_output=True, check=False, text=True, timeout=timeout)
    proc.output = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    return proc


def steps(output):
    """[(scenario, step, outcome)] from Molecule's log, in order (tty: `s ➜ step: Executed: X`, else `[s > step] Executed: X`)."""
    found = re.findall(r"(\w+)(?: ➜ | > )(\w+)\]?:? Executed: (\w+)", output)
    return list(found)


def sessions(plane, prefix):
    # every session, the destroyed ones too: the platform's default listing hides them
    return [s for s in plane.client().list_sessions(status="SESSION_STATUS_ALL")
            if (s.get("name") or "").startswith(prefix)]


def live(found):
    return [s for s in found if s.get("status") not in GONE]


def test_default_scenario_passes_and_leaves_no_session(plane, tmp_path):
    before = {s["session_id"] for s in sessions(plane, "molecule-default-")}
    run = molecule(plane, tmp_path / "default", "test", "-s", "default")
    assert run.returncode == 0, run.output[-8000:]
    done = steps(run.output)
    for step in ("create", "converge", "idempotence", "verify", "destroy"):
        assert ("default", step, "Successful") in done, (done, run.output[-8000:])
    made = [s for s in sessions(plane, "molecule-default-instance-") if s["session_id"] not in before]
    assert made, "no session was created by the scenario:\n" + run.output[-4000:]
    assert live(made) == [], made
    assert not (tmp_path / "default" / "microvm_sandbox_sessions.yml").exists()


def test_destroy_runs_after_failing_converge(plane, tmp_path):
    before = {s["session_id"] for s in sessions(plane, "molecule-failing-converge-")}
    run = molecule(plane, tmp_path / "failing", "test", "-s", "failing_converge",
                   extra_env={"MICROVM_MOLECULE_FAIL_CONVERGE": "1"})
    assert run.returncode != 0, run.output[-8000:]
    assert "Failing on purpose" in run.output
    done = steps(run.output)
    assert ("failing_converge", "converge", "Failed") in done, (done, run.output[-8000:])
    # Molecule's --destroy=always path: destroy still runs after the failure.
    after = done[done.index(("failing_converge", "converge", "Failed")):]
    assert ("failing_converge", "destroy", "Successful") in after, (done, run.output[-8000:])
    made = [s for s in sessions(plane, "molecule-failing-converge-instance-") if s["session_id"] not in before]
    assert made, "no session was created by the scenario:\n" + run.output[-4000:]
    assert live(made) == [], made


def test_destroy_deletes_sessions_recorded_before_a_crash(plane, tmp_path):
    ephemeral = tmp_path / "crash"
    run = molecule(plane, ephemeral, "create", "-s", "failing_converge")
    assert run.returncode == 0, run.output[-8000:]
    ledger = yaml.safe_load((ephemeral / "microvm_sandbox_sessions.yml").read_text())
    names = [entry["name"] for entry in ledger]
    assert len(names) == 1 and live(sessions(plane, names[0])), (ledger, sessions(plane, names[0]))
    # A run that died after the session was recorded and created, before
    # Molecule wrote its instance config and state.
    (ephemeral / "instance_config.yml").unlink()
    (ephemeral / "state.yml").unlink()
    run = molecule(plane, ephemeral, "destroy", "-s", "failing_converge")
    assert run.returncode == 0, run.output[-8000:]
    assert live(sessions(plane, names[0])) == []
    assert not (ephemeral / "microvm_sandbox_sessions.yml").exists()
    shutil.rmtree(ephemeral, ignore_errors=True)


class Interrupted:
    """`molecule ARGS` in a process group of its own (a terminal's foreground job), output to a file; .ctrl_c() sends
    SIGINT to the whole group as a terminal's Ctrl-C does, then waits for Molecule and for what outlives it."""

    def __init__(self, plane, ephemeral, *args, extra_env=None):
        self.log = str(ephemeral) + ".log"
        # A run started in the background (a CI runner's shell) inherits SIGINT ignored, and exec keeps it ignored:
        # a handler here while Molecule starts gives it the default disposition, as from a terminal.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with open(self.log, "w") as out:
                self.proc = subprocess.Popen([os.path.join(BIN, "molecule"), *args], cwd=ROOT,
                                             env=molecule_env(plane, ephemeral, extra_env), stdout=out,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                             start_new_session=True)
        finally:
            signal.signal(signal.SIGINT, previous)
        self.started = time.time()

    @property
    def output(self):
        with open(self.log) as f:
            return re.sub(r"\x1b\[[0-9;]*m", "", f.read())

    def wait_for(self, ready, timeout=120):
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, "molecule exited before it was interrupted:\n" + self.output[-6000:]
            found = ready()
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError("timed out waiting to interrupt molecule:\n" + self.output[-6000:])

    def ctrl_c(self, timeout=90):
        os.killpg(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout)
        # Molecule exits at once; the ansible-playbook it was running lives on in the group while it deletes.
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return self.proc.returncode
            time.sleep(0.2)
        raise AssertionError("processes of the interrupted run still live after %ss" % timeout)

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def assert_forgotten(ephemeral):
    """What destroy would have left: no ledger, an empty instance config, the scenario not created."""
    assert not (ephemeral / "microvm_sandbox_sessions.yml").exists()
    assert yaml.safe_load((ephemeral / "instance_config.yml").read_text()) == []
    state = yaml.safe_load((ephemeral / "state.yml").read_text())
    assert state["created"] is False and state["converged"] is False, state


def test_kept_session_survives_converge_and_ctrl_c_in_converge_deletes_it(plane, tmp_path):
    """`molecule create`, then `molecule converge`: the same session, READY. Then Ctrl-C while a converge task runs
    in the sandbox: Molecule runs no destroy, and yet the session is deleted and Molecule's state forgets it."""
    ephemeral = tmp_path / "kept"
    run = molecule(plane, ephemeral, "create", "-s", "interrupted")
    assert run.returncode == 0, run.output[-8000:]
    assert "keeping the 1 session(s) it created (Molecule's destroy deletes them)" in run.output, run.output[-4000:]
    (kept,) = [entry["session"] for entry in yaml.safe_load((ephemeral / "instance_config.yml").read_text())]
    (created,) = live(sessions(plane, kept))
    assert created["status"] == "SESSION_STATUS_READY", created

    run = molecule(plane, ephemeral, "converge", "-s", "interrupted")
    assert run.returncode == 0, run.output[-8000:]
    assert ("interrupted", "create", "Skipped") in steps(run.output) or "already created" in run.output, run.output
    # a normal run keeps the session the user made: the same one, still READY
    assert [(s["session_id"], s["status"]) for s in live(sessions(plane, kept))] == [
        (created["session_id"], "SESSION_STATUS_READY")]

    job = Interrupted(plane, ephemeral, "converge", "-s", "interrupted", extra_env={"MICROVM_MOLECULE_PAUSE": "converge"})
    try:
        job.wait_for(lambda: "TASK [Pause in the sandbox until interrupted]" in job.output)
        time.sleep(1)  # the task's command runs in the sandbox
        assert live(sessions(plane, kept)), job.output[-4000:]
        rc = job.ctrl_c()
    finally:
        job.kill()
    assert rc != 0, job.output[-6000:]
    assert "Aborted!" in job.output, job.output[-6000:]
    # Molecule itself ran no destroy step: the converge playbook's callback deleted the session
    assert ("interrupted", "destroy", "Successful") not in steps(job.output)
    assert live(sessions(plane, kept)) == [], sessions(plane, kept)
    assert_forgotten(ephemeral)


def test_ctrl_c_during_create_leaves_no_session(plane, tmp_path):
    """Ctrl-C while create's session task waits for the new session: the task never reports it; the ledger names it."""
    ephemeral = tmp_path / "create"
    prefix = "molecule-interrupted-instance-"
    before = {s["session_id"] for s in sessions(plane, prefix)}
    job = Interrupted(plane, ephemeral, "converge", "-s", "interrupted")
    try:
        (session,) = job.wait_for(lambda: [s for s in sessions(plane, prefix) if s["session_id"] not in before])
        rc = job.ctrl_c()
    finally:
        job.kill()
    assert rc != 0, job.output[-6000:]
    assert ("interrupted", "create", "Successful") not in steps(job.output), job.output[-6000:]
    assert live(sessions(plane, session["name"])) == [], sessions(plane, session["name"])
    assert not (ephemeral / "microvm_sandbox_sessions.yml").exists()
    assert yaml.safe_load((ephemeral / "state.yml").read_text())["created"] is False
