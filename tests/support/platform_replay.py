"""A strict stand-in for the platform that answers only in the documented shapes (tests/platform_corpus/).

A real HTTP server on loopback. Every answer is built from the corpus example of its operation: exactly the
documented keys, with this server's own state in them (ids substituted consistently). Anything the documentation
does not show is refused in the documented error shape and recorded in `undocumented`, so a test can assert the
collection never sent it: an unknown route, query parameter, body key or enum value.

Ids are minted in documented-looking but non-UUID forms (`sess_...` as in doctl's examples, `cp_...` as in the
checkpoint examples), so code that decides "id or name" from an id's shape fails here as it would on the platform.
Operations without their own handler (objects documented later) answer their example body as it is.
"""
from __future__ import annotations

import copy
import json
import secrets
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, urlsplit

import yaml

from platform_corpus import Example, PREFIXES, allowed_body_keys, allowed_query, load, match, operations, \
    strip_prefix

TOKEN = "replay-" + "0" * 16
# The session list's status filter (pydo list_sessions, v0.46.0).
SESSION_STATUSES = ("UNSPECIFIED", "PROVISIONING", "READY", "DETACHED", "DESTROYING", "DESTROYED", "FAILED", "PAUSED",
                    "ALL")
HIDDEN_BY_DEFAULT = ("DESTROYED", "FAILED")
# Environment Spec Reference (flat format) plus `template` and `repos` (doctl create --template, Refactor a Repository).
SPEC_KEYS = frozenset(["name", "agent", "template", "size", "idle_timeout", "persistent_workspace", "env", "secrets",
                       "egress", "tools", "skills", "permissions", "keep_warm", "region", "repos"])
PERMISSION_DECISIONS = ("allow", "ask", "deny")
# The SDKs' agent_kind names for the documented adapters (AGENT_KIND_CODEX_CLI, AGENT_KIND_OPENAI_CODEX and
# AGENT_KIND_CUSTOM appear in the SDK pages; the others follow the adapter's name).
AGENT_KINDS = {"codex": "AGENT_KIND_CODEX_CLI", "codex-agentapi": "AGENT_KIND_OPENAI_CODEX",
               "claude-code": "AGENT_KIND_CLAUDE_CODE", "opencode": "AGENT_KIND_OPENCODE",
               "hermes": "AGENT_KIND_HERMES", "langgraph": "AGENT_KIND_LANGGRAPH", "custom": "AGENT_KIND_CUSTOM"}
RATE_HEADERS = {"ratelimit-limit": "5000", "ratelimit-remaining": "4999", "ratelimit-reset": "1444931833"}
NOW = "2026-11-20T12:00:00Z"


class Refusal(Exception):
    def __init__(self, status: int, ident: str, message: str, undocumented: bool = False):
        super().__init__(message)
        self.status, self.ident, self.message, self.undocumented = status, ident, message, undocumented


def _blank(documented: Any) -> Any:
    """An empty value of the documented value's type."""
    if isinstance(documented, bool):
        return False
    if isinstance(documented, (int, float)):
        return type(documented)(0)
    if isinstance(documented, list):
        return []
    if isinstance(documented, dict):
        return {}
    return ""


def shaped(documented: Dict[str, Any], values: Dict[str, Any]) -> Dict[str, Any]:
    """The documented object's keys, each with our value (or an empty one of the documented type)."""
    return {k: copy.deepcopy(values[k]) if k in values else _blank(v) for k, v in documented.items()}


class ReplayPlatform:
    """The state behind the replay server: sessions, checkpoints, templates and builds."""

    def __init__(self, examples: Optional[List[Example]] = None):
        self.examples = examples if examples is not None else load()
        self.ops = operations(self.examples)
        self.lock = threading.Lock()
        self.sessions: Dict[str, Dict[str, Any]] = {}
        self.checkpoints: Dict[str, Dict[str, Dict[str, Any]]] = {}
        self.templates: Dict[str, Dict[str, Any]] = {}
        self.builds: Dict[str, List[Dict[str, Any]]] = {}
        self.calls: List[Tuple[str, str, str]] = []  # (method, path with prefix, operation)
        self.undocumented: List[str] = []
        self.seq = 0

    # -- shapes -------------------------------------------------------------
    def doc(self, op: str, *path: Any) -> Any:
        body = self.ops[op][0].body
        for p in path:
            body = body[p]
        return body

    def session_view(self, rec: Dict[str, Any]) -> Dict[str, Any]:
        return shaped(self.doc("sessions.get", "session"), rec)

    def checkpoint_view(self, rec: Dict[str, Any]) -> Dict[str, Any]:
        return shaped(self.doc("checkpoints.get", "checkpoint"), rec)

    def template_view(self, rec: Dict[str, Any], listed: bool = False) -> Dict[str, Any]:
        if listed:
            return shaped(self.doc("templates.list", "templates", 0), rec)
        return shaped(self.doc("templates.get", "template"), rec)

    def build_view(self, rec: Dict[str, Any], listed: bool = False) -> Dict[str, Any]:
        if listed:
            return shaped(self.doc("templates.list_builds", "builds", 0), rec)
        return shaped(self.doc("templates.get_build", "build"), rec)

    def mint(self, prefix: str) -> str:
        self.seq += 1
        return "%s_%s%02d" % (prefix, secrets.token_hex(4), self.seq % 100)

    # -- test controls ------------------------------------------------------
    def set_status(self, session_id: str, status: str) -> None:
        """Put a session in a status no call reaches here (FAILED, say)."""
        with self.lock:
            self.sessions[session_id]["status"] = "SESSION_STATUS_" + status

    def operations_called(self) -> List[str]:
        return [op for _m, _p, op in self.calls]

    # -- dispatch -----------------------------------------------------------
    def handle(self, method: str, path: str, query: Dict[str, str], headers: Dict[str, str],
               raw: bytes) -> Tuple[int, Any]:
        route = strip_prefix(path)
        found = match(self.examples, method, route)
        if found is None:
            raise Refusal(404, "not_found", "no documented operation answers %s %s" % (method, path), True)
        op, params = found
        self.calls.append((method, path, op))
        exs = self.ops[op]
        allowed = set(allowed_query(exs))
        if any("next_page_token" in (ex.body or {}) for ex in exs):
            allowed.update(("page_size", "page_token"))
        for key in query:
            if key not in allowed:
                raise Refusal(400, "bad_request", "%s takes no query parameter %r" % (op, key), True)
        body = self.decode_body(op, exs, headers, raw)
        handler: Optional[Callable[..., Tuple[int, Any]]] = getattr(self, "op_" + op.replace(".", "_"), None)
        with self.lock:
            if handler is None:
                return exs[0].status, copy.deepcopy(exs[0].body)
            return handler(params, query, body)

    def decode_body(self, op: str, exs: List[Example], headers: Dict[str, str], raw: bytes) -> Any:
        ctype = (headers.get("content-type") or "").split(";")[0].strip().lower()
        if not raw:
            return None
        if "yaml" in ctype:
            try:
                doc = yaml.safe_load(raw.decode("utf-8"))
            except (yaml.YAMLError, UnicodeDecodeError) as e:
                raise Refusal(400, "bad_request", "the YAML body does not parse: %s" % e) from e
            keys = SPEC_KEYS
        else:
            try:
                doc = json.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise Refusal(400, "bad_request", "error parsing request body") from e
            keys = allowed_body_keys(exs)
        if not isinstance(doc, dict):
            raise Refusal(400, "bad_request", "the body must be an object")
        for key in doc:
            if key not in keys:
                raise Refusal(400, "bad_request", "%s: unknown field %r" % (op, key), True)
        return doc

    # -- helpers ------------------------------------------------------------
    def session(self, sid: str) -> Dict[str, Any]:
        rec = self.sessions.get(sid)
        if rec is None:
            raise Refusal(404, "not_found", "session %s not found" % sid)
        return rec

    def page(self, items: List[Any], key: str, query: Dict[str, str]) -> Tuple[int, Any]:
        size = int(query.get("page_size") or 50)
        size = 50 if size <= 0 else min(size, 200)
        token = query.get("page_token") or ""
        start = 0
        if token:
            if not token.startswith("o") or not token[1:].isdigit():
                raise Refusal(400, "bad_request", "invalid page_token")
            start = int(token[1:])
        chunk = items[start:start + size]
        nxt = "o%d" % (start + size) if start + size < len(items) else ""
        return 200, {key: chunk, "next_page_token": nxt}

    # -- sessions -----------------------------------------------------------
    def op_sessions_create(self, params, query, body):
        spec = body or {}
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise Refusal(400, "bad_request", "name is required")
        for rec in self.sessions.values():
            if rec["name"].lower() == name.lower() and rec["status"][len("SESSION_STATUS_"):] not in (
                    "DESTROYING", "DESTROYED", "FAILED"):
                raise Refusal(409, "conflict", "a live session named %r exists" % name)
        agent = spec.get("agent", "custom")
        if agent not in AGENT_KINDS:
            raise Refusal(400, "bad_request", "unknown agent %r" % agent, True)
        perms = spec.get("permissions")
        if perms is not None:
            if not isinstance(perms, dict) or perms.get("default", "ask") not in PERMISSION_DECISIONS:
                raise Refusal(400, "bad_request", "permissions.default is one of allow, ask, deny", True)
        sid = self.mint("sess")
        rec = {"session_id": sid, "name": name, "agent_kind": AGENT_KINDS[agent], "status": "SESSION_STATUS_READY",
               "sandbox_id": self.mint("sbx"), "created_at": NOW, "last_event_at": NOW,
               "idle_timeout_seconds": 600, "region": "ric1", "warnings": [],
               "resume_on_topoff": query.get("resume_on_topoff") == "true",
               # not reported by the session object: what the spec asked for
               "_permissions_default": (perms or {}).get("default", "ask")}
        self.sessions[sid] = rec
        self.checkpoints[sid] = {}
        return 200, {"session": self.session_view(rec)}

    def op_sessions_get(self, params, query, body):
        return 200, {"session": self.session_view(self.session(params["session_id"]))}

    def op_sessions_list(self, params, query, body):
        status = (query.get("status") or "").upper()
        short = status[len("SESSION_STATUS_"):] if status.startswith("SESSION_STATUS_") else status
        if status and short not in SESSION_STATUSES:
            raise Refusal(400, "bad_request", "unknown status %r" % status, True)
        name = (query.get("name") or "").lower()
        search = (query.get("search") or "").lower()
        out = []
        for rec in self.sessions.values():
            s = rec["status"][len("SESSION_STATUS_"):]
            if short in ("", "UNSPECIFIED"):
                if s in HIDDEN_BY_DEFAULT:
                    continue
            elif short != "ALL" and s != short:
                continue
            if name and rec["name"].lower() != name:
                continue
            if search and search not in rec["name"].lower() and search not in rec["session_id"].lower():
                continue
            out.append(self.session_view(rec))
        out.reverse()  # newest first
        return self.page(out, "sessions", query)

    def op_sessions_update(self, params, query, body):
        rec = self.session(params["session_id"])
        if not body:
            raise Refusal(400, "bad_request", "an empty update is refused")
        rec["resume_on_topoff"] = bool(body["resume_on_topoff"])
        return 200, {"session": self.session_view(rec)}

    def op_sessions_delete(self, params, query, body):
        self.session(params["session_id"])["status"] = "SESSION_STATUS_DESTROYED"
        return 204, None

    def op_sessions_pause(self, params, query, body):
        rec = self.session(params["session_id"])
        if rec["status"] not in ("SESSION_STATUS_READY", "SESSION_STATUS_DETACHED"):
            raise Refusal(409, "conflict", "session is %s" % rec["status"])
        rec.update(status="SESSION_STATUS_PAUSED", pause_reason="manual")
        return 204, None

    def op_sessions_resume(self, params, query, body):
        rec = self.session(params["session_id"])
        if rec["status"] != "SESSION_STATUS_PAUSED":
            raise Refusal(409, "conflict", "session is %s" % rec["status"])
        rec.update(status="SESSION_STATUS_READY", pause_reason="")
        return 204, None

    def op_sessions_fork(self, params, query, body):
        parent = self.session(params["session_id"])
        body = body or {}
        count = body.get("count", 1)
        if not isinstance(count, int) or not 1 <= count <= 4:
            raise Refusal(400, "bad_request", "count must be 1-4")
        cid = body.get("from_checkpoint_id") or ""
        if cid:
            if cid not in self.checkpoints[parent["session_id"]]:
                raise Refusal(404, "not_found", "checkpoint %s not found" % cid)
        else:
            cid = self._checkpoint(parent, "")["checkpoint_id"]
        fork_id = str(uuid.uuid4())
        children = []
        for _i in range(count):
            sid = self.mint("sess")
            rec = dict(parent, session_id=sid, name="%s-fork-%s" % (parent["name"], sid[-6:]),
                       parent_session_id=parent["session_id"], fork_id=fork_id, fork_from_checkpoint_id=cid,
                       sandbox_id=self.mint("sbx"), status="SESSION_STATUS_READY")
            self.sessions[sid] = rec
            self.checkpoints[sid] = {}
            children.append(self.session_view(rec))
        return 200, {"sessions": children}

    def op_sessions_list_sizes(self, params, query, body):
        return 200, copy.deepcopy(self.doc("sessions.list_sizes"))

    def op_sessions_exec(self, params, query, body):
        """The documented buffered answer of a command that printed nothing: this stand-in has no guest to run it in.

        A paused session is woken, as any exec wakes it on the platform (a dial or input resumes a session).
        """
        rec = self.session(params["session_id"])
        if rec["status"] in ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED", "SESSION_STATUS_FAILED"):
            raise Refusal(409, "conflict", "session is %s" % rec["status"])
        if not isinstance(body, dict) or not isinstance(body.get("argv"), list) or not body["argv"]:
            raise Refusal(400, "bad_request", "argv is required and must be a non-empty list of strings")
        rec["status"] = "SESSION_STATUS_READY"
        return 200, shaped(self.doc("sessions.exec"), {"exit_code": 0, "stdout": "", "stderr": "", "duration_ms": 1})

    # -- checkpoints --------------------------------------------------------
    def _checkpoint(self, rec: Dict[str, Any], label: str) -> Dict[str, Any]:
        if rec["status"] not in ("SESSION_STATUS_READY", "SESSION_STATUS_DETACHED"):
            raise Refusal(409, "conflict", "session is %s" % rec["status"])
        cid = self.mint("cp")
        cp = {"checkpoint_id": cid, "session_id": rec["session_id"], "status": "READY", "kind": "explicit",
              "label": label, "event_id": "01J" + secrets.token_hex(12)[:23].upper(), "size_bytes": 1048576,
              "created_at": NOW, "error_message": ""}
        self.checkpoints[rec["session_id"]][cid] = cp
        return cp

    def op_checkpoints_create(self, params, query, body):
        rec = self.session(params["session_id"])
        return 200, {"checkpoint": self.checkpoint_view(self._checkpoint(rec, (body or {}).get("label", "")))}

    def op_checkpoints_list(self, params, query, body):
        rec = self.session(params["session_id"])
        cps = [self.checkpoint_view(c) for c in reversed(list(self.checkpoints[rec["session_id"]].values()))]
        return self.page(cps, "checkpoints", query)

    def _cp(self, params) -> Dict[str, Any]:
        rec = self.session(params["session_id"])
        cp = self.checkpoints[rec["session_id"]].get(params["checkpoint_id"])
        if cp is None:
            raise Refusal(404, "not_found", "checkpoint %s not found" % params["checkpoint_id"])
        return cp

    def op_checkpoints_get(self, params, query, body):
        return 200, {"checkpoint": self.checkpoint_view(self._cp(params))}

    def op_checkpoints_delete(self, params, query, body):
        self._cp(params)
        del self.checkpoints[params["session_id"]][params["checkpoint_id"]]
        return 204, None

    def op_checkpoints_rollback(self, params, query, body):
        self._cp(params)
        rec = self.session(params["session_id"])
        rec.update(sandbox_id=self.mint("sbx"), status="SESSION_STATUS_READY")
        return 200, {"session": self.session_view(rec)}

    # -- templates ----------------------------------------------------------
    def template(self, tid: str) -> Dict[str, Any]:
        rec = self.templates.get(tid)
        if rec is None:
            raise Refusal(404, "not_found", "template %s not found" % tid)
        return rec

    def _build(self, rec: Dict[str, Any]) -> None:
        self.builds[rec["template_id"]].append({
            "build_id": str(uuid.uuid4()), "template_id": rec["template_id"], "name": rec["name"],
            "spec": dict(rec["spec"]), "status": "SUCCEEDED", "error": "", "created_at": NOW, "updated_at": NOW})

    def op_templates_create(self, params, query, body):
        body = body or {}
        for key in ("name", "base_template", "source_oci_ref"):
            if not body.get(key):
                raise Refusal(400, "bad_request", "%s is required" % key)
        if any(t["name"] == body["name"] for t in self.templates.values()):
            raise Refusal(409, "conflict", "template %r exists" % body["name"])
        tid = str(uuid.uuid4())
        rec = {"template_id": tid, "name": body["name"], "spec": {"base_template": body["base_template"]},
               "status": "TEMPLATE_STATUS_READY", "created_at": NOW, "updated_at": NOW,
               "_source_oci_ref": body["source_oci_ref"]}
        self.templates[tid] = rec
        self.builds[tid] = []
        self._build(rec)
        return 200, {"template": self.template_view(rec)}

    def op_templates_update(self, params, query, body):
        rec = self.template(params["template_id"])
        body = body or {}
        if body.get("base_template"):
            rec["spec"] = {"base_template": body["base_template"]}
        if body.get("source_oci_ref"):
            rec["_source_oci_ref"] = body["source_oci_ref"]
        self._build(rec)
        return 200, {"template": self.template_view(rec)}

    def op_templates_get(self, params, query, body):
        return 200, {"template": self.template_view(self.template(params["template_id"]))}

    def op_templates_list(self, params, query, body):
        return self.page([self.template_view(t, listed=True) for t in self.templates.values()], "templates", query)

    def op_templates_delete(self, params, query, body):
        rec = self.template(params["template_id"])
        del self.templates[rec["template_id"]]
        return 200, {"template_id": rec["template_id"], "deleted": True}

    def op_templates_list_builds(self, params, query, body):
        rec = self.template(params["template_id"])
        builds = [self.build_view(b, listed=True) for b in reversed(self.builds[rec["template_id"]])]
        return self.page(builds, "builds", query)

    def op_templates_get_build(self, params, query, body):
        rec = self.template(params["template_id"])
        for b in self.builds[rec["template_id"]]:
            if b["build_id"] == params["build_id"]:
                return 200, {"build": self.build_view(b)}
        raise Refusal(404, "not_found", "build %s not found" % params["build_id"])


class ReplayServer:
    """The replay platform behind a real HTTP server on 127.0.0.1; `env` points the collection at it."""

    def __init__(self, platform: Optional[ReplayPlatform] = None, token: str = TOKEN):
        self.platform = platform or ReplayPlatform()
        self.token = token
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args):
                pass

            def _serve(self):
                split = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    if headers.get("authorization") != "Bearer " + owner.token:
                        raise Refusal(401, "unauthorized", "Unable to authenticate you")
                    if not any(split.path.startswith(p + "/") for p in PREFIXES):
                        raise Refusal(404, "not_found", "no such route %s" % split.path, True)
                    status, body = owner.platform.handle(self.command, split.path, dict(parse_qsl(split.query)),
                                                         headers, raw)
                except Refusal as e:
                    if e.undocumented:
                        owner.platform.undocumented.append("%s %s: %s" % (self.command, self.path, e.message))
                    status, body = e.status, {"id": e.ident, "message": e.message, "request_id": str(uuid.uuid4())}
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                for k, v in RATE_HEADERS.items():
                    self.send_header(k, v)
                if data:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.httpd.server_address[1]

    @property
    def env(self) -> Dict[str, str]:
        return {"DO_AGENTS_API_URL": self.url, "DO_AGENTS_API_TOKEN": self.token}

    def __enter__(self) -> "ReplayServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
