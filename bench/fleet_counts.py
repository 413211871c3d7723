"""What a fleet run did per session, counted from what the controller's processes leave behind.

- link opens and warm-runner starts per session: the muxes' logs (`<mux dir>/<process dir>/mux.log`), whose
  lines name the session as "name (session id)" (session_link.py, module_runners.py);
- ControlMaster starts per SSH host: the distinct pids of ssh's masters seen for each ControlPath (OpenSSH
  titles a master "ssh: <ControlPath> [mux]").

A run's count is the difference of two snapshots (before, after): logs only grow, muxes come and go.
"""
from __future__ import annotations

import collections
import glob
import os
import re
import statistics
from collections.abc import Iterable, Mapping

SESSION_ID = re.compile(r"\(([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\)")
EVENTS = {
    "link_opens": re.compile(r"session (.+?): link \d+ open$"),
    "runner_starts": re.compile(r"session (.+?): warm runner for .+ started in the guest"),
}


def _session(label: str) -> str:
    """The session id in a log label "name (id)", else the label itself (a session not looked up yet)."""
    m = SESSION_ID.search(label)
    return m.group(1) if m else label


def count_log_lines(lines: Iterable[str]) -> dict[str, collections.Counter[str]]:
    """{event: Counter(session id: times)} for the events of EVENTS in mux log lines."""
    counts: dict[str, collections.Counter[str]] = {name: collections.Counter() for name in EVENTS}
    for line in lines:
        line = line.rstrip("\n")
        for name, pattern in EVENTS.items():
            m = pattern.search(line)
            if m:
                counts[name][_session(m.group(1))] += 1
    return counts


def mux_log_counts(mux_dir: str) -> dict[str, collections.Counter[str]]:
    """count_log_lines() over every mux log under mux_dir (a snapshot: subtract two for one run)."""
    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(mux_dir, "*", "mux.log"))):
        with open(path, errors="replace") as f:
            lines.extend(f)
    return count_log_lines(lines)


def ssh_masters(procs: Mapping[int, tuple[int, str, str]], control_dir: str) -> dict[int, str]:
    """{pid: ControlPath} of the ssh ControlMasters in `procs` (benchlib.processes()) whose path is in control_dir."""
    prefix, suffix = "ssh: " + control_dir.rstrip("/") + "/", " [mux]"
    titles = {pid: cmd.rstrip() for pid, (_ppid, _comm, cmd) in procs.items()}  # the title is padded with blanks
    return {pid: title[len("ssh: "):-len(suffix)] for pid, title in titles.items()
            if title.startswith(prefix) and title.endswith(suffix)}


def per_key(before: Mapping[str, int], after: Mapping[str, int], keys: Iterable[str]) -> dict[str, int]:
    """Each key's count in a run: after minus before (0 for a key never seen)."""
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


def spread(counts: Mapping[str, int]) -> dict[str, float | int]:
    """min / median / max over the keys, how many got more than one and how many none (target: 1 each)."""
    values = sorted(counts.values()) or [0]
    return {"min": values[0], "median": statistics.median(values), "max": values[-1], "keys": len(counts),
            "more_than_1": sum(1 for v in values if v > 1), "none": sum(1 for v in counts.values() if v == 0),
            "total": sum(values)}
