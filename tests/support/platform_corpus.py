"""The documented request and response examples of the platform (tests/platform_corpus/), one JSON file each.

Every file is `<operation>.<n>.json`: {"source": {"page", "version", "date"}, "operation", "request": {"method",
"path", "query", "body"}, "response": {"status", "headers", "body"}}. Nothing here knows an operation by name:
the replay server and the contract tests read whatever files are there, so a new documented object (workspaces,
configs ...) is a new file, not new code.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

CORPUS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "platform_corpus")
# Both documented route prefixes: the newest pages link /v2/harness-runtime, PyDo's "More Information" /v2/agents.
PREFIXES = ("/v2/harness-runtime", "/v2/agents")
_FILE_RE = re.compile(r"^(?P<op>[a-z_]+(?:\.[a-z_]+)+)\.(?P<n>\d+)\.json$")
_PARAM_RE = re.compile(r"\{([a-z_]+)\}")


@dataclass(frozen=True)
class Example:
    """One documented example: where it comes from, the request and the response."""
    file: str
    operation: str
    source: Dict[str, Any]
    request: Dict[str, Any]
    response: Dict[str, Any]

    @property
    def method(self) -> str:
        return self.request["method"].upper()

    @property
    def route(self) -> str:
        """The path without its prefix: '/sessions/{session_id}'."""
        return strip_prefix(self.request["path"])

    @property
    def status(self) -> int:
        return int(self.response["status"])

    @property
    def body(self) -> Any:
        return self.response.get("body")


def strip_prefix(path: str) -> str:
    for prefix in PREFIXES:
        if path == prefix or path.startswith(prefix + "/"):
            return path[len(prefix):] or "/"
    raise ValueError("%s is under no documented prefix (%s)" % (path, ", ".join(PREFIXES)))


def load(directory: str = CORPUS_DIR) -> List[Example]:
    """Every example, checked for the file format; a malformed file is an error naming it."""
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        name = os.path.basename(path)
        m = _FILE_RE.match(name)
        if not m:
            raise ValueError("%s: corpus files are named <operation>.<n>.json" % name)
        with open(path) as f:
            doc = json.load(f)
        for key in ("source", "operation", "request", "response"):
            if key not in doc:
                raise ValueError("%s: no %r" % (name, key))
        if doc["operation"] != m.group("op"):
            raise ValueError("%s: operation %r does not match the file name" % (name, doc["operation"]))
        for key in ("page", "version", "date"):
            if not doc["source"].get(key):
                raise ValueError("%s: source.%s is empty" % (name, key))
        strip_prefix(doc["request"]["path"])
        out.append(Example(name, doc["operation"], doc["source"], doc["request"], doc["response"]))
    if not out:
        raise ValueError("no corpus files in %s" % directory)
    return out


def operations(examples: List[Example]) -> Dict[str, List[Example]]:
    by_op: Dict[str, List[Example]] = {}
    for ex in examples:
        by_op.setdefault(ex.operation, []).append(ex)
    return by_op


def route_regex(route: str) -> "re.Pattern[str]":
    """'/sessions/{session_id}' -> a regex with one named group per parameter; ids are opaque (any segment)."""
    parts = []
    pos = 0
    for m in _PARAM_RE.finditer(route):
        parts.append(re.escape(route[pos:m.start()]))
        parts.append("(?P<%s>[^/]+)" % m.group(1))
        pos = m.end()
    parts.append(re.escape(route[pos:]))
    return re.compile("^" + "".join(parts) + "$")


def match(examples: List[Example], method: str, route: str) -> Optional[tuple]:
    """(operation, path parameters) of the documented operation answering METHOD route, or None.

    A literal route wins over a parameterised one ('/sessions/sandbox/sizes' is not the session 'sandbox').
    """
    found = []
    for op, exs in operations(examples).items():
        ex = exs[0]
        if ex.status >= 400:
            continue  # an error example shows the error shape, not an operation
        if ex.method != method.upper():
            continue
        m = route_regex(ex.route).match(route)
        if m:
            found.append((len(m.groupdict()), op, m.groupdict()))
    if not found:
        return None
    found.sort(key=lambda t: t[0])
    return found[0][1], found[0][2]


def allowed_query(examples: List[Example]) -> frozenset:
    keys = set()
    for ex in examples:
        keys.update((ex.request.get("query") or {}).keys())
    return frozenset(keys)


def allowed_body_keys(examples: List[Example]) -> frozenset:
    keys = set()
    for ex in examples:
        if isinstance(ex.request.get("body"), dict):
            keys.update(ex.request["body"].keys())
    return frozenset(keys)


def key_differences(documented: Any, actual: Any, where: str = "body") -> List[str]:
    """Where `actual` does not have exactly the documented keys, recursively (every list item against the first
    documented item). Values are not compared: only the shape."""
    out: List[str] = []
    if isinstance(documented, dict):
        if not isinstance(actual, dict):
            return ["%s: documented an object, got %s" % (where, type(actual).__name__)]
        for key in sorted(set(documented) - set(actual)):
            out.append("%s: documented key %r is missing" % (where, key))
        for key in sorted(set(actual) - set(documented)):
            out.append("%s: key %r is not documented" % (where, key))
        for key in sorted(set(documented) & set(actual)):
            out.extend(key_differences(documented[key], actual[key], "%s.%s" % (where, key)))
    elif isinstance(documented, list) and documented and isinstance(documented[0], dict):
        if not isinstance(actual, list):
            return ["%s: documented a list, got %s" % (where, type(actual).__name__)]
        for i, item in enumerate(actual):
            out.extend(key_differences(documented[0], item, "%s[%d]" % (where, i)))
    return out


def iter_objects(examples: List[Example]) -> Iterator[Example]:
    """Examples whose response has a body (the ones a key-for-key comparison means something for)."""
    return (ex for ex in examples if ex.body is not None)
