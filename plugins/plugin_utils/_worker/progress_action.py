# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The action plugins of `session` and `template`: the module runs as always, and a long wait is shown as it happens.

A module cannot print while it runs; its action plugin can. While the module runs, a watcher thread on the
controller stays quiet for QUIET_AFTER seconds (a fast task prints nothing new), then looks the object up by name
every POLL_EVERY seconds with its own API client and shows a line (Ansible's Display, default verbosity: the long
first create or build is what a user at the default verbosity would otherwise take for a hang) when the status
changes, when the platform adds a warning (the local plane's "building the base image" note), and every HEARTBEAT
seconds. When the lookup cannot be made (no token on the controller, the API not reachable from it) the lines
say only how long the module has run. After a wait that was shown, one line gives the module's `stages`.

The module's arguments, result, `changed` and check mode are untouched: the watcher only reads, and is not started
in check mode or for an async task. It shows names, statuses, platform warnings and seconds: never an argument.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import os
import threading
import time
from typing import Any, Callable

from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action.normal import ActionModule as NormalAction
from ansible.utils.display import Display

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.module_utils.progress import summary_line, wait_line
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, build_status, template_status

display = Display()

QUIET_AFTER = 5.0      # a create READY within this shows nothing new
POLL_EVERY = 2.0
HEARTBEAT = 15.0       # a line at least this often while nothing changes
NOTE_MAX = 300         # a platform warning is cut to this many characters
LOOKUP_TIMEOUT = 5.0
STOP_WAIT = 0.5

Look = Callable[[], tuple[str, list[str]]]   # -> (state, platform warnings)


class Watcher(threading.Thread):
    """Shows lines about a running task until stop(): quiet at first, then on a change or a heartbeat."""

    def __init__(self, show: Callable[[str], None], look: Look, host: str, module: str, target: str,
                 quiet: float = QUIET_AFTER, poll: float = POLL_EVERY, heartbeat: float = HEARTBEAT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name="microvm-progress", daemon=True)
        self.show, self.look, self.host, self.module, self.target = show, look, host, module, target
        self.quiet, self.poll, self.heartbeat, self.clock = quiet, poll, heartbeat, clock
        self.started = clock()
        self.shown = 0
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        # a lookup in flight is not waited out: it says nothing once stopped, and the task's result goes on now
        self.join(STOP_WAIT)

    def run(self) -> None:
        if self._stopped.wait(self.quiet):
            return
        last_state: str | None = None
        said_at = 0.0
        notes_seen: set[str] = set()
        while not self._stopped.is_set():
            state, notes = self.look()
            if self._stopped.is_set():
                return   # the module ended during the lookup: its result says the rest
            new_notes = [n for n in notes if n not in notes_seen]
            notes_seen.update(new_notes)
            now = self.clock()
            if state != last_state or new_notes or now - said_at >= self.heartbeat:
                note = new_notes[0] if new_notes else None
                if note and len(note) > NOTE_MAX:
                    note = note[:NOTE_MAX - 3] + "..."
                self.show(wait_line(self.host, self.module, self.target, state, now - self.started, note))
                self.shown += 1
                last_state, said_at = state, now
            if self._stopped.wait(self.poll):
                return


def controller_client(args: dict[str, Any]) -> ApiClient | None:
    """An API client from the task's own API options (else the controller's environment), or None."""
    def arg(name: str, envs: tuple[str, ...]) -> Any:
        value = args.get(name)
        if value in (None, ""):
            value = next((os.environ[e] for e in envs if os.environ.get(e)), None)
        return value

    try:
        return ApiClient(api_url=arg("api_url", (profile.API_URL_ENV,)),
                         api_token=arg("api_token", tuple(profile.API_TOKEN_ENVS)),
                         prefix=arg("route_prefix", (profile.API_PREFIX_ENV,)) or profile.DEFAULT_PREFIX,
                         timeout=LOOKUP_TIMEOUT, retries=0, validate_certs=boolean(args.get("validate_certs", True), strict=False))
    except Exception:   # no token here, a refused URL: the lines then say only how long the module has run
        return None


class ProgressAction(NormalAction):
    """The normal action (run the module), with a Watcher while it runs. Subclasses say how to look."""

    MODULE = ""

    def lookup(self, client: ApiClient, name: str) -> tuple[str, list[str]]:
        raise NotImplementedError

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        args = dict(self._task.args or {})
        name = str(args.get("name") or "")
        # the play context's check mode is the task's own (check_mode: on the task included)
        if self._play_context.check_mode or self._task.async_val or not name:
            return super().run(tmp, task_vars)
        client = controller_client(args)

        def look() -> tuple[str, list[str]]:
            if client is None:
                return "running", []
            try:
                return self.lookup(client, name)
            except Exception:   # a lookup that fails says nothing new; the module reports its own errors
                return "running", []

        host = str((task_vars or {}).get("inventory_hostname") or "localhost")
        watcher = Watcher(display.display, look, host, self.MODULE, name)
        watcher.start()
        try:
            result = super().run(tmp, task_vars)
        finally:
            watcher.stop()
        if watcher.shown:
            stages = result.get("stages")
            display.display(summary_line(host, self.MODULE, name, watcher.clock() - watcher.started,
                                         stages if isinstance(stages, list) else None))
        return result


def session_lookup(client: ApiClient, name: str) -> tuple[str, list[str]]:
    """The session's short status and warnings, or `not created yet` (the module has not made it, or it is gone)."""
    session = client.find_session(name)
    if session is None:
        return "no live session yet", []
    warnings = [str(w) for w in session.get("warnings") or [] if w]
    return profile.short_status(session.get("status")) or "unknown", warnings


def template_lookup(client: ApiClient, name: str) -> tuple[str, list[str]]:
    """The newest build's status (`build BUILDING`), else the template's, or `not registered yet`."""
    template = client.find_template(name)
    if template is None:
        return "not registered yet", []
    build = client.newest_build(template["template_id"])
    if build is not None:
        return "build %s" % build_status(build), []
    return template_status(template), []
