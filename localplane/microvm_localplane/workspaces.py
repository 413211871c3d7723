"""Persistent workspaces: a saved set of files with its own id, the /workspace of the one session that holds it.

Documented (How to Use Persistent Workspaces; doctl harness-runtime workspace; pydo delete_workspace):
create with a size limit (whole GiB, 1-100, fixed for life), an optional label (not unique) and an
idempotency key; list (newest first, one state at a time, paginated), get, delete (only AVAILABLE or
FAILED; DELETING while it runs, then gone). States AVAILABLE, ATTACHING, ATTACHED, RELEASING, FAILED,
DELETING. A workspace is attached when a session is created from a saved config with its workspace_id,
never afterwards, to one session at a time; removing the session saves the files (RELEASING, then
AVAILABLE) and never deletes the workspace.

The local plane keeps a workspace's files under <state_dir>/workspace-data/<id>/workspace in canonical
ids (0 = the guest's root, like a checkpoint copy): a session that attaches it starts with a copy of them
in its /workspace, and removing the session copies its /workspace back. Records are one JSON file each
(0600), written atomically.
"""
import asyncio
import logging
import os
import shutil
import time
import uuid

from .httputil import ApiFailure, now_rfc3339
from .store import _read_dir, _unlink, write_json_atomic

log = logging.getLogger("microvm_localplane.workspaces")

AVAILABLE, ATTACHING, ATTACHED, RELEASING, FAILED, DELETING = (
    "AVAILABLE", "ATTACHING", "ATTACHED", "RELEASING", "FAILED", "DELETING")
STATES = (AVAILABLE, ATTACHING, ATTACHED, RELEASING, FAILED, DELETING)
DELETABLE = frozenset([AVAILABLE, FAILED])
# The workspace object: the columns doctl prints (WorkspaceID, Name, State, SizeLimitGiB, BytesUsed,
# AttachedSessionID, LastSavedAt, CreatedAt) in the API's snake case (godo: size_limit_gib).
PUBLIC_FIELDS = ("workspace_id", "name", "state", "size_limit_gib", "bytes_used", "attached_session_id",
                 "last_saved_at", "created_at")
CREATE_KEYS = frozenset(["name", "size_limit_gib", "idempotency_key"])
MIN_SIZE_GIB, MAX_SIZE_GIB = 1, 100
# Within 24 hours the same key with the same size and name returns the first workspace.
IDEMPOTENCY_WINDOW_SECONDS = 24 * 3600
# Decisions where the docs are silent: label and key lengths; the size of the workspace that
# `persistent_workspace: true` in a YAML spec makes for its session.
MAX_NAME_CHARS = 64
MAX_KEY_CHARS = 128
SPEC_WORKSPACE_SIZE_GIB = 10


def public_view(rec: dict) -> dict:
    return {key: rec.get(key) if rec.get(key) is not None else ("" if key != "bytes_used" else 0)
            for key in PUBLIC_FIELDS}


def _tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


class Workspaces:
    def __init__(self, state_dir: str):
        self.records_dir = os.path.join(state_dir, "workspaces")
        self.data_root = os.path.join(state_dir, "workspace-data")
        for d in (self.records_dir, self.data_root):
            os.makedirs(d, mode=0o700, exist_ok=True)
        self.records = _read_dir(self.records_dir)
        self.tasks: set = set()

    # -- records ---------------------------------------------------------------
    def _save(self, rec: dict) -> None:
        self.records[rec["workspace_id"]] = rec
        write_json_atomic(os.path.join(self.records_dir, rec["workspace_id"] + ".json"), rec)

    def _forget(self, workspace_id: str) -> None:
        self.records.pop(workspace_id, None)
        _unlink(os.path.join(self.records_dir, workspace_id + ".json"))

    def data_dir(self, workspace_id: str) -> str:
        """The saved files' parent: <data_root>/<id>, holding `workspace/` (a checkpoint-shaped copy)."""
        return os.path.join(self.data_root, workspace_id)

    def get(self, workspace_id: str) -> dict:
        rec = self.records.get((workspace_id or "").lower())
        if rec is None:
            raise ApiFailure(404, "workspace %r not found (workspace names are not accepted: give its id)"
                             % (workspace_id or "")[:100])
        return rec

    def listing(self, state: str = "") -> list:
        if state and state not in STATES:
            raise ApiFailure(400, "unknown state %r: use one of %s" % (state[:40], ", ".join(STATES)))
        recs = sorted(self.records.values(), key=lambda r: (r["created_at"], r["workspace_id"]), reverse=True)
        return [r for r in recs if not state or r["state"] == state]

    # -- create ------------------------------------------------------------------
    def create(self, doc: dict) -> tuple:
        """-> (record, created). A repeated key with the same values returns the first workspace."""
        size = doc.get("size_limit_gib")
        if size is None:
            raise ApiFailure(400, "size_limit_gib is required: the workspace's size limit in GiB, a whole number "
                                  "from %d to %d (it cannot be changed later)" % (MIN_SIZE_GIB, MAX_SIZE_GIB))
        if isinstance(size, bool) or not isinstance(size, int) or not MIN_SIZE_GIB <= size <= MAX_SIZE_GIB:
            raise ApiFailure(400, "size_limit_gib must be a whole number from %d to %d, got %r"
                             % (MIN_SIZE_GIB, MAX_SIZE_GIB, size))
        name = doc.get("name") or ""
        if not isinstance(name, str) or len(name) > MAX_NAME_CHARS or any(not c.isprintable() for c in name):
            raise ApiFailure(400, "name must be a printable label of at most %d characters, got %r"
                             % (MAX_NAME_CHARS, name if not isinstance(name, str) else name[:80]))
        key = doc.get("idempotency_key") or ""
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or any(not c.isprintable() for c in key):
            raise ApiFailure(400, "idempotency_key must be a printable string of at most %d characters"
                             % MAX_KEY_CHARS)
        if key:
            first = self._by_key(key)
            if first is not None:
                if first["size_limit_gib"] != size or first["name"] != name:
                    raise ApiFailure(409, "idempotency_key %r was used within 24 hours to create workspace %s with "
                                          "other values (size_limit_gib %d, name %r): use a new key for a different "
                                          "workspace" % (key[:80], first["workspace_id"], first["size_limit_gib"],
                                                         first["name"]))
                if first["state"] == DELETING:
                    raise ApiFailure(409, "the workspace idempotency_key %r created (%s) is being deleted: try again "
                                          "in a moment, and the key then creates a new workspace"
                                     % (key[:80], first["workspace_id"]))
                return first, False
        return self._new(size, name, key), True

    def _by_key(self, key: str):
        now = time.time()
        for rec in self.records.values():
            if rec.get("idempotency_key") == key and now - rec.get("created", 0) < IDEMPOTENCY_WINDOW_SECONDS:
                return rec
        return None

    def _new(self, size: int, name: str, key: str = "") -> dict:
        rec = {"workspace_id": str(uuid.uuid4()), "name": name, "state": AVAILABLE, "size_limit_gib": size,
               "bytes_used": 0, "attached_session_id": "", "last_saved_at": "", "created_at": now_rfc3339(),
               "created": time.time(), "idempotency_key": key}
        os.makedirs(os.path.join(self.data_dir(rec["workspace_id"]), "workspace"), mode=0o700, exist_ok=True)
        self._save(rec)
        return rec

    def create_for_spec(self, session_id: str) -> dict:
        """`persistent_workspace: true` in a YAML spec: a new workspace, held by that session from the start."""
        rec = self._new(SPEC_WORKSPACE_SIZE_GIB, "")
        rec.update(state=ATTACHED, attached_session_id=session_id)
        self._save(rec)
        return rec

    # -- attach and release ---------------------------------------------------
    def attach(self, workspace_id: str, session_id: str) -> dict:
        rec = self.get(workspace_id)
        if rec["state"] != AVAILABLE:
            holder = (" by session %s" % rec["attached_session_id"]) if rec["attached_session_id"] else ""
            raise ApiFailure(409, "workspace %s is %s%s: one session holds a workspace at a time; remove that "
                                  "session and wait until the workspace is AVAILABLE" % (
                                      rec["workspace_id"], rec["state"], holder))
        rec.update(state=ATTACHED, attached_session_id=session_id)
        self._save(rec)
        return rec

    def held_by(self, session_id: str):
        for rec in self.records.values():
            if rec["attached_session_id"] == session_id and rec["state"] in (ATTACHING, ATTACHED, RELEASING):
                return rec
        return None

    def saved_copy(self, workspace_id: str):
        """The dir to seed a new session's state from (a checkpoint-shaped copy), or None when nothing is saved."""
        src = self.data_dir(workspace_id)
        return src if os.listdir(os.path.join(src, "workspace")) else None

    async def release(self, session_id: str, guests) -> None:
        """The session is being removed: save its /workspace into the workspace, which becomes AVAILABLE again."""
        rec = self.held_by(session_id)
        if rec is None:
            return
        rec["state"] = RELEASING
        self._save(rec)
        wid = rec["workspace_id"]
        staging = os.path.join(self.data_root, ".save-%s" % wid)
        await asyncio.to_thread(shutil.rmtree, staging, True)
        try:
            # A checkpoint copy: the guest frozen while copying, files in canonical ids.
            await guests.checkpoint(session_id, staging)
            old = self.data_dir(wid) + ".old"
            await asyncio.to_thread(shutil.rmtree, old, True)
            os.rename(self.data_dir(wid), old)
            os.makedirs(self.data_dir(wid), mode=0o700)
            os.rename(os.path.join(staging, "workspace"), os.path.join(self.data_dir(wid), "workspace"))
            await asyncio.to_thread(shutil.rmtree, old, True)
            rec.update(bytes_used=await asyncio.to_thread(_tree_bytes, os.path.join(self.data_dir(wid), "workspace")),
                       last_saved_at=now_rfc3339(), state=AVAILABLE, attached_session_id="")
        except Exception as e:
            log.warning("saving workspace %s from session %s failed: %s", wid, session_id, e)
            rec.update(state=FAILED, attached_session_id="")
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        self._save(rec)

    def release_unbooted(self, session_id: str) -> None:
        """A session that never got a sandbox gives its workspace back unchanged."""
        rec = self.held_by(session_id)
        if rec is not None:
            rec.update(state=AVAILABLE, attached_session_id="")
            self._save(rec)

    # -- delete ------------------------------------------------------------------
    def delete(self, rec: dict) -> None:
        if rec["state"] not in DELETABLE:
            holder = (" (held by session %s)" % rec["attached_session_id"]) if rec["attached_session_id"] else ""
            raise ApiFailure(409, "workspace %s is %s%s: only an AVAILABLE or FAILED workspace can be deleted; remove "
                                  "the session that holds it, wait until the workspace is AVAILABLE, then delete it"
                             % (rec["workspace_id"], rec["state"], holder))
        rec["state"] = DELETING
        self._save(rec)
        task = asyncio.get_running_loop().create_task(self._finish_delete(rec["workspace_id"]))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _finish_delete(self, workspace_id: str) -> None:
        await asyncio.to_thread(shutil.rmtree, self.data_dir(workspace_id), True)
        self._forget(workspace_id)

    def resume_interrupted(self) -> None:
        """After a restart: finish deletes; a save cut short left the last saved copy, which stays."""
        for rec in list(self.records.values()):
            if rec["state"] == DELETING:
                task = asyncio.get_running_loop().create_task(self._finish_delete(rec["workspace_id"]))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
