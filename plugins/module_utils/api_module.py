# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What every module of the collection shares: the API options, the client, and error reporting.

`describe_error` is the one place that turns an ApiError or a WaitTimeout into
a message saying what happened and what to do; modules reach it through
`fail_from_error`, the inventory plugin calls it directly.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import math
import re
from typing import Any, Callable, NoReturn

from ansible.module_utils.basic import AnsibleModule, env_fallback
from ansible.module_utils.six.moves.urllib.parse import unquote

from ansible_collections.microvm.sandbox.plugins.module_utils import advice, profile
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, NotFound, OutcomeUnknown, Refused, \
    WaitTimeout

DEFAULT_REQUEST_TIMEOUT = 30.0
DEFAULT_BLOCKING_TIMEOUT = 900.0
DEFAULT_WAIT_TIMEOUT = 600
# option -> (lowest, highest, lowest allowed?), in seconds: beyond them a timeout is a mistake (or overflows a C timeval)
TIMEOUT_RANGES = {
    "request_timeout": (0, 3600, False),
    "blocking_timeout": (0, 86400, False),
    "wait_timeout": (0, 7 * 86400, True),
}
ENV_OPTIONS = ("env", "secrets")  # the platform takes string values only

_SESSION_PATH = re.compile(r"^/sessions/([^/?]+)")


def api_argument_spec(**module_options: Any) -> dict[str, Any]:
    """The shared API options (doc fragment microvm.sandbox.api) plus the module's own."""
    spec = dict(
        api_url=dict(type="str", default=profile.DEFAULT_API_URL, fallback=(env_fallback, [profile.API_URL_ENV])),
        api_token=dict(type="str", no_log=True, fallback=(env_fallback, list(profile.API_TOKEN_ENVS))),
        route_prefix=dict(type="str", default=profile.DEFAULT_PREFIX, fallback=(env_fallback, [profile.API_PREFIX_ENV])),
        request_timeout=dict(type="float", default=DEFAULT_REQUEST_TIMEOUT),
        blocking_timeout=dict(type="float", default=DEFAULT_BLOCKING_TIMEOUT),
        wait_timeout=dict(type="int", default=DEFAULT_WAIT_TIMEOUT),
        validate_certs=dict(type="bool", default=True),
    )
    spec.update(module_options)
    return spec


def client_from_module(module: AnsibleModule) -> ApiClient:
    """An ApiClient built from the module's API options; fails the module when it cannot be built."""
    p = module.params
    try:
        return ApiClient(api_url=p["api_url"], api_token=p["api_token"], prefix=p["route_prefix"],
                         timeout=p["request_timeout"], validate_certs=p["validate_certs"],
                         blocking_timeout=p["blocking_timeout"], reconcile_timeout=p["wait_timeout"])
    except ApiError as e:
        fail_from_error(module, e)


def option_problems(params: dict[str, Any]) -> list[str]:
    """What the argument spec cannot say: timeouts in range, env values that are scalars. -> messages naming the option."""
    problems = []
    for name, (low, high, low_ok) in sorted(TIMEOUT_RANGES.items()):
        value = params.get(name)
        if value is None:
            continue
        if not (math.isfinite(value) and (value >= low if low_ok else value > low) and value <= high):
            problems.append("%s must be a number of seconds %s %s and at most %s, got %r" % (
                name, "from" if low_ok else "greater than", low, high, value))
    for name in ENV_OPTIONS:
        for key, value in sorted((params.get(name) or {}).items()):
            if isinstance(value, (list, tuple, dict, set)) or value is None:
                # secrets are never shown: only the key and the kind of value
                problems.append("%s: the value of %s must be a string, a number or a boolean, got %s (the platform "
                                "takes strings; quote it, or join a list yourself)" % (name, key, _kind(value)))
    return problems


def _kind(value: Any) -> str:
    kinds: dict[type, str] = {list: "a list", tuple: "a list", dict: "a mapping", set: "a set"}
    return kinds.get(type(value), "null")


def run_api_module(module: AnsibleModule, work: Callable[[ApiClient], dict[str, Any]]) -> None:
    """Check the options, build the client, run `work(client)` -> result dict, exit; errors become fail_json."""
    problems = option_problems(module.params)
    if problems:
        module.fail_json(msg="; ".join(problems))
    client = client_from_module(module)
    try:
        result = work(client)
    except (ApiError, WaitTimeout) as e:
        fail_from_error(module, e, client)
    except Refused as e:
        module.fail_json(msg=str(e), **e.details)
    module.exit_json(**result)


def refuse_if_credentials_staged(client: ApiClient, session: dict[str, Any], doing: str) -> None:
    """Raise Refused when the credentials role has files staged in the session: `doing` would capture them.

    A checkpoint or a fork holds the whole machine, so a secret staged at that moment would outlive its cleanup
    in every copy. The check runs one command in the session (and so wakes a paused one).
    """
    staged = client.staged_credentials(session["session_id"])
    if not staged:
        return
    shown = ", ".join(staged[:5]) + (" and more" if len(staged) > 5 else "")
    raise Refused("refusing to %s session %s: credentials staged by microvm.sandbox.credentials are still in it (%s), "
                  "and the copy would keep them after their cleanup. Remove them first (include_role "
                  "microvm.sandbox.credentials with tasks_from: cleanup, in an always: section), then %s; stage them "
                  "again afterwards if the work needs them. check_staged_credentials: false skips this check."
                  % (doing, session.get("name") or session["session_id"], shown, doing),
                  staged_credentials=staged)


def fail_from_error(module: AnsibleModule, error: ApiError | WaitTimeout, client: ApiClient | None = None, **result: Any) -> NoReturn:
    msg, details = describe_error(error, client)
    details.update(result)
    module.fail_json(msg=msg, **details)


def describe_error(error: ApiError | WaitTimeout, client: ApiClient | None = None) -> tuple[str, dict[str, Any]]:
    """(message, details) for an ApiError or WaitTimeout: what happened, the server's words, what to do."""
    if isinstance(error, WaitTimeout):
        return _describe_wait(error)
    details = {"http_status": error.status, "server_message": error.server_message or ""}
    call = "%s %s" % (error.method, error.path)
    if error.path != "-":
        details["api_call"] = call
    said = (": %s" % error.server_message) if error.server_message else ""
    status = error.status
    if isinstance(error, NotFound):
        where = " (session names are matched among live sessions only)" if "session" in (error.what or "") else ""
        msg = "%s. %s%s." % (advice.capitalize(error.server_message or ""), advice.reading(404)[1], where)
    elif isinstance(error, OutcomeUnknown):
        msg = "%s: the outcome is unknown: %s. %s." % (call, error.server_message, error.hint)
    elif status == 0 and error.what in ("token destination", "api url"):
        msg = advice.capitalize(error.server_message or "") + "."
    elif status == 0 and error.path == "-":
        msg = "No API token: set the option api_token or one of the environment variables %s." % (
            ", ".join(profile.API_TOKEN_ENVS))
    elif getattr(error, "not_api", False):
        msg = "%s failed with HTTP %d: %s. %s." % (call, status, error.server_message, error.hint)
    elif status == 0 and getattr(error, "refused", False):
        msg = "%s failed: %s (after %d attempt%s). %s." % (
            call, error.server_message, error.attempts, "" if error.attempts == 1 else "s", error.hint)
    elif status == 0:
        msg = "%s failed: %s (after %d attempt%s). Check the option api_url or the environment variable %s." % (
            call, error.server_message, error.attempts, "" if error.attempts == 1 else "s", profile.API_URL_ENV)
    else:
        msg = _from_table(error, call, said, client)
    return msg, details


def _from_table(error: ApiError, call: str, said: str, client: ApiClient | None) -> str:
    """The message of an HTTP error: what happened and what to do come from the one table (advice.py)."""
    status = error.status
    happened, todo = advice.reading(status, error.what or "object", error.ident, error.attempts)
    if happened is None:
        return "%s was rejected with HTTP %d%s.%s" % (call, status, said, (" " + error.hint + ".") if error.hint else "")
    msg = "%s (HTTP %d on %s%s). %s." % (advice.capitalize(happened), status, call, said, todo)
    if status == 409:
        msg += _current_state(error, client)
    if getattr(error, "url_advice", None):
        msg += " %s." % error.url_advice
    return msg


def _describe_wait(error: WaitTimeout) -> tuple[str, dict[str, Any]]:
    details = {"reached_status": error.status or ""}
    if error.what and error.last is not None:
        details[error.what] = error.last
    msg = str(error)
    if error.what == "template" and error.status == "FAILED":
        msg += ". Fix the source image or base template and run again, or retry the same source with force_rebuild: true."
    elif error.status in profile.GONE:
        msg += ". A session in that state does not come back; create a new one."
    else:
        msg += (". The last status reached was %s. Raise wait_timeout (it was %ss), or set wait: false and check later "
                "with the matching _info module." % (error.status, error.timeout))
    return msg, details


def _current_state(error: ApiError, client: ApiClient | None) -> str:
    """' The session was SESSION_STATUS_X.' for a 409 on a session route, best effort."""
    m = _SESSION_PATH.match(error.path or "")
    if not m or client is None:
        return ""
    try:
        session = client.get_session(unquote(m.group(1)))
    except Exception:  # the report must not fail because the extra lookup did
        return ""
    status = profile.short_status(session.get("status"))
    hint = {
        "PROVISIONING": " Wait until it is READY (the session module waits by default).",
        "PAUSED": " Resume it first (state: running).",
    }.get(status, "")
    return " The session %r was in state %s.%s" % (session.get("name") or session.get("session_id"), status, hint)


def parse_duration(value: Any) -> int:
    """Seconds from 600, '600', '600s', '10m', '1h30m' or '1d'; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError("not a duration: %r" % (value,))
    if isinstance(value, (int, float)):
        return int(value)
    text = str(value).strip().lower()
    if re.match(r"^\d+$", text):
        return int(text)
    parts = re.findall(r"(\d+)\s*([dhms])", text)
    if not parts or re.sub(r"\d+\s*[dhms]", "", text).strip():
        raise ValueError("not a duration: %r (use seconds, or a string such as 600s, 10m, 1h30m)" % (value,))
    unit = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    return sum(int(n) * unit[u] for n, u in parts)
