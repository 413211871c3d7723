"""Checkpoints, rollback and fork of a session."""
import asyncio
import logging
import shutil
import uuid

from . import contract
from .httputil import ApiFailure, now_rfc3339
from .sessions import guest_env, hostname_for

log = logging.getLogger("microvm_localplane.checkpoints")
SNAPSHOT_STATES = frozenset([contract.READY, contract.DETACHED, contract.PAUSED])


def public_view(rec):
    out = {k: rec.get(k) for k in ("checkpoint_id", "session_id", "status", "kind", "label", "event_id",
                                   "size_bytes", "created_at", "error_message")}
    # Records taken before kind and event_id were kept read as explicit checkpoints with no event.
    out["kind"] = out["kind"] or contract.CHECKPOINT_KIND_EXPLICIT
    out["event_id"] = out["event_id"] or ""
    return out


class Checkpoints:
    def __init__(self, store, sessions):
        self.store = store
        self.sessions = sessions
        self.guests = sessions.guests

    def listing(self, session_id):
        recs = self.store.checkpoints.get(session_id, {}).values()
        return sorted(recs, key=lambda r: (r["created_at"], r["checkpoint_id"]), reverse=True)

    def get(self, session_id, checkpoint_id):
        rec = self.store.checkpoints.get(session_id, {}).get((checkpoint_id or "").lower())
        if rec is None:
            raise ApiFailure(404, "checkpoint %r of session %s not found" % ((checkpoint_id or "")[:100], session_id))
        return rec

    @staticmethod
    def _refuse_with_workspace(session, what):
        # doctl harness-runtime workspace: "Fork and rollback are not available for a session that has a workspace."
        if session.get("workspace_id"):
            raise ApiFailure(409, "session %s has a persistent workspace (%s): %s is not available for it" % (
                session["session_id"], session["workspace_id"], what))

    def _require_snapshot_state(self, session, what):
        if session["status"] not in SNAPSHOT_STATES:
            raise ApiFailure(409, "session %s is %s; cannot %s" % (
                session["session_id"], contract.status_string(session["status"]), what))

    async def create(self, session, doc, kind=contract.CHECKPOINT_KIND_EXPLICIT):
        label = doc.get("label", "")
        if label is None:
            label = ""
        if not isinstance(label, str) or len(label) > contract.MAX_LABEL_CHARS:
            raise ApiFailure(400, "label must be a string of at most %d characters" % contract.MAX_LABEL_CHARS)
        sid = session["session_id"]
        await self.sessions.wait_booted(sid)
        async with self.sessions.lock(sid):
            self._require_snapshot_state(session, "take a checkpoint")
            if self.sessions.in_flight.get(sid):
                raise ApiFailure(409, "session %s has a command in flight; take the checkpoint when it is done" % sid)
            rec = {"checkpoint_id": contract.new_checkpoint_id(), "session_id": sid, "status": contract.CHECKPOINT_PENDING,
                   "kind": kind, "label": label, "event_id": contract.new_event_id(), "size_bytes": 0,
                   "created_at": now_rfc3339(), "error_message": ""}
            self.store.save_checkpoint(rec)
            dest = self.store.checkpoint_data(sid, rec["checkpoint_id"])
            try:
                rec["size_bytes"] = int(await self.guests.checkpoint(sid, dest))
                rec["status"] = contract.CHECKPOINT_READY
            except Exception as e:
                log.warning("checkpoint of %s failed: %s", sid, e)
                shutil.rmtree(dest, ignore_errors=True)
                rec["status"] = contract.CHECKPOINT_FAILED
                rec["error_message"] = "the checkpoint failed: %s" % e
            self.store.save_checkpoint(rec)
            return rec

    def delete(self, session_id, checkpoint_id):
        # Deleting what is already gone succeeds, as on the platform. Ids are opaque, so only a checkpoint this
        # session has is forgotten: the id never becomes a path unless it names a stored record.
        cid = (checkpoint_id or "").lower()
        if cid in self.store.checkpoints.get(session_id, {}):
            self.store.forget_checkpoint(session_id, cid)

    def _ready_checkpoint(self, session_id, checkpoint_id):
        rec = self.get(session_id, checkpoint_id)
        if rec["status"] != contract.CHECKPOINT_READY:
            raise ApiFailure(409, "checkpoint %s is %s, not READY" % (rec["checkpoint_id"], rec["status"]))
        return rec

    async def rollback(self, session, checkpoint_id):
        sid = session["session_id"]
        cp = self._ready_checkpoint(sid, checkpoint_id)
        self._refuse_with_workspace(session, "rollback")
        await self.sessions.wait_booted(sid)
        async with self.sessions.lock(sid):
            self._require_snapshot_state(session, "roll back")
            if self.sessions.in_flight.get(sid):
                raise ApiFailure(409, "session %s has a command in flight; roll back when it is done" % sid)
            self.sessions.activity.kill_all(sid, "session rolled back")
            sandbox_id = str(uuid.uuid4())
            try:
                await self.guests.stop(sid)
                await self.guests.restore(sid, self.store.checkpoint_data(sid, cp["checkpoint_id"]))
                await self.guests.boot(sid, sandbox_id, self.sessions.rootfs_spec(session), guest_env(session),
                                       session["egress"], hostname_for(session["name"]))
                self.sessions.apply_agent_limits(sid)
            except Exception as e:
                log.warning("rollback of %s failed: %s", sid, e)
                self.sessions.fail(session, "rollback failed: %s" % e)
                raise ApiFailure(500, "rollback of session %s to checkpoint %s failed: %s" % (sid, cp["checkpoint_id"], e)) from e
            self.sessions.activity.touch(sid)
            self.sessions.set_status(session, contract.READY, sandbox_id=sandbox_id)
            return session

    async def fork(self, session, doc):
        """Children boot from a READY checkpoint's copy of the workspace and the root changes, all or nothing.

        Without from_checkpoint_id, an implicit checkpoint of the session "now" is taken first (create_session_fork).
        """
        count = doc.get("count", 1)
        if count is None:
            count = 1
        if isinstance(count, bool) or not isinstance(count, int) or not contract.FORK_MIN <= count <= contract.FORK_MAX:
            raise ApiFailure(400, "count must be a whole number from %d to %d, got %r" % (
                contract.FORK_MIN, contract.FORK_MAX, count))
        sid = session["session_id"]
        self._refuse_with_workspace(session, "fork")
        self.sessions.admit(session["size_slug"], count)
        from_id = doc.get("from_checkpoint_id") or ""
        if not isinstance(from_id, str):
            raise ApiFailure(400, "from_checkpoint_id must be a checkpoint id")
        if from_id:
            cp = self._ready_checkpoint(sid, from_id)
        else:
            cp = await self.create(session, {"label": contract.IMPLICIT_FORK_LABEL},
                                   kind=contract.CHECKPOINT_KIND_IMPLICIT)
            if cp["status"] != contract.CHECKPOINT_READY:
                raise ApiFailure(500, "fork of session %s failed, no session was created: the implicit checkpoint "
                                      "failed: %s" % (sid, cp["error_message"]))
        src_dir = self.store.checkpoint_data(sid, cp["checkpoint_id"])
        await self.sessions.wait_booted(sid)
        self._require_snapshot_state(session, "fork")
        fork_id = str(uuid.uuid4())
        children = []
        taken = set()
        for _child in range(count):
            name = fork_name(session["name"], lambda n: bool(self.sessions.live_with_name(n)) or n.lower() in taken)
            taken.add(name.lower())
            spec = {"name": name, "agent": session.get("agent") or "custom", "template": session["template"],
                    "size_slug": session["size_slug"], "idle_timeout_seconds": session["idle_timeout_seconds"],
                    "env": dict(session["env"]), "secrets": dict(session.get("secrets") or {}),
                    "egress": session["egress"], "config_id": session.get("config_id")}
            # resume_on_topoff is never inherited by a fork (doctl config start-session).
            rec = self.sessions.new_record(spec, parent_session_id=sid, fork_id=fork_id,
                                           fork_from_checkpoint_id=cp["checkpoint_id"])
            rec["rootfs"] = dict(session["rootfs"])
            children.append(rec)
        for rec in children:
            self.store.save_session(rec)
        results = await asyncio.gather(*(self.sessions._boot(rec, clone_from=(sid, src_dir)) for rec in children),
                                       return_exceptions=True)
        if all(r is True for r in results):
            return children
        # All or nothing: undo every child.
        reasons = [(rec.get("warnings") or [str(r)])[-1] for rec, r in zip(children, results) if r is not True]
        for rec in children:
            await self.sessions._quiet_destroy(rec["session_id"])
            self.store.forget_session(rec["session_id"])
        raise ApiFailure(500, "fork of session %s failed, no session was created: %s" % (sid, "; ".join(reasons)))


def fork_name(parent_name, taken):
    """'<parent>-fork-<n>' with the lowest n from 1 whose name no live session has (Decision: the docs are silent)."""
    n = 1
    while True:
        suffix = "-fork-%d" % n
        name = parent_name[:64 - len(suffix)].rstrip("._-") + suffix
        if not taken(name):
            return name
        n += 1
