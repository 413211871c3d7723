"""An in-memory stand-in for the control plane's REST routes, for unit tests of one layer.

`FakeClient` is the real ApiClient with only its HTTP transport replaced, so the
client's lookups, waits and pagination run for real. The fake answers like the
contract says (statuses, 404/409, error bodies); the integration tests check the
real stack.
"""
import copy
import itertools
import uuid

import yaml

from ansible_collections.microvm.sandbox.plugins.module_utils import rest

STATUS = "SESSION_STATUS_"
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")


class FakePlane(object):
    def __init__(self, page_size=2):
        self.sessions = {}
        self.checkpoints = {}  # session_id -> [checkpoint, ...] newest first
        self.staged = {}  # session_id -> credential directories the credentials role's manifest lists
        self.execs = []  # (session_id, argv) of every buffered exec
        self.templates = {}
        self.builds = {}
        self.calls = []
        self.content_types = []  # (method, path, content type of the body sent, or None)
        self.page_size = page_size  # small, so pagination is exercised
        self.fail_next = []  # (method, path-prefix, status, message) answered once
        # (method, path-suffix[, status]): the work is done, but the answer is lost once (status 0), or replaced
        # by a gateway's error (a 502 or 504 from the edge).
        self.unanswered = []
        self.sizes = [{"slug": "mars-2vcpu-4gb", "vcpus": 2, "memory_mb": 4096}]
        self.build_outcome = ("SUCCEEDED", "")
        self.clock = itertools.count(1)

    # -- helpers for tests --------------------------------------------------
    def add_session(self, name, status="READY", **fields):
        sid = str(uuid.uuid4())
        # The documented session object: no template, size or error text.
        rec = dict(session_id=sid, name=name, status=STATUS + status, sandbox_id="sbx-" + sid[:8],
                   agent_kind="AGENT_KIND_CUSTOM", idle_timeout_seconds=600, parent_session_id="", fork_id="",
                   fork_from_checkpoint_id="", keep_warm=False, resume_on_topoff=False, pause_reason="", warnings=[],
                   region="local", workspace_id="",
                   created_at="2026-01-01T00:00:%02dZ" % next(self.clock))
        rec.update(fields)
        self.sessions[sid] = rec
        self.checkpoints[sid] = []
        return rec

    def mutating_calls(self):
        return [c for c in self.calls if c[0] != "GET" and not c[1].endswith("/sandbox/exec")]  # the exec only reads

    # -- the routes -----------------------------------------------------------
    def handle(self, method, path, body, query):
        self.calls.append((method, path))
        for i, (m, prefix, status, message) in enumerate(self.fail_next):
            if m == method and path.startswith(prefix):
                del self.fail_next[i]
                raise rest.ApiError(method, path, status, message)
        parts = [p for p in path.split("/") if p]
        # /sessions/<id>/checkpoints/<cid>/rollback -> _post_sessions_x_checkpoints_x_rollback
        if parts[:3] == ["sessions", "sandbox", "sizes"]:
            return {"sizes": list(self.sizes)}
        route = getattr(self, "_" + "_".join([method.lower()] + [p if i % 2 == 0 else "x" for i, p in enumerate(parts)]))
        answer = route(parts, body or {}, query or {})
        for i, entry in enumerate(self.unanswered):
            m, suffix, status = (tuple(entry) + (0,))[:3]
            if m == method and path.endswith(suffix):
                del self.unanswered[i]
                raise rest.ApiError(method, path, status, "upstream request timeout" if status else
                                    "cannot reach the plane: timed out")
        return answer

    def _err(self, method, status, message, path="-"):
        return rest.ApiError(method, path, status, message)

    def _page(self, items, key, query):
        start = int(query.get("page_token") or 0)
        page = items[start:start + self.page_size]
        nxt = start + self.page_size
        return {key: page, "next_page_token": str(nxt) if nxt < len(items) else ""}

    def _session(self, sid):
        rec = self.sessions.get(sid)
        if rec is None:
            raise self._err("GET", 404, "session %r not found" % sid)
        return rec

    # sessions
    def _post_sessions(self, parts, body, query):
        name = body["name"]
        if any(s["name"].lower() == name.lower() and not s["status"].endswith(("DESTROYED", "DESTROYING", "FAILED"))
               for s in self.sessions.values()):
            raise self._err("POST", 409, "a live session named %r already exists" % name)
        idle = int(body.get("idle_timeout", "600s").rstrip("s"))
        agent = body.get("agent", "custom")
        rec = self.add_session(name, status="PROVISIONING", idle_timeout_seconds=idle,
                               agent_kind="AGENT_KIND_" + agent.upper().replace("-", "_"),
                               workspace_id=str(uuid.uuid4()) if body.get("persistent_workspace") else "")
        rec["resume_on_topoff"] = query.get("resume_on_topoff") == "true"
        rec["_repos"] = body.get("repos")
        rec["_env"] = body.get("env")
        rec["_secrets"] = body.get("secrets")
        rec["_egress"] = body.get("egress")
        rec["_template"] = body.get("template")
        rec["_size"] = body.get("size")
        return {"session": self._public(rec)}

    def _patch_sessions_x(self, parts, body, query):
        rec = self._session(parts[1])
        if set(body) != {"resume_on_topoff"}:
            raise self._err("PATCH", 400, "the body must set resume_on_topoff, and only it")
        if rec["status"].endswith(("DESTROYED", "FAILED")):
            raise self._err("PATCH", 409, "a terminal session cannot be patched")
        rec["resume_on_topoff"] = bool(body["resume_on_topoff"])
        return {"session": self._public(rec)}

    def _get_sessions(self, parts, body, query):
        # pydo list_sessions: no status (or UNSPECIFIED) hides DESTROYED and FAILED; ALL lists every session.
        items = sorted(self.sessions.values(), key=lambda s: s["created_at"])
        status = query.get("status") or STATUS + "UNSPECIFIED"
        if status == STATUS + "UNSPECIFIED":
            items = [s for s in items if not s["status"].endswith(("DESTROYED", "FAILED"))]
        elif status != STATUS + "ALL":
            items = [s for s in items if s["status"] == status]
        if query.get("name"):
            items = [s for s in items if s["name"].lower() == query["name"].lower()]
        if query.get("search"):
            items = [s for s in items if query["search"].lower() in s["name"].lower()]
        return self._page([self._public(s) for s in items], "sessions", query)

    def _public(self, rec):
        return dict((k, v) for k, v in rec.items() if not k.startswith("_"))

    def _get_sessions_x(self, parts, body, query):
        rec = self._session(parts[1])
        # Time passes between polls: provisioning finishes, deleting ends.
        if rec["status"] == STATUS + "PROVISIONING":
            rec["status"] = STATUS + "READY"
            return {"session": dict(self._public(rec), status=STATUS + "PROVISIONING")}
        if rec["status"] == STATUS + "DESTROYING":
            rec["status"] = STATUS + "DESTROYED"
        return {"session": self._public(rec)}

    def _delete_sessions_x(self, parts, body, query):
        rec = self._session(parts[1])
        rec["status"] = STATUS + "DESTROYING"
        return {}

    def _post_sessions_x_pause(self, parts, body, query):
        rec = self._session(parts[1])
        if rec["status"] not in (STATUS + "READY", STATUS + "DETACHED"):
            raise self._err("POST", 409, "session %s is %s; only a READY or DETACHED session can be paused"
                            % (rec["session_id"], rec["status"]), path="/sessions/%s/pause" % rec["session_id"])
        rec.update(status=STATUS + "PAUSED", pause_reason="manual")
        return {}

    def _post_sessions_x_resume(self, parts, body, query):
        rec = self._session(parts[1])
        if rec["status"] != STATUS + "PAUSED":
            raise self._err("POST", 409, "session %s is %s; only a PAUSED session can be resumed"
                            % (rec["session_id"], rec["status"]))
        rec["status"] = STATUS + "READY"
        rec["pause_reason"] = ""
        return {}

    def _post_sessions_x_sandbox_x(self, parts, body, query):
        """POST /sessions/<id>/sandbox/exec: only the manifest listing the modules send is answered."""
        assert parts[3] == "exec", parts
        self._session(parts[1])
        self.execs.append((parts[1], body["argv"]))
        listing = "".join("staged %s\n" % d for d in self.staged.get(parts[1], []))
        return {"exit_code": 0, "stdout": listing, "stderr": "", "duration_ms": 1}

    def _post_sessions_x_fork(self, parts, body, query):
        parent = self._session(parts[1])
        cid = body.get("from_checkpoint_id") or self._post_sessions_x_checkpoints(parts, {}, {})["checkpoint"]["checkpoint_id"]
        fork_id = str(uuid.uuid4())
        children = [self.add_session("%s-fork-%d" % (parent["name"], i + 1), parent_session_id=parent["session_id"],
                                     fork_id=fork_id, fork_from_checkpoint_id=cid)
                    for i in range(int(body.get("count", 1)))]
        return {"sessions": [self._public(c) for c in children]}

    # checkpoints
    def _post_sessions_x_checkpoints(self, parts, body, query):
        rec = self._session(parts[1])
        cp = dict(checkpoint_id=str(uuid.uuid4()), session_id=rec["session_id"], status="READY",
                  label=body.get("label", ""), size_bytes=1024, created_at="t%d" % next(self.clock), error_message="")
        self.checkpoints[rec["session_id"]].insert(0, cp)
        return {"checkpoint": cp}

    def _get_sessions_x_checkpoints(self, parts, body, query):
        self._session(parts[1])
        return self._page(self.checkpoints[parts[1]], "checkpoints", query)

    def _find_cp(self, sid, cid):
        for cp in self.checkpoints.get(sid, []):
            if cp["checkpoint_id"] == cid:
                return cp
        raise self._err("GET", 404, "checkpoint %r not found" % cid)

    def _get_sessions_x_checkpoints_x(self, parts, body, query):
        return {"checkpoint": self._find_cp(parts[1], parts[3])}

    def _delete_sessions_x_checkpoints_x(self, parts, body, query):
        self.checkpoints[parts[1]] = [c for c in self.checkpoints.get(parts[1], []) if c["checkpoint_id"] != parts[3]]
        return {}

    def _post_sessions_x_checkpoints_x_rollback(self, parts, body, query):
        rec = self._session(parts[1])
        self._find_cp(parts[1], parts[3])
        rec.update(status=STATUS + "PROVISIONING", sandbox_id="sbx-" + uuid.uuid4().hex[:8])
        return {"session": self._public(rec)}

    # templates
    def _template_view(self, t):
        return copy.deepcopy(dict((k, v) for k, v in t.items() if k != "_source"))

    def _post_templates(self, parts, body, query):
        if any(t["name"] == body["name"] for t in self.templates.values()):
            raise self._err("POST", 409, "a template named %r already exists" % body["name"])
        tid = str(uuid.uuid4())
        if not body.get("base_template"):
            raise self._err("POST", 400, "base_template is required")
        t = dict(template_id=tid, name=body["name"], status="TEMPLATE_STATUS_PENDING",
                 spec={"base_template": body["base_template"]}, _source=body["source_oci_ref"])
        self.templates[tid] = t
        self.builds[tid] = []
        self._build(t)
        return {"template": self._template_view(t)}

    def _build(self, t):
        status, error = self.build_outcome
        self.builds[t["template_id"]].append(dict(build_id=str(uuid.uuid4()), status=status, error=error,
                                                  created_at="t%03d" % next(self.clock)))
        if status == "SUCCEEDED":
            t["status"] = "TEMPLATE_STATUS_READY"
        else:
            t["status"] = "TEMPLATE_STATUS_FAILED"

    def _get_templates(self, parts, body, query):
        # List items carry no spec (pydo list_templates).
        items = [dict((k, v) for k, v in self._template_view(t).items() if k != "spec") for t in self.templates.values()]
        return self._page(items, "templates", query)

    def _template(self, tid):
        if tid not in self.templates:
            raise self._err("GET", 404, "template %r not found" % tid)
        return self.templates[tid]

    def _get_templates_x(self, parts, body, query):
        return {"template": self._template_view(self._template(parts[1]))}

    def _put_templates_x(self, parts, body, query):
        t = self._template(parts[1])
        if body.get("source_oci_ref"):
            t["_source"] = body["source_oci_ref"]
        if body.get("base_template"):
            t["spec"]["base_template"] = body["base_template"]
        self._build(t)
        return {"template": self._template_view(t)}

    def _delete_templates_x(self, parts, body, query):
        t = self.templates.pop(self._template(parts[1])["template_id"])
        return {"template_id": t["template_id"], "deleted": True}

    def _get_templates_x_builds(self, parts, body, query):
        return self._page(self.builds[self._template(parts[1])["template_id"]], "builds", query)


class FakeClient(rest.ApiClient):
    """The real client; only the HTTP transport is the fake plane."""

    plane = None

    def __init__(self, *args, **kwargs):
        super(FakeClient, self).__init__(*args, **kwargs)
        self._sleep = lambda seconds: None

    def request(self, method, path, body=None, query=None, content_type="application/json",
                raw=None, what=None, retry=None, expect_json=True, ident=None, timeout=None):
        if raw is not None and content_type in YAML_TYPES:
            body = yaml.safe_load(raw.decode("utf-8"))  # the flat spec travels as YAML, like on the wire
        self.plane.content_types.append((method, path, content_type if (raw is not None or body is not None) else None))
        try:
            return self.plane.handle(method, path, body, query)
        except rest.ApiError as e:
            # Re-raise as the real client would, with the route and the object named.
            raise rest.ApiError(method, path, e.status, e.server_message,
                                rest.hint_for(e.status, what, ident), what=what, ident=ident) from e
