"""The session lifecycle: create, boot, pause, resume, delete, idle pause and adoption after a restart.

Transitions of one session are serialized by a per-session lock, so a delete
racing a boot or a pause racing a port-forward dial never sees half a change.
"""
import asyncio
import logging
import os
import time
import uuid

from . import agentarchive, contract
from .httputil import ApiFailure, now_rfc3339

log = logging.getLogger("microvm_localplane.sessions")

# The session object's documented fields (pydo get_session), every one always present: no template, size or
# error text, and never env or secrets. Fields about features the local plane lacks are reported empty.
PUBLIC_FIELDS = ("session_id", "name", "parent_session_id", "fork_id", "fork_from_checkpoint_id", "agent_kind",
                 "status", "sandbox_id", "created_at", "last_event_at", "keep_warm", "resume_on_topoff",
                 "pause_reason", "idle_timeout_seconds", "repo_hint", "warnings", "config_id", "openai_session_id",
                 "openai_environment_id", "region", "workspace_id")
_BOOL_FIELDS = frozenset(["keep_warm", "resume_on_topoff"])
_LIST_FIELDS = frozenset(["warnings"])
# A test hook: seconds every new session's boot waits before its guest starts (it stays PROVISIONING), so that a
# test can watch a slow first create (the progress the session module shows while it waits) without a slow host.
BOOT_DELAY_ENV = "MICROVM_LOCALPLANE_TEST_BOOT_DELAY"


def boot_delay():
    try:
        return max(0.0, float(os.environ.get(BOOT_DELAY_ENV) or 0))
    except ValueError:
        return 0.0


def guest_env(rec):
    """The sandbox's environment: env and secrets (secrets are readable inside the sandbox, never in the API)."""
    env = dict(rec.get("env") or {})
    env.update(rec.get("secrets") or {})
    return env


def hostname_for(name):
    h = "".join(c if c.isalnum() or c == "-" else "-" for c in name.lower()).strip("-")
    return (h or "sandbox")[:63]


def public_view(rec):
    """The session object exactly as the platform lists its fields (empty values where there is nothing)."""
    out = {}
    for key in PUBLIC_FIELDS:
        value = rec.get(key)
        if key == "status":
            value = contract.status_string(value)
        elif key == "pause_reason" and rec.get("status") != contract.PAUSED:
            value = ""
        elif key == "agent_kind":
            value = contract.agent_kind(rec.get("agent") or "custom")
        elif key == "region":
            value = contract.REGION
        elif key in _LIST_FIELDS:
            value = list(value or [])
        if value is None:
            value = False if key in _BOOL_FIELDS else (0 if key == "idle_timeout_seconds" else "")
        out[key] = value
    return out


class Activity:
    """Open port-forward connections and the time of the last traffic, per session (for the idle timeout)."""

    def __init__(self):
        self.connections = {}  # session_id -> set of connection objects with .kill(code, reason)
        self.last = {}

    def touch(self, session_id):
        self.last[session_id] = time.monotonic()

    def idle_for(self, session_id):
        if self.connections.get(session_id):
            return 0.0
        return time.monotonic() - self.last.get(session_id, time.monotonic())

    def add(self, session_id, conn):
        self.connections.setdefault(session_id, set()).add(conn)
        self.touch(session_id)

    def remove(self, session_id, conn):
        self.connections.get(session_id, set()).discard(conn)
        self.touch(session_id)

    def kill_all(self, session_id, reason):
        for conn in list(self.connections.get(session_id, ())):
            conn.kill(contract.CLOSE_SESSION_UNAVAILABLE, reason)


class Sessions:
    def __init__(self, store, guests, templates):
        self.store = store
        self.guests = guests
        self.templates = templates
        self.activity = Activity()
        self.locks = {}
        self.boots = {}       # session_id -> task booting/adopting its guest
        self.in_flight = {}   # session_id -> REST exec calls running (a "command turn")
        self.tasks = set()
        self.archive_limits = {}  # the plane's bounds for archive uploads (up/serve --archive-max-*); {} = defaults
        self.workspaces = None    # persistent workspaces (workspaces.Workspaces), set by the plane
        self.warm_pool = None     # pre-booted guests for keep_warm creates (warmpool.WarmPool), set by the plane
        self.warm_claims = set()  # sessions whose create took a pooled guest, until the create answers

    # -- helpers ----------------------------------------------------------
    def lock(self, session_id):
        return self.locks.setdefault(session_id, asyncio.Lock())

    def spawn(self, coro, name=None):
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def get(self, session_id):
        rec = self.store.sessions.get((session_id or "").lower())
        if rec is None:
            raise ApiFailure(404, "session %r not found" % (session_id or "")[:100])
        return rec

    def set_status(self, rec, status, **fields):
        rec["status"] = status
        if status != contract.PAUSED:
            rec["pause_reason"] = None
        rec.update(fields)
        rec["last_event_at"] = now_rfc3339()
        if status == contract.DESTROYED:
            rec["destroyed_at"] = time.time()
        self.store.save_session(rec)

    def live_with_name(self, name):
        low = name.lower()
        return [r for r in self.store.sessions.values() if r["status"] not in contract.GONE and r["name"].lower() == low]

    def listing(self, status=None, name=None, search=None):
        """Sessions for GET /sessions: no status (or UNSPECIFIED) hides DESTROYED and FAILED, ALL shows every one,
        any other status only those. `name` is exact (case-insensitive); `search` a case-insensitive substring of
        the name or the id (Decision: the docs name the parameter but not what it matches)."""
        recs = sorted(self.store.sessions.values(), key=lambda r: (r["created_at"], r["session_id"]))
        if not status or status == contract.FILTER_UNSPECIFIED:
            recs = [r for r in recs if r["status"] not in contract.HIDDEN_BY_DEFAULT]
        elif status != contract.FILTER_ALL:
            recs = [r for r in recs if r["status"] == status]
        if name:
            recs = [r for r in recs if r["name"].lower() == name.lower()]
        if search:
            low = search.lower()
            recs = [r for r in recs if low in r["name"].lower() or low in r["session_id"].lower()]
        return recs

    def rootfs_spec(self, rec):
        from .guests import RootfsSpec
        fs = rec["rootfs"]
        return RootfsSpec(kind=fs["kind"], path=fs.get("path"))

    # -- create and boot --------------------------------------------------
    def new_record(self, spec, parent_session_id="", fork_id="", fork_from_checkpoint_id="", resume_on_topoff=False):
        rootfs, warnings = self.templates.rootfs_for_session(spec["template"])
        if self.live_with_name(spec["name"]):
            raise ApiFailure(409, "a live session named %r already exists (names are unique, case-insensitively, "
                                  "among live sessions)" % spec["name"])
        now = now_rfc3339()
        rec = {
            "session_id": str(uuid.uuid4()), "name": spec["name"], "status": contract.PROVISIONING,
            "sandbox_id": None, "created_at": now, "last_event_at": now, "pause_reason": None,
            "idle_timeout_seconds": spec["idle_timeout_seconds"], "parent_session_id": parent_session_id,
            "fork_id": fork_id, "fork_from_checkpoint_id": fork_from_checkpoint_id, "agent": spec["agent"],
            # A YAML create persists an Environment Config first (harness-create-session): its id.
            "config_id": spec.get("config_id") or str(uuid.uuid4()),
            "workspace_id": "",  # set by create() (workspaces.py)
            "resume_on_topoff": bool(resume_on_topoff), "keep_warm": bool(spec.get("keep_warm")),
            "template": spec["template"], "size_slug": spec["size_slug"],
            "env": spec["env"], "secrets": spec.get("secrets") or {}, "egress": spec["egress"], "rootfs": rootfs,
            "permissions": spec.get("permissions") or {"default": contract.PERMISSION_DEFAULT, "rules": []},
            # The session object's documented `warnings`: kept, so every GET shows them, and where a FAILED
            # session says why (the object has no error text).
            "warnings": list(warnings),
        }
        return rec

    def admit(self, size_slug, count=1):
        """A quota of the local plane (409): the host must hold every new session's whole disk (disk.admit)."""
        from .disk import DiskCapacityError
        try:
            self.guests.admit([size_slug] * count)
        except DiskCapacityError as e:
            raise ApiFailure(409, str(e)) from e

    def create(self, spec, resume_on_topoff=False):
        """A session from a flat spec; a YAML create persists an Environment Config first (harness-create-session)."""
        rec = self.new_record(spec, resume_on_topoff=resume_on_topoff)
        self.admit(spec["size_slug"])
        wildcards = [h for h in (spec["egress"] or []) if h.startswith("*.")]
        if wildcards:
            # The guest runtime resolves allowed hosts to addresses once, at boot, and its DNS answers those names
            # only; a wildcard names nothing to resolve.
            rec["warnings"].append("egress wildcards are not supported by the local control plane and allow nothing: "
                                   "%s" % ", ".join(wildcards))
        member = self._warm_guest(rec, spec)
        seed = self._hold_workspace(rec, spec)
        if rec["config_id"] not in self.store.configs:
            config = dict(spec)
            config.pop("config_id", None)
            config.pop("workspace_id", None)
            self.store.save_config({"config_id": rec["config_id"], "spec": config, "created_at": rec["created_at"]})
        self.store.save_session(rec)
        if member is not None:
            self.boots[rec["session_id"]] = self.spawn(self._adopt_warm(rec, member))
            self.warm_claims.add(rec["session_id"])
        else:
            self.boots[rec["session_id"]] = self.spawn(self._boot(rec, clone_from=(None, seed) if seed else None))
        return rec

    def _warm_guest(self, rec: dict, spec: dict):
        """keep_warm: keep this template and size warm, and take a pre-booted guest when one fits the spec."""
        if self.warm_pool is None or not spec.get("keep_warm"):
            return None
        self.warm_pool.want(spec["template"], spec["size_slug"], rec["rootfs"])
        if not self.warm_pool.eligible(spec):
            return None
        member = self.warm_pool.claim(spec["template"], spec["size_slug"], rec["rootfs"])
        if member is not None:
            rec["session_id"] = member.session_id  # ids are the server's: the pooled guest's was made in advance
        return member

    async def settle_warm(self, rec: dict) -> None:
        """A create served from the pool answers once its guest is the session's (READY): milliseconds."""
        sid = rec["session_id"]
        if sid in self.warm_claims:
            self.warm_claims.discard(sid)
            task = self.boots.get(sid)
            if task is not None:
                try:
                    await asyncio.shield(task)
                except Exception:
                    pass

    async def _adopt_warm(self, rec: dict, member) -> bool:
        """A pooled guest becomes this session's sandbox: it takes the session's hostname, and it is READY."""
        sid = rec["session_id"]
        try:
            await self.warm_pool.adopt(member, hostname_for(rec["name"]))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("session %s: the warm guest could not be adopted: %s", sid, e)
            if rec["status"] not in (contract.DESTROYING, contract.DESTROYED):
                self.fail(rec, "the sandbox failed to boot: %s" % e)
                await self._quiet_destroy(sid)
            return False
        if rec["status"] in (contract.DESTROYING, contract.DESTROYED):
            return False
        self.activity.touch(sid)
        self.set_status(rec, contract.READY, sandbox_id=member.sandbox_id)
        return True

    def _hold_workspace(self, rec: dict, spec: dict):
        """The session's persistent workspace: the one named by workspace_id (attached now, 409 when another
        session holds it), or a new one for `persistent_workspace: true`. -> a saved copy to start from, or None."""
        if self.workspaces is None:
            if spec.get("persistent_workspace"):
                rec["workspace_id"] = str(uuid.uuid4())
            return None
        if spec.get("workspace_id"):
            ws = self.workspaces.attach(spec["workspace_id"], rec["session_id"])
            rec["workspace_id"] = ws["workspace_id"]
            return self.workspaces.saved_copy(ws["workspace_id"])
        if spec.get("persistent_workspace"):
            rec["workspace_id"] = self.workspaces.create_for_spec(rec["session_id"])["workspace_id"]
        return None

    def create_from_config(self, name, config_id, resume_on_topoff=False, workspace_id=""):
        """The JSON create form {name, config_id, workspace_id?}: the saved spec under a new name (resume_on_topoff
        is per session); a persistent workspace is attached only this way (How to Use Persistent Workspaces)."""
        return self.create(self.config_spec(name, config_id, workspace_id), resume_on_topoff=resume_on_topoff)

    def config_spec(self, name, config_id, workspace_id=""):
        """The spec a session from a saved Environment Config starts with (404 for an unknown or deleted config)."""
        config = self.store.configs.get(config_id.lower()) if isinstance(config_id, str) else None
        if config is None or config.get("deleted"):
            raise ApiFailure(404, "config %r not found: give the config_id of an Environment Config (a session "
                                  "created from a YAML spec reports the one made for it)" % config_id[:100])
        return dict(config["spec"], name=name, config_id=config["config_id"], workspace_id=workspace_id)

    def update(self, rec, doc):
        """PATCH of the session-scoped settings: today resume_on_topoff only (update_session)."""
        if not doc:
            raise ApiFailure(400, "the update body must set at least one of: %s" % ", ".join(
                sorted(contract.PATCH_SESSION_KEYS)))
        value = doc["resume_on_topoff"]
        if not isinstance(value, bool):
            raise ApiFailure(400, "resume_on_topoff must be true or false, got %s" % (contract.shown(value),))
        # Decision: the docs say terminal sessions cannot be patched, not with which status.
        if rec["status"] in (contract.DESTROYED, contract.FAILED):
            raise ApiFailure(409, "session %s is %s: a terminal session cannot be updated" % (
                rec["session_id"], contract.status_string(rec["status"])))
        rec["resume_on_topoff"] = value
        self.store.save_session(rec)
        return rec

    def fail(self, rec, reason):
        """FAILED, saying why in the session's warnings."""
        self.set_status(rec, contract.FAILED, warnings=list(rec.get("warnings") or []) + [reason])

    async def _boot(self, rec, adopt=False, clone_from=None):
        sid = rec["session_id"]
        sandbox_id = rec.get("sandbox_id") if adopt and rec.get("sandbox_id") else str(uuid.uuid4())
        try:
            if clone_from is not None:
                await self.guests.clone_state(clone_from[0], sid, clone_from[1])
            if not adopt and boot_delay():
                await asyncio.sleep(boot_delay())
            starter = self.guests.adopt if adopt else self.guests.boot
            await starter(sid, sandbox_id, self.rootfs_spec(rec), guest_env(rec), rec["egress"],
                          hostname_for(rec["name"]), size=rec.get("size_slug"))
            self.apply_agent_limits(sid)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("session %s failed to boot: %s", sid, e)
            if rec["status"] not in (contract.DESTROYING, contract.DESTROYED):
                self.fail(rec, "the sandbox failed to boot: %s" % e)
                if not adopt:
                    await self._quiet_destroy(sid)
                # An adopted session keeps its persistent state until it is deleted: nothing is lost
                # to a failed reboot.
            return False
        if rec["status"] in (contract.DESTROYING, contract.DESTROYED):
            return False
        self.activity.touch(sid)
        if adopt and rec["status"] == contract.PAUSED:
            guest = self.guests.get(sid)
            if guest is not None and not guest.frozen:
                guest.freeze()
            rec["sandbox_id"] = sandbox_id
            self.store.save_session(rec)
            return True
        self.set_status(rec, contract.READY, sandbox_id=sandbox_id)
        return True

    def apply_agent_limits(self, session_id):
        """Hand the plane's archive bounds to the guest's agent, through the guest's own run dir."""
        if not self.archive_limits:
            return
        try:
            agentarchive.write_limits(self.guests._layout(session_id).run, self.archive_limits)
        except OSError as e:
            log.warning("session %s: cannot hand the archive bounds to its agent: %s", session_id, e)

    async def wait_booted(self, session_id):
        """Wait for an adoption (after a restart) or a reboot still under way.

        A PROVISIONING session is not waited for: the platform refuses calls
        on it until it is usable, and so does the local plane.
        """
        rec = self.store.sessions.get(session_id)
        if rec is not None and rec["status"] == contract.PROVISIONING:
            return
        task = self.boots.get(session_id)
        if task is not None and not task.done():
            try:
                await asyncio.shield(task)
            except Exception:
                pass

    async def _quiet_destroy(self, session_id):
        try:
            await self.guests.destroy(session_id)
        except Exception as e:
            log.warning("destroying the guest of %s failed: %s", session_id, e)

    # -- delete -----------------------------------------------------------
    def delete(self, rec):
        if rec["status"] in (contract.DESTROYING, contract.DESTROYED):
            raise ApiFailure(404, "session %s is already %s" % (rec["session_id"], rec["status"].lower()))
        self.set_status(rec, contract.DESTROYING)
        self.activity.kill_all(rec["session_id"], "session deleted")
        self.spawn(self._destroy(rec), name=DESTROY_TASK + rec["session_id"])

    async def _destroy(self, rec):
        sid = rec["session_id"]
        task = self.boots.get(sid)
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass
        async with self.lock(sid):
            if self.workspaces is not None:
                # Removing a session saves its persistent workspace's files, never deletes them.
                if rec.get("sandbox_id"):
                    await self.workspaces.release(sid, self.guests)
                else:
                    self.workspaces.release_unbooted(sid)
            await self._quiet_destroy(sid)
            for cid in list(self.store.checkpoints.get(sid, {})):
                self.store.forget_checkpoint(sid, cid)
            self.set_status(rec, contract.DESTROYED)
        self.boots.pop(sid, None)

    # -- pause and resume ---------------------------------------------------
    async def pause(self, rec, reason=contract.PAUSE_MANUAL):
        await self.wait_booted(rec["session_id"])
        async with self.lock(rec["session_id"]):
            if rec["status"] not in contract.PAUSABLE:
                raise ApiFailure(409, "session %s is %s; only a READY or DETACHED session can be paused" % (
                    rec["session_id"], contract.status_string(rec["status"])))
            if reason == contract.PAUSE_IDLE and self.in_flight.get(rec["session_id"]):
                return
            guest = self.guests.get(rec["session_id"])
            self.activity.kill_all(rec["session_id"], "session paused")
            if guest is not None:
                guest.freeze()
            self.set_status(rec, contract.PAUSED, pause_reason=reason)

    async def resume(self, rec):
        await self.wait_booted(rec["session_id"])
        async with self.lock(rec["session_id"]):
            if rec["status"] != contract.PAUSED:
                raise ApiFailure(409, "session %s is %s; only a PAUSED session can be resumed" % (
                    rec["session_id"], contract.status_string(rec["status"])))
            self._thaw(rec)

    def _thaw(self, rec):
        guest = self.guests.get(rec["session_id"])
        if guest is None:
            raise ApiFailure(502, "the sandbox of session %s is not running" % rec["session_id"])
        guest.thaw()
        self.activity.touch(rec["session_id"])
        self.set_status(rec, contract.READY)

    async def usable_guest(self, rec, what="connect"):
        """The guest of a usable session, waking a PAUSED one (a dial or input resumes it)."""
        sid = rec["session_id"]
        if rec["status"] in contract.GONE:
            raise ApiFailure(410, "session %s is %s" % (sid, contract.status_string(rec["status"])))
        # A boot, or an adoption after a restart, may still be under way.
        await self.wait_booted(sid)
        async with self.lock(sid):
            if rec["status"] == contract.PAUSED:
                self._thaw(rec)
            if rec["status"] in contract.GONE:
                raise ApiFailure(410, "session %s is %s" % (sid, contract.status_string(rec["status"])))
            if rec["status"] not in contract.USABLE:
                raise ApiFailure(409, "session %s is %s; cannot %s until it is READY" % (
                    sid, contract.status_string(rec["status"]), what))
            guest = self.guests.get(sid)
            if guest is None or not guest.alive():
                raise ApiFailure(502, "the sandbox of session %s is not running" % sid)
            self.activity.touch(sid)
            return guest

    # -- background duties --------------------------------------------------
    async def idle_loop(self, interval=0.5):
        while True:
            await asyncio.sleep(interval)
            try:
                await self.idle_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("idle pass failed")

    async def idle_pass(self):
        now = time.time()
        for rec in list(self.store.sessions.values()):
            sid = rec["session_id"]
            if rec["status"] == contract.DESTROYED and now - rec.get("destroyed_at", now) > contract.DESTROYED_RETENTION_SECONDS:
                self.store.forget_session(sid)
                self.locks.pop(sid, None)
                self._forget_unused_config(rec.get("config_id"))
                continue
            if rec["status"] in contract.USABLE and self._guest_died(sid):
                # A guest that died under a usable session is booted again from its
                # persistent state (like a VM restart); if that fails the session is FAILED.
                log.warning("the guest of session %s stopped unexpectedly; booting it again", sid)
                self.boots[sid] = self.spawn(self._boot(rec, adopt=True))
                continue
            if rec["status"] in contract.USABLE and not self.in_flight.get(sid):
                if self.activity.idle_for(sid) >= rec["idle_timeout_seconds"]:
                    try:
                        await self.pause(rec, contract.PAUSE_IDLE)
                    except ApiFailure:
                        pass

    def _forget_unused_config(self, config_id):
        """Decision: a config the plane made for a YAML create lives as long as a session record refers to it."""
        named = (self.store.configs.get(config_id) or {}).get("name")  # a saved Environment Config stays (configs.py)
        if config_id and not named and not any(r.get("config_id") == config_id for r in self.store.sessions.values()):
            self.store.forget_config(config_id)

    def _guest_died(self, session_id):
        task = self.boots.get(session_id)
        if (task is not None and not task.done()) or self.lock(session_id).locked():
            return False
        guest = self.guests.get(session_id)
        return guest is None or not guest.alive()

    def adopt_all(self):
        """After a restart: reattach (or reboot from persistent state) every guest the state knows."""
        for rec in list(self.store.sessions.values()):
            sid = rec["session_id"]
            if rec["status"] == contract.DESTROYING:
                self.spawn(self._destroy(rec), name=DESTROY_TASK + sid)
            elif rec["status"] in (contract.PROVISIONING, contract.READY, contract.DETACHED, contract.PAUSED):
                self.boots[sid] = self.spawn(self._boot(rec, adopt=rec["status"] != contract.PROVISIONING))

    async def shutdown(self, stop_guests):
        # A delete already answered finishes first: cancelled half-way, it would leave the session's disk mounted
        # and its guest half-stopped with nobody left to clean up.
        destroying = [t for t in self.tasks if t.get_name().startswith(DESTROY_TASK)]
        if destroying:
            await asyncio.wait(destroying, timeout=DESTROY_GRACE)
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            try:
                await task
            except BaseException:
                pass
        await self.guests.shutdown(stop_guests)


DESTROY_TASK = "destroy:"   # the name of a session's destroy task, plus its id
DESTROY_GRACE = 60          # seconds a stopping plane gives the destroys in flight to finish


def guest_state_dir(state_dir):
    return os.path.join(state_dir, "guests")
