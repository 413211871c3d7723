"""What a warm module's process inherits from the runner that bears on how it waits for its commands.

Issue 45's 1 s `command` task is ansible-core's run_command race (bench/core_run_command_race.py): the cold road
has it too. These tests keep the runner out of it: the module's process must start with the signal state a cold
`python3` running the same payload has (no handler, ignored or blocked signal of the runner's, e.g. SIGCHLD), so
core's waitpid() and select() see in a warm run exactly what they see in a cold one.
"""
import json
import os
import re
import subprocess
import sys

from microvm_warm_testing import LocalRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
COLLECTIONS = os.path.join(ROOT, ".local", "collections")

# A real `command` payload of this core; the shell's parent ($PPID) is the module's process.
BUILD = r'''
import sys
from ansible.executor import module_common
from ansible.plugins.loader import init_plugin_loader, module_loader
from ansible.template import Templar
init_plugin_loader([])
built = module_common.modify_module(
    module_name="ansible.builtin.command", module_path=module_loader.find_plugin("ansible.builtin.command"),
    module_args={"_raw_params": "cat /proc/$PPID/status", "_uses_shell": True}, templar=Templar(),
    task_vars={"ansible_python_interpreter": sys.executable})
sys.stdout.buffer.write(built.b_module_data)
'''
SIGNAL_LINES = re.compile(r"^(SigBlk|SigIgn|SigCgt):\s*(\S+)$", re.M)


def command_payload(tmp_path):
    done = subprocess.run([sys.executable, "-c", BUILD], capture_output=True, timeout=120, check=False, cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([COLLECTIONS, os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def module_signals(stdout):
    """The module process's blocked, ignored and caught signal masks, from the task's result."""
    status = json.loads(stdout)["stdout"]
    found = dict(SIGNAL_LINES.findall(status))
    assert set(found) == {"SigBlk", "SigIgn", "SigCgt"}, status
    return found


def test_a_warm_module_starts_with_the_signal_state_of_a_cold_one(tmp_path):
    payload = command_payload(tmp_path)
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path)}
    cold = subprocess.run([sys.executable, "-"], input=payload, capture_output=True, timeout=120, check=False,
                          cwd=str(tmp_path), env=env)
    assert cold.returncode == 0, cold.stderr[-3000:]
    runner = LocalRunner(tmp_path, env=env)
    try:
        warm = [runner.run(rid, {}, payload) for rid in (1, 2)]  # the first run preloads, the second is a plain fork
    finally:
        runner.close()
    for rc, out, err in warm:
        assert rc == 0, (out, err)
        assert module_signals(out) == module_signals(cold.stdout)
    assert int(module_signals(cold.stdout)["SigBlk"], 16) == 0  # nothing blocked: SIGCHLD reaches waitpid's side
