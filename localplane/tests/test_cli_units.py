"""The local plane's CLI as a shell pipeline's first stage: a reader that stops early ends it quietly (issue 42)."""
import os
import signal
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "microvm_localplane"]


def _env():
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # localplane/
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_status_into_a_closed_pipe_ends_without_a_traceback(tmp_path, extra):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write meets EPIPE
    try:
        run = subprocess.run(CLI + ["status", "--state-dir", str(tmp_path)] + extra, stdout=write_end,
                             stderr=subprocess.PIPE, env=_env(), timeout=60, check=False)
    finally:
        os.close(write_end)
    assert "Traceback" not in run.stderr.decode() and "BrokenPipeError" not in run.stderr.decode(), run.stderr
    assert run.stderr == b""
    assert run.returncode == 128 + signal.SIGPIPE  # what a shell reports for a writer stopped by SIGPIPE


def test_status_piped_into_head_prints_its_first_line_only(tmp_path):
    run = subprocess.run(["bash", "-c", '"$@" | head -1', "-"] + CLI + ["status", "--state-dir", str(tmp_path)],
                         capture_output=True, env=_env(), timeout=60, check=False)
    assert run.returncode == 0 and run.stdout.decode().startswith("plane: not running"), run
    assert run.stdout.count(b"\n") == 1 and b"Traceback" not in run.stderr, run.stderr


def test_status_to_an_open_pipe_still_exits_0(tmp_path):
    run = subprocess.run(CLI + ["status", "--state-dir", str(tmp_path)], capture_output=True, env=_env(), timeout=60, check=False)
    assert run.returncode == 0 and b"sessions: 0 live of 0 recorded" in run.stdout, run
