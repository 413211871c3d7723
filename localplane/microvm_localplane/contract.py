"""The platform's decisions, in one place: statuses, limits, clamps, codes and texts.

Everything here comes from docs/platform-contract.md. Lines marked "Decision"
are our choices where the public record is silent; change them here when the
platform publishes more.
"""
import re
import reprlib
import secrets
import time

PREFIXES = ("/v2/agents", "/v2/harness-runtime")
# The collection's default route prefix: what a message names when it cannot tell the prefix of the request.
DEFAULT_PREFIX = "/v2/harness-runtime"
# The size catalog's route under either prefix.
SIZES_PATH = "/sessions/sandbox/sizes"


def prefix_of(path):
    """The route prefix a request path came in under (DEFAULT_PREFIX when none), so messages name routes it uses."""
    for prefix in PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return prefix
    return DEFAULT_PREFIX


API_URL_ENV = "DO_AGENTS_API_URL"
API_TOKEN_ENV = "DO_AGENTS_API_TOKEN"
# Tokens this plane makes start with this, so the collection's clients can
# refuse to send one anywhere but a loopback URL (the collection's
# profile.LOCAL_TOKEN_PREFIX is the same string).
LOCAL_TOKEN_PREFIX = "mvlp-"


def new_token():
    return LOCAL_TOKEN_PREFIX + secrets.token_urlsafe(32)


# -- sessions ---------------------------------------------------------------
STATUS_PREFIX = "SESSION_STATUS_"
PROVISIONING = "PROVISIONING"
READY = "READY"
DETACHED = "DETACHED"
PAUSED = "PAUSED"
DESTROYING = "DESTROYING"
DESTROYED = "DESTROYED"
FAILED = "FAILED"
STATUSES = (PROVISIONING, READY, DETACHED, PAUSED, DESTROYING, DESTROYED, FAILED)
# List filter values that are no status (pydo list_sessions): UNSPECIFIED is no filter, ALL lists every session.
FILTER_UNSPECIFIED = "UNSPECIFIED"
FILTER_ALL = "ALL"
# Hidden from a list without an explicit status filter ("matching the Cloud Console").
HIDDEN_BY_DEFAULT = frozenset([DESTROYED, FAILED])
USABLE = frozenset([READY, DETACHED])
GONE = frozenset([DESTROYING, DESTROYED, FAILED])
PAUSABLE = USABLE
PAUSE_MANUAL = "manual"
PAUSE_IDLE = "idle"

# The flat environment spec (Environment Spec Reference): decoded strictly, an unknown key is a 400 naming it.
# `repos` is in the Refactor a Repository example (a list of GitHub owner/repo).
# `keep_warm` (Environment Spec Reference; reported on the session object): see warmpool.py.
CREATE_KEYS = frozenset(["name", "agent", "template", "size", "idle_timeout", "persistent_workspace", "env",
                         "secrets", "egress", "repos", "permissions", "keep_warm"])
# Documented spec keys that configure an agent adapter's tools and skills: the local plane runs no agent, so it
# refuses them (a 400 naming the key) rather than ignoring them.
DOCUMENTED_UNSUPPORTED_KEYS = frozenset(["tools", "skills"])
# Permission Policies: allow, ask or deny; an omitted permissions.default resolves to ask.
PERMISSION_DECISIONS = ("allow", "ask", "deny")
PERMISSION_DEFAULT = "ask"
PERMISSIONS_KEYS = frozenset(["default", "rules"])
# harness-create-session: two mutually exclusive forms, chosen by Content-Type. YAML is the environment spec;
# JSON is {name, config_id} (a session from a saved Environment Config). Every other call takes JSON.
CREATE_YAML_TYPES = frozenset(["application/x-yaml", "application/yaml", "text/yaml", "text/x-yaml"])
JSON_TYPE = "application/json"
# workspace_id attaches a persistent workspace, only to a session created from a saved config
# (How to Use Persistent Workspaces; doctl harness-runtime create --from-config --workspace).
CREATE_CONFIG_KEYS = frozenset(["name", "config_id", "workspace_id"])
# A top-level apiVersion selects the deprecated agents.digitalocean.com/v1alpha1 envelope (harness-create-session).
LEGACY_ENVELOPE_KEY = "apiVersion"
# update_session: the one patchable session setting today.
PATCH_SESSION_KEYS = frozenset(["resume_on_topoff"])
# Decision: a query-string boolean is read like the platform's gateway reads one (Go's strconv.ParseBool).
QUERY_TRUE = frozenset(["1", "t", "T", "TRUE", "true", "True"])
QUERY_FALSE = frozenset(["0", "f", "F", "FALSE", "false", "False"])
MAX_BODY_BYTES = 1024 * 1024
# Decision: a YAML body's nodes once its aliases are expanded (the largest spec the other bounds allow has a few
# thousand); past this it is refused, so an alias bomb never becomes a structure of billions of nodes.
MAX_YAML_NODES = 20_000
# Agent Adapters page: the values of `agent`.
ADAPTERS = ("codex", "claude-code", "opencode", "hermes", "langgraph", "codex-agentapi", "custom")
# The one adapter the local plane can run: `custom` ("a container image you supply"), a bare sandbox.
LOCAL_ADAPTERS = frozenset(["custom"])
EGRESS_UNRESTRICTED = "unrestricted"
# A `repos` entry, GitHub's owner/repo (Refactor a Repository; doctl create --gh-repo owner/repo).
REPO_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/(?!\.{1,2}$)[A-Za-z0-9._-]{1,100}$")


# The SDKs' agent_kind names: AGENT_KIND_CODEX_CLI, AGENT_KIND_OPENAI_CODEX and AGENT_KIND_CUSTOM are documented;
# Decision: the other adapters' names are the adapter upper-cased.
_AGENT_KINDS = {"codex": "AGENT_KIND_CODEX_CLI", "codex-agentapi": "AGENT_KIND_OPENAI_CODEX"}


def agent_kind(adapter):
    """'claude-code' -> 'AGENT_KIND_CLAUDE_CODE', 'codex' -> 'AGENT_KIND_CODEX_CLI'."""
    return _AGENT_KINDS.get(adapter) or "AGENT_KIND_" + adapter.upper().replace("-", "_")


# The size catalog (GET <prefix>/sessions/sandbox/sizes), smallest first; every slug is accepted by create.
# mars-2vcpu-4gb is the documented example; the other slug follows its pattern (Decision).
SIZES = (
    {"slug": "mars-2vcpu-4gb", "vcpus": 2, "memory_mb": 4096, "price_per_hour_usd": 0.0, "price_per_month_usd": 0.0},
    {"slug": "mars-4vcpu-8gb", "vcpus": 4, "memory_mb": 8192, "price_per_hour_usd": 0.0, "price_per_month_usd": 0.0},
)
SIZE_SLUGS = tuple(s["slug"] for s in SIZES)
# Decision: the default-size fallback is the smallest size.
DEFAULT_SIZE = SIZE_SLUGS[0]
# Decision: the region the local plane reports.
REGION = "local"

NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$")
UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_RE = re.compile(r"^(?=.{1,253}$)(\*\.)?%s(?:\.%s)*$" % (_LABEL, _LABEL))
# Decision: idle timeout when none is given, and the accepted range.
DEFAULT_IDLE_TIMEOUT_SECONDS = 600
MIN_IDLE_TIMEOUT_SECONDS = 1
MAX_IDLE_TIMEOUT_SECONDS = 7 * 24 * 3600
# Decision: DESTROYED records stay queryable this long, then are purged.
DESTROYED_RETENTION_SECONDS = 3600
MAX_ENV_ENTRIES = 256
MAX_EGRESS_HOSTS = 256
# Decision: an egress host that does not resolve is refused at create, a 400 naming every such host. The Network
# Egress page says only that naming a host turns the allowlist on and denies every host not named; it is silent on
# a name that does not resolve. Accepting one would start a session with less egress than asked, without a word.
# Checked on the plane's host (its resolvers), names in parallel, at most this long in all (slower = unresolvable);
# `*.` wildcards and IPv4 addresses are not looked up.
EGRESS_RESOLVE_TIMEOUT_SECONDS = 10.0


def egress_unresolvable_message(hosts):
    """The create refusal naming the egress hosts that do not resolve (each shown, at most 10 named)."""
    named = ", ".join(shown(h) for h in hosts[:10]) + (" and %d more" % (len(hosts) - 10) if len(hosts) > 10 else "")
    return ("egress host%s %s do%s not resolve: the session could not reach %s; fix or remove %s"
            % ("s" if len(hosts) > 1 else "", named, "" if len(hosts) > 1 else "es",
               "them" if len(hosts) > 1 else "it", "them" if len(hosts) > 1 else "it"))


# -- listing ----------------------------------------------------------------
DEFAULT_PAGE_SIZE = 50
# Decision: larger page sizes are clamped, not refused.
MAX_PAGE_SIZE = 200

# -- checkpoints and fork ---------------------------------------------------
CHECKPOINT_PENDING = "PENDING"
CHECKPOINT_READY = "READY"
CHECKPOINT_FAILED = "FAILED"
CHECKPOINT_KEYS = frozenset(["label"])
# A checkpoint's kind: "explicit" is the documented value (a checkpoint asked for). Decision: the implicit checkpoint
# a fork without from_checkpoint_id takes first is "implicit".
CHECKPOINT_KIND_EXPLICIT = "explicit"
CHECKPOINT_KIND_IMPLICIT = "implicit"
MAX_LABEL_CHARS = 256
FORK_KEYS = frozenset(["from_checkpoint_id", "count"])
# Label of the implicit checkpoint a fork without from_checkpoint_id takes first (Decision: it is listed).
IMPLICIT_FORK_LABEL = "fork"
FORK_MIN, FORK_MAX = 1, 4

# -- templates --------------------------------------------------------------
TEMPLATE_STATUS_PREFIX = "TEMPLATE_STATUS_"
TEMPLATE_PENDING = "PENDING"
TEMPLATE_BUILDING = "BUILDING"
TEMPLATE_READY = "READY"
TEMPLATE_FAILED = "FAILED"
BUILD_PENDING = "PENDING"
BUILD_BUILDING = "BUILDING"
BUILD_SUCCEEDED = "SUCCEEDED"
BUILD_FAILED = "FAILED"
TEMPLATE_CREATE_KEYS = frozenset(["name", "base_template", "source_oci_ref"])
TEMPLATE_UPDATE_KEYS = frozenset(["source_oci_ref", "base_template"])
# base_template values the documentation gives (doctl template create/update, pydo create_template):
# the current bases, the `sandbox` base that carries no agent, and the legacy names still accepted.
BASE_TEMPLATES = ("codex-base", "opencode-base", "claude-code-base", "hermes-base", "langgraph-base", "sandbox",
                  "crewai", "coding-base", "coding-codex", "coding-opencode", "coding-claude-code", "coding-hermes",
                  "langgraph")
# The built-in template: the host userland read-only, nothing to download.
BUILTIN_TEMPLATE = "base"
BUILTIN_TEMPLATE_ID = "00000000-0000-4000-8000-000000000000"
DEFAULT_TEMPLATE = BUILTIN_TEMPLATE

# -- REST exec and workspace transfer ---------------------------------------
EXEC_KEYS = frozenset(["argv", "workdir", "timeout_seconds", "stdin"])
EXEC_STREAM_CAP = 1024 * 1024
EXEC_DEFAULT_TIMEOUT = 60
EXEC_MAX_TIMEOUT = 240
MAX_UPLOAD_BYTES = 500 * 1024 * 1024
# Decision: the REST download streams at most this much payload. The platform's streaming path "supports" about
# 50 MiB; larger payloads go through staged, object-storage-backed transfers (pydo create_session_workspace_transfer;
# transfers.py). A file over it is a 413 before anything is sent; an archive (whose size is known only as it is
# made: a sparse 3 GiB file is 3 GiB of tar) is cut there, without the footer, which clients treat as a failed
# transfer.
MAX_DOWNLOAD_BYTES = 50 * 1024 * 1024
TRANSFER_ROOT = "/workspace"
DEFAULT_WORKDIR = "/workspace"
DOWNLOAD_FOOTER_MAGIC = b"DOWSSHA1"
DOWNLOAD_FOOTER_BYTES = 73
TRANSFER_CHUNK = 256 * 1024

# -- port-forward -----------------------------------------------------------
AGENT_PORT = 8443
MIN_FORWARD_PORT, MAX_FORWARD_PORT = 1024, 65535
CLOSE_GUEST_HUNG_UP = 1000
CLOSE_SESSION_UNAVAILABLE = 4001
CLOSE_DIAL_FAILED = 4002
CLOSE_UPSTREAM_ERROR = 4011
WS_MAX_FRAME = 4 * 1024 * 1024


def status_string(short):
    return STATUS_PREFIX + short


def template_status_string(short):
    return TEMPLATE_STATUS_PREFIX + short


def parse_status_filter(value):
    """'READY' or 'SESSION_STATUS_READY' -> 'READY'; also 'UNSPECIFIED' and 'ALL'; None when unknown."""
    s = (value or "").strip().upper()
    if s.startswith(STATUS_PREFIX):
        s = s[len(STATUS_PREFIX):]
    return s if s in STATUSES or s in (FILTER_UNSPECIFIED, FILTER_ALL) else None


def new_checkpoint_id():
    """A documented-looking checkpoint id (`cp_9f2c1a4b` in the pydo examples), so clients meet a non-UUID id here
    as they do on the platform. Decision: 16 hex digits after the prefix, for uniqueness."""
    return "cp_" + secrets.token_hex(8)


def new_event_id():
    """A documented-looking event id (a 26-character ULID, as in the checkpoint examples).

    Decision: the local plane keeps no event log; the id is time-ordered and unique, and names nothing else.
    """
    alphabet = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    value = (int(time.time() * 1000) << 80) | secrets.randbits(80)
    return "".join(alphabet[(value >> (5 * i)) & 31] for i in reversed(range(26)))


SHOWN_MAX = 80   # characters of a submitted value an error message echoes


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxdict, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxset = 2, 4, 4, 4, 4
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = SHOWN_MAX


def shown(value) -> str:
    """A submitted value as an error message may echo it: repr-like, at most about SHOWN_MAX characters.

    Never `%r` of a value from a request: a YAML body's aliases can make a 361-byte document a structure whose
    repr is gigabytes, and a 1 MiB string is no better in a message. reprlib stops at a few levels and items
    without walking the rest.
    """
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_MAX + 10 else text[:SHOWN_MAX] + "..."


def name_problem(name, what="session"):
    """Why a name breaks the platform's rules, or None when it is fine."""
    if name is None or name == "":
        return "%s name is required: 1-64 characters of [A-Za-z0-9._-]" % what
    if not isinstance(name, str):
        return "%s name must be a string (quote it), got %s %s" % (what, type(name).__name__, shown(name))
    if len(name) > 64:
        return "%s name %s is too long (%d characters, at most 64)" % (what, shown(name), len(name))
    if not NAME_RE.match(name):
        return ("%s name %s is invalid: use 1-64 characters of [A-Za-z0-9._-], "
                "starting and ending with a letter or digit" % (what, shown(name)))
    if UUID_RE.match(name):
        return "%s name %r is invalid: a name must not look like a UUID" % (what, name)
    return None


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text):
    """A Go-style duration string ('600s', '10m', '1h30m') -> seconds; None when malformed."""
    if not isinstance(text, str) or not text:
        return None
    pos, total = 0, 0.0
    while pos < len(text):
        m = _DURATION_PART.match(text, pos)
        if not m:
            return None
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    return total
