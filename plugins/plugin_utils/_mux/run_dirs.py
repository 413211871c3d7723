# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Runs and their TMPDIRs, per session: created before a run's first use, removed once the run is over.

A run is one ansible-playbook process, named by the worker as <host tag>-<pid>-<start time>. While it lives
it keeps its session's link open. Its TMPDIR lives under the session's scratch dir; the mux removes it once
that process is gone, at the session's next use or its link's close (see RunDirs), and sweeps the dirs of
crashed runs of this controller (and very old ones of any controller), and the api road's dirs (its jobs, its
warm runners: api_dir_name) of this controller's muxes that are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import selectors
import socket
import threading
from typing import TYPE_CHECKING

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import capped
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.core_compat import TASK_TMP

if TYPE_CHECKING:  # session_link imports this module: the name only
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink

log = logging.getLogger("microvm.mux")

STALE_RUN_MINUTES = 24 * 60    # run dirs of other controllers are swept after a day
API_DIR = "api."               # + "<host tag>-<mux pid>-<mux start>": one mux's api-road dir in the scratch dir
# A gone mux's api dir: the process group of each of its jobs still running is killed (a job that wrote its rc has
# none left), then the dir goes; a warm runner whose socket is gone stops by itself (module_runner.serve).
SWEEP_API_DIRS = ('for d in "$@"; do for p in "$d"/jobs/*/pid; do j=${p%/pid}; [ -f "$p" ] && [ ! -e "$j/rc" ] && '
                  'kill -KILL -"$(cat "$p")" 2>/dev/null; done; rm -rf -- "$d"; done; true')
# A new run's TMPDIR ($1), and the ended runs' dirs (the rest) removed in the same exec; their removal never fails it.
MAKE_RUN_DIR = 'mkdir -p -- "$1" && chmod 1777 -- "$1" || exit 1; shift; [ $# -eq 0 ] || rm -rf -- "$@" 2>/dev/null; exit 0'


def api_dir_name(host_tag: str) -> str:
    """This mux's api-road dir in a session's scratch dir (a later link sweeps it once this process is gone)."""
    pid = os.getpid()
    return "%s%s-%d-%s" % (API_DIR, host_tag or "untagged", pid, mp.process_start_time(pid) or 0)


class RunDirs:
    """The runs one session has seen: run id -> {"pid", "start", "dir", "ended"}.

    A run keeps its session's link open while its ansible-playbook lives (live()); `persist` counts from its end
    (last_end). Its TMPDIR is removed when the session is next used (the next run's first request, or any request
    of another run) or its link closes, never at the moment the run ends: a user may have paused the session as
    the playbook's last step, and any input wakes a paused session (platform contract).
    """

    def __init__(self, link: SessionLink) -> None:
        self.link = link
        self.runs: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.run_locks: dict[str, threading.Lock] = {}
        self.last_end = 0.0          # monotonic time the last run of this link was seen to end
        self.removing = False        # a removal of ended runs' dirs is under way (one at a time)

    def ensure(self, run: dict | None) -> str | None:
        """Create the run's TMPDIR (sticky and world-writable like /tmp, for become users) once per run.

        The first request of a new run also removes the dirs of runs that ended (the session is in use now);
        a request of a known run starts that removal beside it.
        """
        if not run or not run.get("id"):
            return None
        run_id = run["id"]
        known = self.runs.get(run_id)
        if known is not None:
            if self.has_ended_dirs():
                self.remove_ended_soon()
            return known["dir"]
        with self.lock:
            rlock = self.run_locks.setdefault(run_id, threading.Lock())
        with rlock:
            if run_id not in self.runs:
                with errors.path_rules():
                    run_dir = profile.check_scratch_dir(run["dir"], what="run TMPDIR")
                ended = self._take_ended()
                try:
                    # the ended runs' dirs go in the same exec: no round trip of their own; their removal never fails
                    # the new run's
                    self.link.guest(MAKE_RUN_DIR, run_dir, *[r["dir"] for _id, r in ended])
                except BaseException:
                    with self.lock:
                        self.removing = False  # the ended dirs stay claimed by none: a later use removes them
                    raise
                self._done(ended, "removed")
                if ended:  # as after any removal: the empty task dirs their gone workers left
                    threading.Thread(target=self.sweep_abandoned_task_dirs, name="run-dirs", daemon=True).start()
                self.runs[run_id] = {"pid": run.get("pid"), "start": run.get("start"), "dir": run_dir, "ended": None}
                log.info("session %s: run %s: TMPDIR %s created", self.link.label, run_id, run_dir)
        return self.runs[run_id]["dir"]

    def note_ended(self, now: float) -> None:
        """Mark the runs whose ansible-playbook process is gone (no guest call)."""
        for run in list(self.runs.values()):
            if run["ended"] is None and not (run.get("pid") and mp.process_alive(run["pid"], run.get("start"))):
                run["ended"] = now
                self.last_end = max(self.last_end, now)

    def live(self) -> bool:
        """Whether a run that used this link still runs (as last noted: note_ended())."""
        return any(run["ended"] is None for run in list(self.runs.values()))

    def has_ended_dirs(self) -> bool:
        return not self.removing and any(run["ended"] is not None for run in list(self.runs.values()))

    def remove_ended_soon(self) -> None:
        """Remove the ended runs' dirs in a thread of its own: a request is under way, so the session is awake."""
        threading.Thread(target=self.remove_ended, name="run-dirs", daemon=True).start()

    def remove_ended(self) -> None:
        """Remove the TMPDIR of every run that ended (and the empty task dirs of gone workers)."""
        ended = self._take_ended()
        if not ended:
            return
        try:
            self.link.guest('rm -rf -- "$@"', *[run["dir"] for _id, run in ended])
        except Exception as e:  # the session may be gone; nothing left to clean then
            log.warning("session %s: could not remove the TMPDIR of ended run(s) %s: %s", self.link.label,
                        ", ".join(run["dir"] for _id, run in ended), e)
            self._done(ended, "")
            return
        self._done(ended, "removed")
        self.sweep_abandoned_task_dirs()

    def leave_ended(self) -> None:
        """The link closes on a session not usable now: its ended runs' dirs are left to a later link's sweep."""
        self._done(self._take_ended(), "left")

    def _take_ended(self) -> list[tuple[str, dict]]:
        """The ended runs, claimed for one removal (another caller gets none until _done())."""
        with self.lock:
            if self.removing:
                return []
            ended = [(run_id, run) for run_id, run in list(self.runs.items()) if run["ended"] is not None]
            self.removing = bool(ended)
            return ended

    def _done(self, ended: list[tuple[str, dict]], what: str) -> None:
        """End a claim: the runs are forgotten, logged as `what` ("removed", "left", or "" when the removal failed)."""
        for run_id, run in ended:
            if what == "removed":
                log.info("session %s: run %s ended: removed %s", self.link.label, run_id, run["dir"])
            elif what == "left":
                log.info("session %s: run %s ended while the session is not usable: %s is left to a later sweep",
                         self.link.label, run_id, run["dir"])
            self._forget(run_id)
        with self.lock:
            self.removing = False

    def _forget(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        with self.lock:
            self.run_locks.pop(run_id, None)

    def sweep_stale(self, host_tag: str) -> None:
        """Remove run dirs left by crashed runs of this controller, and very old ones of any controller; and the
        api-road dirs of this controller's muxes that are gone (their jobs' processes stopped first)."""
        scratch = self.link.cfg.scratch_dir
        try:
            # only this controller's dirs: the listing stays short (the mux keeps a few KiB of it, capped.py)
            listing = self.link.guest('cd -- "$1" 2>/dev/null && ls -1Ad -- run."$2"-* %s"$2"-* 2>/dev/null || true'
                                      % API_DIR, scratch, host_tag)
        except Exception as e:
            log.warning("session %s: sweep: cannot list %s: %s", self.link.label, scratch, e)
            return
        if listing.truncated:
            log.info("session %s: sweep: more run dirs in %s than one listing holds: the rest go at the next sweep",
                     self.link.label, scratch)
        stale: list[str] = []
        stale_api: list[str] = []
        for name in capped.complete_lines(listing):
            if "/" in name:
                continue
            for prefix, found in (("run.", stale), (API_DIR, stale_api)):
                if name.startswith(prefix):
                    parts = name[len(prefix):].split("-")
                    if len(parts) == 3 and parts[0] == host_tag and parts[1].isdigit():
                        if not mp.process_alive(int(parts[1]), parts[2]):
                            found.append(posixpath.join(scratch, name))
        script = 'find "$1" -mindepth 1 -maxdepth 1 -type d -name "run.*" -mmin +%d -exec rm -rf -- {} + 2>/dev/null; ' \
                 'shift; [ $# -eq 0 ] || rm -rf -- "$@"' % STALE_RUN_MINUTES
        try:
            self.link.guest(script, scratch, *stale)
            if stale_api:
                self.link.guest(SWEEP_API_DIRS, *stale_api)
            if stale or stale_api:
                log.info("session %s: sweep: removed %s", self.link.label, ", ".join(stale + stale_api))
        except Exception as e:  # housekeeping: never fails a task
            log.warning("session %s: sweep failed: %s", self.link.label, e)
        self.sweep_abandoned_task_dirs()

    def sweep_abandoned_task_dirs(self) -> None:
        """rmdir the empty ansible-tmp-* dirs of the shared remote_tmp whose controller worker is gone.

        A task that ends UNREACHABLE never removes its own. The dir name carries the worker's pid; rmdir
        removes empty directories only, so a dir another task is filling right now is never lost.
        """
        tmp = posixpath.join(self.link.cfg.scratch_dir, "ansible-tmp")
        try:
            listing = self.link.guest('cd -- "$1" 2>/dev/null || exit 0; find . -mindepth 1 -maxdepth 1 -type d -empty '
                                      '-name "ansible-tmp-*"', tmp)
        except Exception as e:
            log.warning("session %s: sweep: cannot list %s: %s", self.link.label, tmp, e)
            return
        abandoned = []  # a listing past the mux's few KiB is cut at a whole line: the next sweep takes the rest
        for line in capped.complete_lines(listing):
            m = TASK_TMP.match(line[2:] if line.startswith("./") else line)
            if m and not mp.process_alive(int(m.group(1)), None):
                abandoned.append(posixpath.join(tmp, m.group(0)))
        if abandoned:
            try:
                self.link.guest('rmdir -- "$@" 2>/dev/null; true', *abandoned)
                log.info("session %s: sweep: removed %d empty task dir(s) of gone workers in %s",
                         self.link.label, len(abandoned), tmp)
            except Exception as e:
                log.warning("session %s: sweep: cannot remove task dirs in %s: %s", self.link.label, tmp, e)


class RunWatch:
    """Wakes the mux's watch thread when a run's ansible-playbook ends, or when poked; sleeps otherwise.

    Each run's process is watched through a pidfd (Linux 5.3+), which becomes readable when it exits: no
    polling. A run that cannot be watched so (another OS, an old kernel, an exited process its parent has not
    reaped yet) is polled instead: polled_links() names the links to look at every watch interval. Used by the
    watch thread only, but for poke().
    """

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._wake_rx, self._wake_tx = socket.socketpair()  # a closed socket object never writes to a reused fd
        self._wake_rx.setblocking(False)
        self._wake_tx.setblocking(False)
        self.selector.register(self._wake_rx, selectors.EVENT_READ, None)
        self.fds: dict[tuple[SessionLink, str], int] = {}   # (link, run id) -> pidfd
        self.polled: set[tuple[SessionLink, str]] = set()

    def poke(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed (stopping)
            self._wake_tx.send(b"\0")

    def wait(self, timeout: float) -> set[SessionLink]:
        """Sleep until poked, a watched run ends, or `timeout`; the links whose run ended."""
        ended = set()
        for key, _events in self.selector.select(timeout):
            if key.data is None:
                with contextlib.suppress(OSError):
                    while self._wake_rx.recv(4096):
                        pass
            else:  # polled from now on: note_ended() may still see a zombie as alive
                self._drop(key.data)
                self.polled.add(key.data)
                ended.add(key.data[0])
        return ended

    def sync(self, links: list[SessionLink]) -> set[SessionLink]:
        """Watch the runs of `links` (and no others); the links with a run already over."""
        current = {(link, run_id): run for link in links for run_id, run in list(link.runs.runs.items())
                   if run["ended"] is None}  # an ended run waits for its dir's removal: nothing to watch
        for known in [k for k in self.fds if k not in current]:
            self._drop(known)
        self.polled &= set(current)
        over = set()
        for known, run in current.items():
            if known in self.fds or known in self.polled:
                continue
            try:
                fd = os.pidfd_open(int(run["pid"]))
            except ProcessLookupError:
                fd = -1
            except (AttributeError, OSError, KeyError, TypeError, ValueError):  # no pidfd here: poll it
                self.polled.add(known)
                continue
            if fd < 0 or not mp.process_alive(run["pid"], run.get("start")):  # gone, or its pid reused
                if fd >= 0:
                    os.close(fd)
                self.polled.add(known)
                over.add(known[0])
                continue
            self.fds[known] = fd
            self.selector.register(fd, selectors.EVENT_READ, known)
        return over

    def polled_links(self) -> set[SessionLink]:
        return {link for link, _run in self.polled}

    def _drop(self, known: tuple[SessionLink, str]) -> None:
        fd = self.fds.pop(known, None)
        if fd is not None:
            self.selector.unregister(fd)
            os.close(fd)

    def close(self) -> None:
        for known in list(self.fds):
            self._drop(known)
        self.selector.close()
        self._wake_rx.close()
        self._wake_tx.close()
