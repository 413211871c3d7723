"""The local control plane's HTTP server: the platform's REST API and port-forward under both prefixes."""
import asyncio
import hmac
import logging
import os
import time

from aiohttp import web

from . import agentrpc, baseimage, contract, dataplane, netns, portforward, transfers
from .checkpoints import Checkpoints
from .checkpoints import public_view as checkpoint_view
from .createspec import parse_config_form, parse_create
from .httputil import ApiFailure, check_id, error_response, paginate, query_bool, read_create, read_document
from .sessions import Sessions, guest_state_dir, public_view
from .store import Store
from .configs import CREATE_KEYS as CONFIG_CREATE_KEYS
from .configs import Configs
from .configs import list_view as config_list_view
from .configs import public_view as config_view
from .templates import Templates
from .warmpool import WarmPool
from .workspaces import CREATE_KEYS as WORKSPACE_CREATE_KEYS
from .workspaces import Workspaces
from .workspaces import public_view as workspace_view

log = logging.getLogger("microvm_localplane.server")


async def check_egress_resolves(hosts):
    """A create whose allowlist names a host that does not resolve is a 400 naming it (contract.py)."""
    if not hosts:
        return
    missing = await asyncio.to_thread(netns.unresolvable, hosts, contract.EGRESS_RESOLVE_TIMEOUT_SECONDS)
    if missing:
        raise ApiFailure(400, contract.egress_unresolvable_message(missing))


class Plane:
    """Everything one state dir holds: sessions, checkpoints, templates and their guests."""

    def __init__(self, state_dir, token, guests=None, archive_limits=None, disk_reserve=None, warm_pool=None):
        self.state_dir = os.path.abspath(state_dir)
        self.token = token
        self.store = Store(self.state_dir)
        if guests is None:
            from .guests import GuestManager
            guests = GuestManager(guest_state_dir(self.state_dir))
        if disk_reserve is not None:
            guests.disk_reserve = disk_reserve
        guests_dir = getattr(guests, "state_dir", None)
        self.templates = Templates(self.store, self._live_sessions_using,
                                   base_pending=lambda: baseimage.pending_note(guests_dir) if guests_dir else None)
        self.sessions = Sessions(self.store, guests, self.templates)
        self.sessions.archive_limits = dict(archive_limits or {})
        self.configs = Configs(self.store, self.sessions)
        self.workspaces = Workspaces(self.state_dir)
        self.sessions.workspaces = self.workspaces
        self.warm_pool = WarmPool(self.state_dir, guests, on_booted=self.sessions.apply_agent_limits,
                                  **(warm_pool or {}))
        self.sessions.warm_pool = self.warm_pool
        self.checkpoints = Checkpoints(self.store, self.sessions)
        self.idle_task = None

    def _live_sessions_using(self, template_name):
        low = template_name.lower()
        return sum(1 for r in self.store.sessions.values()
                   if r["status"] not in (contract.DESTROYED, contract.FAILED) and r["template"].lower() == low)

    async def start(self):
        self.sessions.adopt_all()
        self.templates.resume_interrupted()
        self.workspaces.resume_interrupted()
        self.warm_pool.start()
        self.idle_task = asyncio.get_running_loop().create_task(self.sessions.idle_loop())

    async def stop(self, stop_guests=True):
        if self.idle_task:
            self.idle_task.cancel()
        for sid in list(self.sessions.activity.connections):
            self.sessions.activity.kill_all(sid, "the control plane is stopping")
        for task in list(self.templates.tasks):
            task.cancel()
        await self.warm_pool.shutdown()
        await self.sessions.shutdown(stop_guests)
        agentrpc.cleanup_sockets()


# -- middlewares ------------------------------------------------------------------
def bearer_credentials(header):
    """The credentials of an `Authorization: Bearer <token>` header, else None.

    The scheme is case-insensitive and followed by one or more spaces (RFC 7235, section 2.1).
    """
    scheme, sep, rest = header.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    return rest.lstrip(" ")


def auth_middleware(plane):
    expected = plane.token.encode()

    @web.middleware
    async def check_token(request, handler):
        if request.match_info.route.name in transfers.SPACES_ROUTES:
            return await handler(request)  # the object store's presigned URLs carry their own signature
        given = bearer_credentials(request.headers.get("Authorization", ""))
        # Constant-time comparison; the token is never logged.
        if not given or not hmac.compare_digest(given.encode("utf-8", "replace"), expected):
            return error_response(401, "missing or invalid bearer token: send Authorization: Bearer <token>")
        return await handler(request)

    return check_token


# Every answer carries the DigitalOcean API's rate-limit headers. Decision: the local plane has no quota; it
# reports a constant full one that resets in an hour.
RATE_LIMIT = 5000


@web.middleware
async def ratelimit_middleware(request, handler):
    response = await handler(request)
    if not response.prepared:
        response.headers["ratelimit-limit"] = str(RATE_LIMIT)
        response.headers["ratelimit-remaining"] = str(RATE_LIMIT)
        response.headers["ratelimit-reset"] = str(int(time.time()) + 3600)
    return response


@web.middleware
async def error_middleware(request, handler):
    try:
        return await handler(request)
    except ApiFailure as e:
        return error_response(e.status, e.message)
    except web.HTTPException as e:
        if e.status >= 400:
            reason = {404: "no such route: %s %s" % (request.method, request.path),
                      405: "method %s is not allowed on %s" % (request.method, request.path)}.get(e.status, e.reason)
            return error_response(e.status, reason)
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal error: %s" % type(e).__name__)


# -- handlers ---------------------------------------------------------------------
class Routes:
    def __init__(self, plane):
        self.plane = plane
        self.sessions = plane.sessions
        self.data = dataplane.DataPlane(self)  # exec as events, interactive stdin, the team's switches
        self.transfers = transfers.StagedTransfers(self)  # staged (object-storage-backed) workspace transfers

    def session(self, request):
        return self.sessions.get(check_id(request.match_info["sid"], "session"))

    # sessions
    async def create_session(self, request):
        # Two exclusive forms chosen by Content-Type (harness-create-session): the YAML spec, or JSON {name, config_id}.
        # Documented keys the local plane cannot honour pass the strict decoding and are refused by name in parse_create.
        form, doc = await read_create(request, contract.CREATE_KEYS | contract.DOCUMENTED_UNSUPPORTED_KEYS)
        # resume_on_topoff is a query parameter of both forms, per session.
        resume_on_topoff = query_bool(request, "resume_on_topoff")
        if form == "config":
            workspace_id = doc.get("workspace_id") or ""
            if not isinstance(workspace_id, str):
                raise ApiFailure(400, "workspace_id must be the id of a persistent workspace (a string), got %r"
                                 % (workspace_id,))
            spec = self.sessions.config_spec(*parse_config_form(doc), workspace_id=workspace_id)
        else:
            spec = parse_create(doc, contract.prefix_of(request.path))
        await check_egress_resolves(spec.get("egress"))
        rec = self.sessions.create(spec, resume_on_topoff=resume_on_topoff)
        await self.sessions.settle_warm(rec)
        return web.json_response({"session": public_view(rec)}, status=201)

    async def update_session(self, request):
        rec = self.session(request)
        doc = await read_document(request, contract.PATCH_SESSION_KEYS, "session update")
        return web.json_response({"session": public_view(self.sessions.update(rec, doc))})

    async def list_sessions(self, request):
        status = request.query.get("status", "")
        short = None
        if status:
            short = contract.parse_status_filter(status)
            if short is None:
                raise ApiFailure(400, "unknown status filter %r: use one of %s" % (status, ", ".join(
                    contract.status_string(s) for s in contract.STATUSES + (contract.FILTER_UNSPECIFIED,
                                                                            contract.FILTER_ALL))))
        name = request.query.get("name", "")
        search = request.query.get("search", "")
        recs = self.sessions.listing(short, name, search)
        scope = "sessions|%s|%s|%s" % (short or "", name.lower(), search.lower())
        page = paginate(request, recs, "sessions", scope)
        page["sessions"] = [public_view(r) for r in page["sessions"]]
        return web.json_response(page)

    async def list_sizes(self, request):
        # Static, not paginated, smallest first (list_session_sandbox_sizes).
        return web.json_response({"sizes": [dict(s) for s in contract.SIZES]})

    async def get_session(self, request):
        return web.json_response({"session": public_view(self.session(request))})

    async def delete_session(self, request):
        self.sessions.delete(self.session(request))
        return web.Response(status=204)

    async def pause(self, request):
        rec = self.session(request)
        await read_document(request, frozenset(), "pause", required_type=False)
        await self.sessions.pause(rec)
        return web.Response(status=204)

    async def resume(self, request):
        rec = self.session(request)
        await read_document(request, frozenset(), "resume", required_type=False)
        await self.sessions.resume(rec)
        return web.Response(status=204)

    async def fork(self, request):
        rec = self.session(request)
        doc = await read_document(request, contract.FORK_KEYS, "fork")
        children = await self.plane.checkpoints.fork(rec, doc)
        return web.json_response({"sessions": [public_view(c) for c in children]})

    # checkpoints
    async def create_checkpoint(self, request):
        rec = self.session(request)
        doc = await read_document(request, contract.CHECKPOINT_KEYS, "checkpoint")
        cp = await self.plane.checkpoints.create(rec, doc)
        return web.json_response({"checkpoint": checkpoint_view(cp)})

    async def list_checkpoints(self, request):
        rec = self.session(request)
        page = paginate(request, self.plane.checkpoints.listing(rec["session_id"]), "checkpoints",
                        "checkpoints|" + rec["session_id"])
        page["checkpoints"] = [checkpoint_view(c) for c in page["checkpoints"]]
        return web.json_response(page)

    async def get_checkpoint(self, request):
        rec = self.session(request)
        cid = check_id(request.match_info["cid"], "checkpoint")
        return web.json_response({"checkpoint": checkpoint_view(self.plane.checkpoints.get(rec["session_id"], cid))})

    async def delete_checkpoint(self, request):
        rec = self.session(request)
        self.plane.checkpoints.delete(rec["session_id"], request.match_info["cid"])
        return web.Response(status=204)

    async def rollback(self, request):
        rec = self.session(request)
        cid = check_id(request.match_info["cid"], "checkpoint")
        await read_document(request, frozenset(), "rollback", required_type=False)
        rec = await self.plane.checkpoints.rollback(rec, cid)
        return web.json_response({"session": public_view(rec)})

    # sandbox I/O through the agent
    async def exec_(self, request):
        return await self.data.exec_(request)  # buffered JSON, or Server-Sent Events (dataplane.py)

    async def upload(self, request):
        rec = self.session(request)
        return await self._with_guest(rec, "upload", lambda guest: agentrpc.upload(guest, request), json_result=True)

    async def download(self, request):
        rec = self.session(request)

        async def start_response():
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/octet-stream"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            return resp

        return await self._with_guest(rec, "download", lambda guest: agentrpc.download(guest, request, start_response))

    async def _with_guest(self, rec, what, call, json_result=False):
        sid = rec["session_id"]
        guest = await self.sessions.usable_guest(rec, what)
        self.sessions.in_flight[sid] = self.sessions.in_flight.get(sid, 0) + 1
        try:
            result = await call(guest)
        finally:
            self.sessions.in_flight[sid] -= 1
            self.sessions.activity.touch(sid)
        return web.json_response(result) if json_result else result

    async def port_forward(self, request):
        sid = check_id(request.match_info["sid"], "session")
        self.sessions.get(sid)  # an unknown session is a 404 before any port question
        self.data.check_port(request.match_info["port"])
        return await portforward.handle(request, self.sessions, sid, request.match_info["port"])

    # templates
    def template(self, request):
        return self.plane.templates.get(check_id(request.match_info["tid"], "template"))

    async def create_template(self, request):
        doc = await read_document(request, contract.TEMPLATE_CREATE_KEYS, "template create")
        rec = self.plane.templates.create(doc)
        return web.json_response({"template": self.plane.templates.public_view(rec)}, status=201)

    async def update_template(self, request):
        rec = self.template(request)
        doc = await read_document(request, contract.TEMPLATE_UPDATE_KEYS, "template update")
        rec = self.plane.templates.update(rec, doc)
        return web.json_response({"template": self.plane.templates.public_view(rec)})

    async def list_templates(self, request):
        page = paginate(request, self.plane.templates.listing(), "templates", "templates")
        # List items carry no spec (pydo list_templates): only get, create and update replies do.
        page["templates"] = [self.plane.templates.public_view(t, listed=True) for t in page["templates"]]
        return web.json_response(page)

    async def get_template(self, request):
        return web.json_response({"template": self.plane.templates.public_view(self.template(request))})

    async def delete_template(self, request):
        rec = self.template(request)
        self.plane.templates.delete(rec)
        return web.json_response({"template_id": rec["template_id"], "deleted": True})

    async def list_builds(self, request):
        rec = self.template(request)
        builds = list(reversed(rec.get("builds", [])))
        page = paginate(request, builds, "builds", "builds|" + rec["template_id"])
        page["builds"] = [self.plane.templates.build_view(rec, b, listed=True) for b in page["builds"]]
        return web.json_response(page)

    async def get_build(self, request):
        rec = self.template(request)
        bid = check_id(request.match_info["bid"], "build")
        for build in rec.get("builds", []):
            if build["build_id"] == bid:
                # Wrapped, as pydo get_template_build shows.
                return web.json_response({"build": self.plane.templates.build_view(rec, build)})
        raise ApiFailure(404, "build %r of template %s not found" % (bid, rec["template_id"]))

    # Environment Configs (How to Use Environment Configs; pydo create_config; doctl harness-runtime config)
    def config(self, request):
        return self.plane.configs.get(check_id(request.match_info["cfg"], "config"))

    async def create_config(self, request):
        doc = await read_document(request, CONFIG_CREATE_KEYS, "config create")
        return web.json_response({"config": config_view(self.plane.configs.create(doc, contract.prefix_of(request.path)))},
                                 status=201)

    async def list_configs(self, request):
        search = request.query.get("search", "")
        raw = request.query.get("page_size", "")
        if raw.isdigit() and int(raw) > contract.MAX_PAGE_SIZE:
            # list_configs: "Values above 200 are rejected" (other lists clamp: a local decision).
            raise ApiFailure(400, "page_size %s is above %d" % (raw, contract.MAX_PAGE_SIZE))
        page = paginate(request, self.plane.configs.listing(search), "configs", "configs|" + search.lower())
        page["configs"] = [config_list_view(c) for c in page["configs"]]
        return web.json_response(page)

    async def get_config(self, request):
        return web.json_response({"config": config_view(self.config(request))})

    async def delete_config(self, request):
        self.plane.configs.delete(self.config(request))
        return web.Response(status=204)

    # persistent workspaces (How to Use Persistent Workspaces; doctl harness-runtime workspace)
    def workspace(self, request):
        return self.plane.workspaces.get(check_id(request.match_info["wid"], "workspace"))

    async def create_workspace(self, request):
        doc = await read_document(request, WORKSPACE_CREATE_KEYS, "workspace create")
        rec, created = self.plane.workspaces.create(doc)
        return web.json_response({"workspace": workspace_view(rec)}, status=201 if created else 200)

    async def list_workspaces(self, request):
        state = request.query.get("state", "")
        recs = self.plane.workspaces.listing(state)
        page = paginate(request, recs, "workspaces", "workspaces|" + state)
        page["workspaces"] = [workspace_view(w) for w in page["workspaces"]]
        return web.json_response(page)

    async def get_workspace(self, request):
        return web.json_response({"workspace": workspace_view(self.workspace(request))})

    async def delete_workspace(self, request):
        self.plane.workspaces.delete(self.workspace(request))
        return web.Response(status=204)


def add_routes(app, routes):
    s = "/sessions/{sid}"
    table = [
        ("POST", "/sessions", routes.create_session),
        ("GET", "/sessions", routes.list_sessions),
        ("GET", contract.SIZES_PATH, routes.list_sizes),
        ("GET", s, routes.get_session),
        ("PATCH", s, routes.update_session),
        ("DELETE", s, routes.delete_session),
        ("POST", s + "/pause", routes.pause),
        ("POST", s + "/resume", routes.resume),
        ("POST", s + "/fork", routes.fork),
        ("POST", s + "/checkpoints", routes.create_checkpoint),
        ("GET", s + "/checkpoints", routes.list_checkpoints),
        ("GET", s + "/checkpoints/{cid}", routes.get_checkpoint),
        ("DELETE", s + "/checkpoints/{cid}", routes.delete_checkpoint),
        ("POST", s + "/checkpoints/{cid}/rollback", routes.rollback),
        ("POST", s + "/sandbox/exec", routes.exec_),
        ("POST", s + "/sandbox/exec/{eid}/stdin", routes.data.write_stdin),
        ("POST", s + "/workspace/upload", routes.upload),
        ("GET", s + "/workspace/download", routes.download),
        ("GET", s + "/port-forward/{port}", routes.port_forward),
        ("POST", "/templates", routes.create_template),
        ("GET", "/templates", routes.list_templates),
        ("GET", "/templates/{tid}", routes.get_template),
        ("PUT", "/templates/{tid}", routes.update_template),
        ("DELETE", "/templates/{tid}", routes.delete_template),
        ("GET", "/templates/{tid}/builds", routes.list_builds),
        ("GET", "/templates/{tid}/builds/{bid}", routes.get_build),
        ("POST", "/configs", routes.create_config),
        ("GET", "/configs", routes.list_configs),
        ("GET", "/configs/{cfg}", routes.get_config),
        ("DELETE", "/configs/{cfg}", routes.delete_config),
        ("POST", "/workspaces", routes.create_workspace),
        ("GET", "/workspaces", routes.list_workspaces),
        ("GET", "/workspaces/{wid}", routes.get_workspace),
        ("DELETE", "/workspaces/{wid}", routes.delete_workspace),
    ]
    table += transfers.add_routes(app, routes.transfers, s)
    for prefix in contract.PREFIXES:
        for method, path, handler in table:
            app.router.add_route(method, prefix + path, handler)


def make_app(plane):
    # Uploads stream up to 500 MiB; every other body is capped at 1 MiB by read_limited.
    app = web.Application(middlewares=[ratelimit_middleware, error_middleware, auth_middleware(plane)],
                          client_max_size=contract.MAX_UPLOAD_BYTES + 1)
    add_routes(app, Routes(plane))

    async def on_startup(_app):
        await plane.start()

    app.on_startup.append(on_startup)
    return app
