# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A slow first create says what it waits on while it waits (issue 42).

A plane of its own whose boots wait BOOT_DELAY seconds (the plane's test hook MICROVM_LOCALPLANE_TEST_BOOT_DELAY),
and ansible-playbook's output read line by line as it comes: a progress line must arrive before the task's
result line, and a fast task (the same session again) shows none.
"""
from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import BIN, ansible_env  # noqa: E402
from microvm_plane_testing import start_local_plane, stop_local_plane  # noqa: E402

BOOT_DELAY = 9


@pytest.fixture(scope="module")
def slow_plane():
    if os.environ.get("MICROVM_LIVE") == "1":
        pytest.skip("needs the local plane's boot delay hook")
    state_dir = tempfile.mkdtemp(prefix="mvlp-slow-")
    handle = start_local_plane(state_dir, extra_env={"MICROVM_LOCALPLANE_TEST_BOOT_DELAY": str(BOOT_DELAY)})
    try:
        yield handle
    finally:
        stop_local_plane(handle)
        shutil.rmtree(state_dir, ignore_errors=True)


def stream(argv, env, cwd, timeout=240):
    """Run argv; -> [(seconds since start, line)] of its merged output, each stamped when it was read."""
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd)
    assert proc.stdout is not None
    lines = []
    pending = b""
    try:
        while True:
            if time.monotonic() - started > timeout:
                pytest.fail("ansible-playbook ran over %ss: %r" % (timeout, lines[-20:]))
            ready, _w, _x = select.select([proc.stdout], [], [], 0.5)
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            pending += chunk
            *done, pending = pending.split(b"\n")
            lines += [(time.monotonic() - started, d.decode("utf-8", "replace")) for d in done]
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, lines


def test_a_slow_create_shows_its_wait_as_it_happens(slow_plane, tmp_path):
    name = "progress-%s" % uuid.uuid4().hex[:8]
    (tmp_path / "play.yml").write_text(textwrap.dedent("""\
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: Create the session (slow boot)
              microvm.sandbox.session:
                name: %(name)s
                secrets:
                  PROGRESS_SECRET: do-not-show-me-42
              register: created
            - name: The same session again (fast)
              microvm.sandbox.session:
                name: %(name)s
            - name: Show the timeline
              ansible.builtin.debug:
                msg: "stages={{ created.stages | map(attribute='stage') | join(',') }}"
            - name: Delete it
              microvm.sandbox.session:
                name: %(name)s
                state: absent
        """ % {"name": name}))
    env = ansible_env(slow_plane, tmp_path, {"ANSIBLE_STDOUT_CALLBACK": "default"})
    env["PYTHONUNBUFFERED"] = "1"
    rc, lines = stream([os.path.join(BIN, "ansible-playbook"), "-i", "localhost,", "-c", "local", "play.yml"],
                       env, str(tmp_path))
    text = "\n".join(line for _t, line in lines)
    assert rc == 0, text
    assert "do-not-show-me-42" not in text

    def first(pattern, after=0):
        for i, (t, line) in enumerate(lines[after:], after):
            if re.search(pattern, line):
                return i, t
        pytest.fail("no line matching %r in:\n%s" % (pattern, text))

    task1, _t1 = first(r"TASK \[Create the session")
    progress, t_progress = first(r"localhost: microvm\.sandbox\.session %s: PROVISIONING, \d+ s so far" % name, task1)
    result, t_result = first(r"^(changed|ok): \[localhost\]", task1)
    # The progress line came while the task ran, before its result, and visibly earlier (not flushed at the end).
    assert progress < result, text
    assert t_result - t_progress >= 1.0, lines[task1:result + 1]
    summary, _t2 = first(r"localhost: microvm\.sandbox\.session %s: done in \d+ s \(create [\d.]+ s, PROVISIONING "
                         r"[\d.]+ s\)" % name, progress)
    assert summary < result
    # The fast task shows no progress at all.
    task2, _t3 = first(r"TASK \[The same session again", result)
    task3, _t4 = first(r"TASK \[Show the timeline", task2)
    assert not [line for _t, line in lines[task2:task3] if "so far" in line or "done in" in line], text
    assert "stages=create,PROVISIONING" in text
