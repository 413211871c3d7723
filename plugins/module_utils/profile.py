# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The platform profile: where the guest lets files move, and our decisions.

Every path rule of the platform lives here, so a change in the platform's
contract is a change in one file.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import posixpath
import re
from typing import Any, Collection

try:
    from urllib.parse import urlsplit
except ImportError:  # pragma: no cover - Python 2 module sanity only
    from urlparse import urlsplit  # type: ignore

TRANSFER_ROOT = "/workspace"
SCRATCH_DIR = "/workspace/.scratch"
HOME_DIR = "/workspace/home"
DEFAULT_WORKDIR = "/workspace"
# What the collection keeps in a session about itself (never exported: it is under the scratch dir).
STATE_DIR = SCRATCH_DIR + "/.microvm"
# One symlink per credential directory the credentials role staged, named by the directory, pointing at it:
# checkpoint, session_fork and workspace_export read it (roles/credentials/vars/main.yml names the same path).
STAGED_CREDENTIALS_DIR = STATE_DIR + "/staged-credentials"
AGENT_PORT = 8443
DEFAULT_API_URL = "https://api.digitalocean.com"
# The newest pages and SDK links use /v2/harness-runtime; /v2/agents is the older form, still selectable.
DEFAULT_PREFIX = "/v2/harness-runtime"
LEGACY_PREFIX = "/v2/agents"
API_URL_ENV = "DO_AGENTS_API_URL"
API_TOKEN_ENV = "DO_AGENTS_API_TOKEN"
# Where the token is read from, first found wins: ours, then doctl's and community.digitalocean's names.
API_TOKEN_ENVS = (API_TOKEN_ENV, "DIGITALOCEAN_TOKEN", "DIGITALOCEAN_ACCESS_TOKEN")
API_PREFIX_ENV = "DO_AGENTS_API_PREFIX"

# The adapters of the environment spec's `agent` field
# (https://docs.digitalocean.com/products/managed-agents/agent-harness-runtime/concepts/agent-adapters/).
ADAPTERS = ("codex", "claude-code", "opencode", "hermes", "langgraph", "codex-agentapi", "custom")
# A bare sandbox that runs your own code: `custom` runs "a container image you supply" (Agent Adapters page);
# the `sandbox` base template "carries no agent" (doctl harness-runtime template create).
DEFAULT_AGENT = "custom"
# The SDKs' agent_kind names (enum names without AGENT_KIND_) for each adapter: the pages show AGENT_KIND_CODEX_CLI,
# AGENT_KIND_OPENAI_CODEX and AGENT_KIND_CUSTOM. Decision: the adapter's own name upper-cased is accepted too.
AGENT_KIND_NAMES = {
    "codex": ("CODEX_CLI", "CODEX"),
    "codex-agentapi": ("OPENAI_CODEX", "CODEX_AGENTAPI"),
    "claude-code": ("CLAUDE_CODE",),
    "opencode": ("OPENCODE",),
    "hermes": ("HERMES",),
    "langgraph": ("LANGGRAPH",),
    "custom": ("CUSTOM",),
}
# permissions.default (Permission Policies): omitted, it resolves to ask, which holds commands for human approval.
PERMISSION_DECISIONS = ("allow", "ask", "deny")
PERMISSION_DEFAULT_WHEN_OMITTED = "ask"
# Tokens the local control plane issues start with this; such a token is only
# ever sent to a loopback URL (token_destination_problem).
LOCAL_TOKEN_PREFIX = "mvlp-"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

STATUS_PREFIX = "SESSION_STATUS_"
USABLE = frozenset(["READY", "DETACHED"])
GONE = frozenset(["DESTROYING", "DESTROYED", "FAILED"])
KNOWN_STATUSES = frozenset(["PROVISIONING", "READY", "DETACHED", "PAUSED", "DESTROYING", "DESTROYED", "FAILED"])
# The session list hides these unless asked for them by name or with SESSION_STATUS_ALL (pydo list_sessions).
HIDDEN_BY_DEFAULT = frozenset(["DESTROYED", "FAILED"])
STATUS_ALL = STATUS_PREFIX + "ALL"


def list_status_filter(statuses: Collection[str] | None) -> str | None:
    """The `status` query of a session list that returns every session in `statuses` (a set of short names).

    None (no statuses) is the platform's default listing, which hides DESTROYED and FAILED sessions. One status
    is asked for by name; several need SESSION_STATUS_ALL when one of them is hidden by default.
    """
    if statuses is None:
        return None
    if len(statuses) == 1:
        return STATUS_PREFIX + next(iter(statuses))
    return STATUS_ALL if set(statuses) & HIDDEN_BY_DEFAULT else None


def hitl_rejected_message(session: str) -> str:
    """Why a command came back `hitl_rejected`, and what to change."""
    return ("the command on session %s was held for human approval and rejected (hitl_rejected): the session's "
            "permission policy asks before running it. permissions.default resolves to ask when omitted; create "
            "the session with permissions: {default: allow} (option permissions of microvm.sandbox.session), or "
            "rules that allow the commands your tasks run" % session)


def token_destination_problem(api_url: str, token: str) -> str | None:
    """Why this token must not go to this URL, or None.

    A local control plane's token is refused for any URL that is not loopback:
    with DO_AGENTS_API_URL unset (the platform's URL is the default) and the local
    plane's token in DO_AGENTS_API_TOKEN, nothing is sent anywhere.
    """
    if not (token or "").startswith(LOCAL_TOKEN_PREFIX):
        return None
    host = (urlsplit(api_url or DEFAULT_API_URL).hostname or "").lower()
    if host in LOOPBACK_HOSTS or host.startswith("127."):
        return None
    return ("the API token is a local control plane's (it starts with %r) but the API URL is %s%s: refusing to send "
            "it there. Point %s at the local plane (source the env file that `up` wrote, which sets both), or use "
            "your platform token." % (LOCAL_TOKEN_PREFIX, api_url or DEFAULT_API_URL,
                                      "" if api_url and api_url != DEFAULT_API_URL else
                                      " (the default: %s is not set)" % API_URL_ENV, API_URL_ENV))


def api_url_path_problem(api_url: str, prefix: str | None = None) -> str | None:
    """Why this API URL cannot be right for this route prefix, or None.

    The collection appends the route prefix (/v2/harness-runtime) to the URL itself, so a URL that already carries
    the API's /v2 (https://api.example.com/v2, .../v2/agents) would send every call to /v2/v2/...: each would come
    back 404, read as "no such session" (and a delete as "already gone"). A path without /v2 is kept, as documented
    (a gateway's mount point). Only a prefix under /v2 makes a /v2 in the URL certain to be wrong.
    """
    prefix = "/" + (prefix or DEFAULT_PREFIX).strip("/")
    if not prefix.lower().startswith("/v2/"):
        return None
    parts = urlsplit(api_url or DEFAULT_API_URL)
    segments = [s for s in parts.path.split("/") if s]
    low = [s.lower() for s in segments]
    if "v2" not in low:
        return None
    at = low.index("v2")
    base = "%s://%s%s" % (parts.scheme, parts.netloc, "".join("/" + s for s in segments[:at]))
    path = parts.path.rstrip("/")
    routes = "/" + "/".join(low[at:])
    also = ""
    if routes in (DEFAULT_PREFIX, LEGACY_PREFIX) and routes != prefix.lower():
        also = ", and set the option route_prefix or env %s to %s for those routes" % (API_PREFIX_ENV, routes)
    return ("the API URL %s carries the path %s, part of the API's own routes: the collection adds the route "
            "prefix (%s, option route_prefix or env %s) itself, so every call would go to %s%s/... and fail. Set "
            "the option api_url or env %s to %s%s%s" % (
                api_url, path, prefix, API_PREFIX_ENV, path, prefix, API_URL_ENV, base,
                " (the bare origin)" if at == 0 else " (the URL without %s)" % routes, also))


class TransferPathError(ValueError):
    """A transfer path the platform would refuse; raised before any network call."""


def short_status(status: Any) -> str:
    """'SESSION_STATUS_READY' -> 'READY'; unknown strings -> 'UNSPECIFIED'."""
    s = (status or "").upper()
    if s.startswith(STATUS_PREFIX):
        s = s[len(STATUS_PREFIX):]
    return s if s in KNOWN_STATUSES else "UNSPECIFIED"


def warnings_note(session: dict[str, Any]) -> str:
    """' (the session's warnings: a; b)' or ''. The session object has no error text: a failed session's only
    documented words are its `warnings` (https://docs.digitalocean.com/reference/pydo/reference/harness/get_session/)."""
    warnings = [str(w) for w in ((session or {}).get("warnings") or []) if str(w).strip()]
    return (" (the session's warnings: %s)" % "; ".join(warnings)) if warnings else ""


def guest_path(path: str) -> str:
    """A guest path as the platform reads it: relative to the default workdir, '~' as the platform's home."""
    if path == "~" or path.startswith("~/"):
        path = HOME_DIR + path[1:]
    if not path.startswith("/"):
        path = posixpath.join(DEFAULT_WORKDIR, path)
    return posixpath.normpath(path)


def is_within(path: str, root: str = TRANSFER_ROOT) -> bool:
    """True when the normalized absolute path lies at or under root."""
    norm = posixpath.normpath(path)
    return norm == root or norm.startswith(root.rstrip("/") + "/")


def check_transfer_path(path: str, scratch_dir: str = SCRATCH_DIR, what: str = "transfer path") -> str:
    """Refuse locally what the guest agent refuses remotely.

    Returns the normalized path. Symlinks are resolved by the guest, which
    refuses them the same way; this guard catches the textual cases early.
    """
    if not isinstance(path, str) or not path:
        raise TransferPathError("%s is empty: give an absolute path under %s" % (what, TRANSFER_ROOT))
    if "\x00" in path:
        raise TransferPathError("%s %r contains a NUL byte" % (what, path))
    if not path.startswith("/"):
        raise TransferPathError("%s %r is relative: the platform's agent only accepts absolute paths under %s"
                                % (what, path, TRANSFER_ROOT))
    if not is_within(path):
        raise TransferPathError(
            "%s %r is outside %s: the platform's agent only transfers files under %s "
            "(it answers PERMISSION_DENIED 'path outside workspace'). Stage the file under the scratch dir %s instead."
            % (what, path, TRANSFER_ROOT, TRANSFER_ROOT, scratch_dir))
    return posixpath.normpath(path)


def check_scratch_dir(scratch_dir: str, what: str = "scratch dir") -> str:
    """A scratch dir (or remote_tmp) must live under the transfer root."""
    if not isinstance(scratch_dir, str) or not scratch_dir.startswith("/") or not is_within(scratch_dir) \
            or posixpath.normpath(scratch_dir) == TRANSFER_ROOT:
        raise TransferPathError(
            "%s %r must be an absolute directory inside %s: the platform's agent only transfers files under %s, "
            "so scratch files elsewhere (for example /tmp) cannot be copied in or out. Use %s."
            % (what, scratch_dir, TRANSFER_ROOT, TRANSFER_ROOT, SCRATCH_DIR))
    return posixpath.normpath(scratch_dir)


# Session names: 1-64 chars of [A-Za-z0-9._-], alphanumeric at both ends, never UUID-shaped.
SESSION_NAME_RE = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$"
UUID_RE = r"^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"


def looks_like_uuid(value: str | None) -> bool:
    return bool(re.match(UUID_RE, value or ""))


def session_name_problem(name: str) -> str | None:
    """Why `name` cannot name a session (None when it can)."""
    if not re.match(SESSION_NAME_RE, name or ""):
        return ("a session name is 1-64 characters of letters, digits, '.', '_' and '-', "
                "starting and ending with a letter or digit")
    if looks_like_uuid(name):
        return "a session name must not look like a UUID (that shape is reserved for session ids)"
    return None
