# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""How the modules show platform objects in diffs."""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

from typing import Any, Collection, Iterable

from ansible_collections.microvm.sandbox.plugins.module_utils import profile

# Fields that change without any change to the object, or only appear on create:
# left out of diffs so that --diff shows what the task did.
_VOLATILE = frozenset(["last_event_at", "warnings", "updated_at"])


def agent_kind(adapter: str | None) -> str | None:
    """The session object's agent_kind for an adapter: 'codex' -> 'AGENT_KIND_CODEX_CLI'."""
    if not adapter:
        return None
    names = profile.AGENT_KIND_NAMES.get(adapter)
    return "AGENT_KIND_" + (names[0] if names else str(adapter).upper().replace("-", "_"))


def same_adapter(reported_kind: str | None, adapter: str) -> bool:
    """Whether a session's agent_kind names `adapter`. An absent or UNSPECIFIED kind says nothing, so it matches.

    The SDKs' enum names differ from the adapters' (codex is AGENT_KIND_CODEX_CLI); each adapter's known names
    are in profile.AGENT_KIND_NAMES. Case and punctuation are ignored.
    """
    def norm(text: str) -> str:
        return "".join(c for c in str(text).upper() if c.isalnum())
    kind = norm(reported_kind or "")
    if kind.startswith("AGENTKIND"):
        kind = kind[len("AGENTKIND"):]
    if kind in ("", "UNSPECIFIED"):
        return True
    names = profile.AGENT_KIND_NAMES.get(adapter) or (str(adapter),)
    return kind in set(norm(n) for n in names) | set([norm(adapter)])


def status_of(session: dict[str, Any] | None) -> str:
    return profile.short_status((session or {}).get("status"))


def object_view(obj: dict[str, Any] | None) -> dict[str, Any]:
    """The object as a diff side: {} for none, volatile fields dropped."""
    if not obj:
        return {}
    return dict((k, v) for k, v in obj.items() if k not in _VOLATILE)


session_view = object_view


_STATUS_ALIASES = {"USABLE": profile.USABLE, "GONE": profile.GONE}


def expand_statuses(statuses: Iterable[str] | None) -> frozenset[str] | None:
    """{'READY', ...} from short or full names and the aliases usable/gone; None for no filter."""
    if not statuses:
        return None
    out: set[str] = set()
    for raw in statuses:
        name = str(raw).strip().upper()
        if name in _STATUS_ALIASES:
            out.update(_STATUS_ALIASES[name])
            continue
        short = profile.short_status(name)
        if short == "UNSPECIFIED":
            raise ValueError("unknown session status %r; use one of %s, usable or gone"
                             % (raw, ", ".join(sorted(profile.KNOWN_STATUSES))))
        out.add(short)
    return frozenset(out)


def select_sessions(sessions: Iterable[dict[str, Any]], statuses: Collection[str] | None = None, name_prefix: str | None = None,
                    name_regex: Any = None) -> list[dict[str, Any]]:
    """The sessions that pass every filter given (a compiled regex is searched in the name)."""
    out = []
    for s in sessions:
        name = s.get("name") or ""
        if statuses is not None and status_of(s) not in statuses:
            continue
        if name_prefix and not name.startswith(name_prefix):
            continue
        if name_regex is not None and not name_regex.search(name):
            continue
        out.append(s)
    return out
