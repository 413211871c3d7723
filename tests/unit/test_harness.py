"""The suite's own harness: hack/pytest-count.sh counts every pass, runs `serial` tests alone after the parallel
ones, fails on a failure and on an empty suite; no script truncates the run's log."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COUNT = os.path.join(ROOT, "hack", "pytest-count.sh")

SUITE = '''
import os
import pytest

def test_parallel_one():
    assert os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw")

def test_parallel_two():
    assert os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw")

@pytest.mark.serial
def test_alone():
    assert "PYTEST_XDIST_WORKER" not in os.environ

def test_skipped():
    pytest.skip("shown in the counts")
'''


def count(tmp_path, text: str | None, workers: int = 2) -> tuple[int, str, str]:
    """Run pytest-count.sh on a suite of one file (or none) in tmp_path: -> (exit code, counts line, output)."""
    (tmp_path / "suite").mkdir()
    if text is not None:
        (tmp_path / "suite" / "test_it.py").write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  serial: alone\n")
    # not this test's own xdist worker's variables: the inner passes must tell their own
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env.update(PYTEST_WORKERS=str(workers), PYTEST_PYTHON=sys.executable, PYTEST_ARGS="")
    proc = subprocess.run(["bash", COUNT, "demo", "suite"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    report = tmp_path / ".local" / "results" / "demo.txt"
    return proc.returncode, report.read_text().strip() if report.exists() else "", proc.stdout + proc.stderr


def test_parallel_then_serial_passes_are_counted_together(tmp_path):
    rc, counts, out = count(tmp_path, SUITE)
    assert rc == 0, out
    assert counts == "3 passed, 1 skipped", out
    # the serial test ran in the second pass, on its own
    assert out.index("-m not serial") < out.index("-m serial"), out
    assert (tmp_path / ".local" / "results" / "demo.xml").exists()
    assert (tmp_path / ".local" / "results" / "demo-serial.xml").exists()


def test_a_failure_in_either_pass_fails_the_suite_and_is_counted(tmp_path):
    rc, counts, out = count(tmp_path, SUITE.replace('assert "PYTEST_XDIST_WORKER" not in os.environ', "assert False"))
    assert rc == 1, out
    assert counts == "1 failed, 2 passed, 1 skipped", out


def test_one_worker_is_one_plain_pass(tmp_path):
    rc, counts, out = count(tmp_path, "def test_one():\n    pass\n", workers=1)
    assert rc == 0 and counts == "1 passed", out
    assert "-m serial" not in out and "-n " not in out


@pytest.mark.parametrize("text", [None, "def helper():\n    pass\n"])
def test_a_suite_that_collects_nothing_fails(tmp_path, text):
    rc, counts, out = count(tmp_path, text)
    assert rc == 1 and "must not be empty" in counts, out


def test_no_script_reopens_the_runs_stdout_or_stderr():
    # `tee /dev/stderr` (or `> /dev/stdout`) opens the path anew, with O_TRUNC: with `make test > log 2>&1` that
    # erases everything the run had logged before. Duplicate the descriptor instead (>&2).
    found = []
    for top in ("hack", ".ci", "bench"):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith((".sh", ".py")) or name == "run":
                    with open(path, errors="replace") as f:
                        for n, line in enumerate(f, 1):
                            code = line.split("#", 1)[0] if name.endswith(".sh") or name == "run" else line
                            if re.search(r"(tee|>)\s*(-a\s+)?/dev/std(out|err)", code):
                                found.append("%s:%d: %s" % (os.path.relpath(path, ROOT), n, line.strip()))
    assert found == []
