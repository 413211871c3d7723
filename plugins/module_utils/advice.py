# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What an HTTP status from the platform means and what to do about it: the one table.

The modules' error reports (api_module.describe_error), the REST client's
exceptions (rest.ApiError.hint) and the connection's port-forward dial errors
(plugin_utils/_mux/tunnel.status_error) all read a status here, so the same status
reads the same everywhere. Each row is (what happened, what to do); callers add
the call, the object and the server's own words around it.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

from typing import Optional, Tuple

from ansible_collections.microvm.sandbox.plugins.module_utils import profile

# status (or (status, context)) -> (what happened, what to do). Fields: {what} the object ("session"),
# {ident} " 'name'" or "", {retried} " (after N attempts with backoff)" or "", {port} the guest port.
_TABLE = {
    401: ("the platform refused the API token",
          "Check the option api_token or the environment variable %s: it may be wrong, expired or revoked"
          % profile.API_TOKEN_ENV),
    403: ("the API token is not allowed to make this call",
          "Use a token with access to Managed Agents sessions, checkpoints and templates (check its scopes)"),
    404: ("no {what}{ident}", "Check the id or name; it may have been deleted"),
    409: ("the call conflicts with the current state of the {what}",
          "The server's reason says which: a name already taken, or a state that does not allow the call"),
    429: ("the platform rate-limited the call{retried}",
          "Retry later, or run fewer tasks against the API in parallel"),
    500: ("the platform failed the call{retried}", "This is a platform-side error; retry later"),
    # A port-forward's 502 is documented as "could not reach guest port" (PORT-FORWARD).
    (502, "port-forward"): ("the platform could not reach guest port {port} of {what}{ident}",
                            "The guest agent is not listening (yet); the connection tries again"),
}
_TABLE[410] = _TABLE[404]


def reading(status: int, what: Optional[str] = None, ident: Optional[str] = None, attempts: int = 1,
            context: Optional[str] = None, port: Optional[int] = None) -> Tuple[Optional[str], Optional[str]]:
    """(what happened, what to do) for an HTTP status; (None, None) for a status the table has no row for."""
    row = _TABLE.get((status, context)) or _TABLE.get(status)
    if row is None and status >= 500:
        row = _TABLE[500]
    if row is None:
        return None, None
    fields = {
        "what": what or "object",
        "ident": (" %r" % ident) if ident else "",
        "retried": (" (after %d attempts with backoff)" % attempts) if attempts > 1 else "",
        "port": port if port is not None else "",
    }
    return row[0].format(**fields), row[1].format(**fields)


def hint_for(status: int, what: Optional[str] = None, ident: Optional[str] = None, attempts: int = 1) -> Optional[str]:
    """What to do about a failed call, in one sentence (None when the table has nothing to say)."""
    happened, todo = reading(status, what, ident, attempts)
    if happened is None or todo is None:
        return None
    return "%s: %s" % (capitalize(happened), todo[:1].lower() + todo[1:])


def capitalize(text: str) -> str:
    return text[:1].upper() + text[1:] if text else text
