# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The mux's requests nobody waits for (frames.py "nowait"): a task tmp dir's rm at the task's end."""

from __future__ import annotations

import collections
import socket
import threading
from types import SimpleNamespace

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import exec_ops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp

RM = {"op": "rm", "path": "/workspace/.scratch/ansible-tmp/ansible-tmp-1.5-77-88/"}
ARGV = ["/bin/sh", "-c", "rm -f -r /workspace/.scratch/ansible-tmp/ansible-tmp-1.5-77-88/ > /dev/null 2>&1"]


class Runner:
    def __init__(self, answer):
        self.answer = answer
        self.ops = []

    def tmp(self, op):
        self.ops.append(op)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Client:
    """A road client whose one command exits with `rc` after printing `stderr`."""

    def __init__(self, rc, stderr=b""):
        self.rc, self.stderr, self.argv = rc, stderr, []

    def exec_stream(self, argv, **kwargs):
        self.argv.append(list(argv))
        return object(), None

    def iter_exec(self, call, feed):
        if self.stderr:
            yield "stderr", self.stderr
        yield "exit", SimpleNamespace(exit_code=self.rc)


def link(runner, client=None):
    return SimpleNamespace(label="sbx", ensure_ready=lambda: None, runs=SimpleNamespace(ensure=lambda run: None),
                           runners=SimpleNamespace(any_alive=lambda: runner), client=client or Client(0),
                           tmp_warnings=collections.deque(maxlen=8), unawaited=0, unawaited_done=threading.Condition())


def test_an_unawaited_rm_is_done_by_the_runner_and_answered_with_nothing():
    a, b = socket.socketpair()
    try:
        mp.send_frame(a, mp.STDIN_EOF)
        runner = Runner({"rc": 0, "stdout": "", "stderr": ""})
        req = {"op": "tmp", "tmp": RM, "nowait": True, "argv": ARGV}
        assert exec_ops.op_tmp(link(runner), exec_ops.Unanswered(b), req) == "tmp_nowait"
        assert runner.ops == [RM]
        a.setblocking(False)
        try:
            assert a.recv(1) == b""  # never reached: nothing was sent
        except BlockingIOError:
            pass
    finally:
        a.close()
        b.close()


def test_without_a_runner_the_rm_runs_in_a_shell_and_a_failure_is_kept_for_the_next_attach():
    a, b = socket.socketpair()
    try:
        mp.send_frame(a, mp.STDIN_EOF)
        client = Client(1, b"rm: cannot remove 'x': Device or resource busy\x1b[31m\n")
        lk = link(Runner(errors.WarmRefused("no warm runner is running in this session yet")), client)
        req = {"op": "tmp", "tmp": RM, "nowait": True, "argv": ARGV}
        assert exec_ops.op_tmp(lk, exec_ops.Unanswered(b), req) == "tmp_nowait_failed"
        assert client.argv == [ARGV]
        warnings = exec_ops.take_tmp_warnings(lk)
        assert len(warnings) == 1 and warnings[0].startswith("Error deleting remote temporary files (rc: 1, stderr: rm:")
        assert "\x1b" not in warnings[0]  # the guest's text, shown escaped
        assert exec_ops.take_tmp_warnings(lk) == []
    finally:
        a.close()
        b.close()


def test_later_requests_of_the_session_wait_for_an_unawaited_one():
    lk = link(Runner({"rc": 0}))
    order = []
    with exec_ops.unawaited(lk):
        waiter = threading.Thread(target=lambda: (exec_ops.after_unawaited(lk), order.append("later")))
        waiter.start()
        waiter.join(0.2)
        order.append("rm done")
    waiter.join()
    assert order == ["rm done", "later"]
