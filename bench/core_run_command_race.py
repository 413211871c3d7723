# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Does this ansible-core's AnsibleModule.run_command sleep a whole select() timeout (1 s) when its command exits
between the loop's two cmd.poll() calls? (issue 45: the warm `command` task that now and then takes 1.03 s.)

What strace showed in the guest (the `command` module's process, with its `echo`):

    poll([{fd=3, POLLIN}, {fd=6, POLLIN}], 2, 1000) = 2 ([{fd=3, revents=POLLHUP}, {fd=6, revents=POLLHUP}])
    wait4(578, ..., WNOHANG) = 0                   <- the loop's `if` : cmd.poll() is None, echo still exiting
    --- SIGCHLD {si_pid=578, CLD_EXITED} ---
    wait4(578, [WEXITSTATUS 0], WNOHANG) = 578     <- the loop's `elif`: cmd.poll() is 0, so it does not wait
    poll([], 0, 1000) = 0 (Timeout)                <- no pipe left and nothing to wait for: one second asleep

coreutils' echo closes its stdout and stderr itself before exit_group(), so the module sees both pipes at end of
file while echo is still exiting; when echo becomes reapable in the microseconds between the `if` and the `elif`,
neither breaks out. The warm runner is not in it (nothing it sets takes part, and the cold road stalls the same).

Rather than wait for the scheduler to line that up, this script makes the interleaving happen every time: the
first cmd.poll() that answers None waits (without reaping) until the command has exited. Core's own run_command
then runs once with that and once without; it prints both times and whether the first slept its select timeout.
Run it with the ansible-core to check (`.venv/bin/python bench/core_run_command_race.py`); exit status 1 when that
core has the race.
"""
import os
import subprocess
import sys
import time
from typing import Any, Optional
from unittest import mock

from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args  # ansible-core 2.19+

# A command whose stdio closes before it exits, as coreutils' echo does (close(1), close(2), exit_group()).
COMMAND = ["sh", "-c", "echo 27; exec >&- 2>&-; sleep 0.2"]
SELECT_TIMEOUT = 1.0  # run_command's selector.select(1)

original_poll = subprocess.Popen.poll


def poll_then_exit(proc: subprocess.Popen, armed: "list[bool]") -> "Optional[int]":
    """Popen.poll(); the first time it answers None, return only once the process has exited (not reaped)."""
    rc = original_poll(proc)
    if rc is None and armed:
        armed.clear()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    return rc


def timed(module: Any, race: bool) -> float:
    armed = [True] if race else []
    with mock.patch.object(subprocess.Popen, "poll", lambda proc: poll_then_exit(proc, armed)):
        start = time.monotonic()
        rc, out, _err = module.run_command(COMMAND)
        took = time.monotonic() - start
    if rc != 0 or out != "27\n":
        raise SystemExit("unexpected result from run_command: rc %r, stdout %r" % (rc, out))
    return took


def main() -> int:
    with patch_module_args({}):
        module = basic.AnsibleModule(argument_spec={})
    plain = timed(module, race=False)
    raced = timed(module, race=True)
    stalls = raced - plain > SELECT_TIMEOUT / 2
    print("ansible-core run_command (%s): %.3f s plain, %.3f s when the command exits between the two poll()s: %s"
          % (os.path.dirname(basic.__file__), plain, raced,
             "sleeps its select timeout (the race is there)" if stalls else "no stall"))
    return 1 if stalls else 0


if __name__ == "__main__":
    sys.exit(main())
