# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Progress of the long first steps (issue 42): the timeline, the lines, the watcher, the modules' `stages`."""
from __future__ import annotations

import threading
import time

from ansible_collections.microvm.sandbox.plugins.module_utils.progress import Timeline, summary_line, wait_line
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import progress_action
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.progress_action import Watcher


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_timeline_stages_in_order_a_repeat_is_no_new_stage() -> None:
    clock = Clock()
    line = Timeline(clock)
    line.mark("create")
    clock.now += 0.26
    line.mark("PROVISIONING")
    clock.now += 20
    line.mark("PROVISIONING")
    clock.now += 21.33
    line.end()
    clock.now += 5   # after the end: counts for nothing
    assert line.as_list() == [{"stage": "create", "seconds": 0.3}, {"stage": "PROVISIONING", "seconds": 41.3}]
    assert Timeline(clock).as_list() == []


def test_the_open_stage_is_closed_by_as_list() -> None:
    clock = Clock()
    line = Timeline(clock)
    line.mark("build BUILDING")
    clock.now += 3
    assert line.as_list() == [{"stage": "build BUILDING", "seconds": 3.0}]


def test_lines() -> None:
    assert wait_line("localhost", "microvm.sandbox.session", "ci-1", "PROVISIONING", 12.7) == \
        "localhost: microvm.sandbox.session ci-1: PROVISIONING, 12 s so far"
    assert wait_line("h", "microvm.sandbox.template", "t", "build BUILDING", 5, "a note") == \
        "h: microvm.sandbox.template t: build BUILDING, 5 s so far (a note)"
    assert summary_line("localhost", "microvm.sandbox.session", "ci-1", 41.9,
                        [{"stage": "create", "seconds": 0.3}, {"stage": "PROVISIONING", "seconds": 41.3}]) == \
        "localhost: microvm.sandbox.session ci-1: done in 41 s (create 0.3 s, PROVISIONING 41.3 s)"
    assert summary_line("h", "m", "t", 9, None) == "h: m t: done in 9 s"


def watch(looks, **kw):
    shown: list[str] = []
    states = iter(looks)
    last = [looks[-1]]

    def look():
        last[0] = next(states, last[0])
        return last[0]

    return shown, Watcher(shown.append, look, "localhost", "microvm.sandbox.session", "ci-1", **kw)


def test_a_fast_task_shows_nothing() -> None:
    shown, watcher = watch([("READY", [])], quiet=5.0, poll=0.01)
    watcher.start()
    watcher.stop()
    assert shown == [] and watcher.shown == 0


def test_status_changes_notes_once_and_heartbeats() -> None:
    note = "the local control plane builds the `base` template's Debian bookworm root filesystem"
    shown, watcher = watch([("no live session yet", []), ("PROVISIONING", [note]), ("PROVISIONING", [note]),
                            ("PROVISIONING", [note])], quiet=0.0, poll=0.02, heartbeat=3600)
    watcher.start()
    deadline = time.monotonic() + 5
    while watcher.shown < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    watcher.stop()
    assert shown[0] == "localhost: microvm.sandbox.session ci-1: no live session yet, 0 s so far"
    assert shown[1].startswith("localhost: microvm.sandbox.session ci-1: PROVISIONING, 0 s so far (the local")
    assert len(shown) == 2   # the same status and note again: nothing new until the heartbeat

    shown, watcher = watch([("PROVISIONING", [])], quiet=0.0, poll=0.02, heartbeat=0.05)
    watcher.start()
    time.sleep(0.3)
    watcher.stop()
    assert len(shown) >= 3 and all("PROVISIONING" in s for s in shown)


def test_a_long_note_is_cut() -> None:
    shown, watcher = watch([("PROVISIONING", ["x" * 1000])], quiet=0.0, poll=1.0)
    watcher.start()
    deadline = time.monotonic() + 5
    while not shown and time.monotonic() < deadline:
        time.sleep(0.01)
    watcher.stop()
    assert shown and len(shown[0]) < 400 and shown[0].endswith("...)")


def test_stop_waits_for_no_lookup_beyond_its_timeout() -> None:
    gate = threading.Event()

    def slow_look():
        gate.wait(2)
        return ("PROVISIONING", [])

    shown: list[str] = []
    watcher = Watcher(shown.append, slow_look, "h", "m", "t", quiet=0.0, poll=0.01)
    watcher.start()
    time.sleep(0.05)
    gate.set()
    watcher.stop()
    assert shown == []   # the module ended during the lookup: nothing said after it


def test_controller_client_needs_a_token(monkeypatch) -> None:
    for env in ("DO_AGENTS_API_TOKEN", "DIGITALOCEAN_TOKEN", "DIGITALOCEAN_ACCESS_TOKEN"):
        monkeypatch.delenv(env, raising=False)
    assert progress_action.controller_client({"api_url": "http://127.0.0.1:1"}) is None
    client = progress_action.controller_client({"api_url": "http://127.0.0.1:1", "api_token": "mvlp-x"})
    assert client is not None and client.retries == 0 and "mvlp-x" not in repr(client)
