"""Molecule scenarios (extensions/molecule/) end to end against a real local control plane.

- the `default` scenario passes `molecule test` and leaves no session behind;
- when converge fails, `molecule test` (--destroy=always, the default) still
  runs destroy, which deletes the session;
- destroy deletes the sessions a crashed run recorded in its ledger even when
  the instance config never got written.

Each run gets its own MOLECULE_EPHEMERAL_DIRECTORY, so these tests never
touch the Molecule state of interactive runs or of `make molecule`.
"""
import os
import re
import shutil
import subprocess

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, ".venv", "bin")
COLLECTIONS = os.path.join(ROOT, ".local", "collections")
GONE = ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED", "SESSION_STATUS_FAILED")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "molecule")),
                                reason="molecule is not installed in .venv (make venv)")


def molecule(plane, ephemeral, *args, extra_env=None, timeout=1200):
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
    env.update(extra_env or {})
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
