"""A pool of pre-booted guests, so that a `keep_warm: true` create is READY in milliseconds, not a boot.

`keep_warm` is a documented field of the environment spec and of the session object; the local plane reads
it as "keep sandboxes of this environment warm": a keep_warm create asks the plane to keep up to
`size` guests of its template and size booted ahead (a *warm key*), and a later keep_warm create of that
template and size is served from them.

Rules, so that a claimed guest cannot be told from a freshly booted one and never carries anyone's state:
- A pooled guest is booted exactly like a session's guest (GuestManager.boot) under a session id made up
  in advance (ids are the server's to assign), with no env, no secrets, open egress and a placeholder
  hostname. It is never reachable before it is claimed: no session record names it, so no route finds it.
- A claim takes it out of the pool for good: it becomes that one session's guest, and is destroyed with
  it. Guests are never returned to the pool nor shared across sessions, so /workspace, /tmp and the root
  filesystem's changes are those of a fresh boot.
- Only a spec the pooled guest was booted for is served from it: the same template root filesystem (a
  rebuilt template makes its pooled guests stale: they are destroyed) and size, no env and no secrets
  (the agent reads them at start), open egress (the network policy is set at boot), and no persistent
  workspace to seed. Anything else boots as usual.
- At claim the guest takes the session's hostname (its UTS namespace, /etc/hostname and /etc/hosts).
- The pool is bounded (`size` per warm key, `max_total` in all) and refilled in the background; a warm key
  nobody asked for during `ttl` seconds is dropped with its guests. Unclaimed guests are destroyed when the
  plane stops, and those a crashed plane left behind at the next start (warm-pool.json lists them).

warm-pool.json in the state dir also counts what the pool did (claimed, booted, discarded): tests read it.
"""
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import subprocess
import time
import uuid

from . import idmap
from . import rootfs as rootfs_mod
from .store import write_json_atomic

log = logging.getLogger("microvm_localplane.warmpool")

DEFAULT_SIZE = 2          # guests kept ready per warm key
DEFAULT_MAX_TOTAL = 8     # guests kept ready (or booting) in all
DEFAULT_TTL = 1800.0      # seconds a warm key stays warm after the last keep_warm create
PLACEHOLDER_HOSTNAME = "sandbox"
REFILL_INTERVAL = 0.25
# Refill boots wait until claims have paused this long: a burst of keep_warm creates is served first, and the
# boots that replace its guests do not compete with it for the CPU.
CLAIM_QUIET = 0.5


_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUTS = 0x04000000


def _set_uts_hostname(pid: int, hostname: str) -> None:
    """sethostname in the guest's UTS namespace (its own; nothing else of the guest is entered).

    setns moves only the calling thread (a worker thread), which returns to the plane's namespace after;
    nsenter(1) is the fallback (a fork and an exec: slower under load).
    """
    own = os.open("/proc/thread-self/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open("/proc/%d/ns/uts" % pid, os.O_RDONLY | os.O_CLOEXEC)
    name = hostname.encode()
    try:
        if _libc.setns(target, CLONE_NEWUTS) == 0:
            try:
                if _libc.sethostname(name, len(name)) != 0:
                    raise OSError(ctypes.get_errno(), "sethostname in the guest failed")
            finally:
                if _libc.setns(own, CLONE_NEWUTS) != 0:
                    # A worker thread left in a guest's UTS namespace would name every later guest: never go on.
                    os.abort()
            return
    finally:
        os.close(own)
        os.close(target)
    proc = subprocess.run(["nsenter", "--target", str(pid), "--uts", "--", "hostname", hostname],
                          capture_output=True, text=True, check=False, timeout=30)
    if proc.returncode != 0:
        raise OSError("cannot set the guest's hostname: %s" % (proc.stderr or proc.stdout).strip()[-300:])


class Member:
    def __init__(self, session_id: str, sandbox_id: str, rootfs: dict, size: str):
        self.session_id = session_id
        self.sandbox_id = sandbox_id
        self.rootfs = rootfs
        self.size = size


class WarmPool:
    def __init__(self, state_dir: str, guests, size: int = DEFAULT_SIZE, max_total: int = DEFAULT_MAX_TOTAL,
                 ttl: float = DEFAULT_TTL, on_booted=None):
        self.path = os.path.join(state_dir, "warm-pool.json")
        self.guests = guests
        self.size = max(0, int(size))
        self.max_total = max(0, int(max_total))
        self.ttl = ttl
        self.on_booted = on_booted or (lambda session_id: None)
        self.keys: dict = {}      # (template, size) -> {"rootfs": dict, "wanted_at": monotonic}
        self.ready: dict = {}     # key -> [Member]
        self.booting: dict = {}   # key -> number of boots under way
        self.booting_ids: set = set()
        self.stats = {"claimed": 0, "booted": 0, "discarded": 0, "failed": 0}
        self.task = None
        self.last_claim = 0.0
        self._wake = asyncio.Event()
        self._written = None      # what warm-pool.json holds: rewritten (with an fsync) only when that changes

    @property
    def enabled(self) -> bool:
        return self.size > 0 and self.max_total > 0

    # -- bookkeeping ---------------------------------------------------------------
    def _members(self):
        return [m for members in self.ready.values() for m in members]

    def _total(self) -> int:
        return len(self._members()) + sum(self.booting.values())

    def _write(self) -> None:
        """warm-pool.json: the counts, and every guest the pool owns, booting ones included (recorded before they
        exist, so that a crash never orphans one)."""
        data = dict(self.stats, members=[m.session_id for m in self._members()] + sorted(self.booting_ids),
                    ready={"%s/%s" % k: len(v) for k, v in self.ready.items()})
        if data == self._written:
            return  # an idle plane writes nothing: the refill loop runs 4 times a second
        with contextlib.suppress(OSError):
            write_json_atomic(self.path, data)
            self._written = data

    # -- demand and claims -------------------------------------------------------
    def want(self, template: str, size: str, rootfs: dict) -> None:
        """A keep_warm create of this template and size: keep its guests warm (from now on, for ttl)."""
        if not self.enabled:
            return
        key = (template.lower(), size)
        entry = self.keys.setdefault(key, {"rootfs": rootfs, "wanted_at": 0.0})
        if entry["rootfs"] != rootfs:
            entry["rootfs"] = rootfs  # the template was rebuilt: its pooled guests are stale (refill drops them)
        entry["wanted_at"] = time.monotonic()
        self._wake.set()

    @staticmethod
    def eligible(spec: dict) -> bool:
        """Only a spec a pooled guest was booted for: no env or secrets, open egress, no workspace to seed."""
        return (spec.get("keep_warm") is True and not spec.get("env") and not spec.get("secrets")
                and spec.get("egress") is None and not spec.get("workspace_id")
                and not spec.get("persistent_workspace"))

    def claim(self, template: str, size: str, rootfs: dict):
        """A ready guest of this template and size, taken out of the pool for good; None when there is none."""
        members = self.ready.get((template.lower(), size)) or []
        while members:
            m = members.pop(0)
            guest = self.guests.get(m.session_id)
            if m.rootfs != rootfs or guest is None or not guest.alive():
                self._discard(m)
                continue
            self.stats["claimed"] += 1
            self.last_claim = time.monotonic()
            self._write()
            return m
        return None

    async def adopt(self, member: Member, hostname: str) -> None:
        """Make the claimed guest the session's: its hostname (UTS namespace, /etc/hostname, /etc/hosts)."""
        await asyncio.to_thread(self._set_hostname, member.session_id, hostname)

    def _set_hostname(self, session_id: str, hostname: str) -> None:
        guest = self.guests.get(session_id)
        layout = self.guests._layout(session_id)
        with open(layout.ids_file) as f:
            rec = json.load(f)
        ids = idmap.IdRange(int(rec["uid"]), int(rec["gid"]))
        _set_uts_hostname(guest.pid, hostname)
        etc = os.path.join(layout.upper("root"), "etc")
        # No code has run in the guest but the agent's: its /etc is what its boot wrote; replace both files
        # without following anything (write_identity's rules).
        if os.path.isdir(etc) and not os.path.islink(etc):
            for name in ("hostname", "hosts"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(etc, name))
            rootfs_mod.write_identity(layout, [], hostname, ids, [])
        guest.hostname = hostname
        meta = layout.read_meta() or {}
        layout.write_meta(dict(meta, hostname=hostname))

    # -- refill ------------------------------------------------------------------
    def start(self) -> None:
        self._sweep_leftovers()
        if self.enabled:
            self.task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            # Nothing kept warm: nothing to refill or expire until a keep_warm create wakes the loop.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), REFILL_INTERVAL if self.keys else None)
            self._wake.clear()
            try:
                await self._refill()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("warm pool refill failed")

    async def _refill(self) -> None:
        now = time.monotonic()
        if now - self.last_claim < CLAIM_QUIET:
            return
        for key, entry in list(self.keys.items()):
            members = self.ready.setdefault(key, [])
            for m in [m for m in members if m.rootfs != entry["rootfs"]]:
                members.remove(m)
                self._discard(m)
            if now - entry["wanted_at"] > self.ttl:
                del self.keys[key]
                for m in self.ready.pop(key, []):
                    self._discard(m)
                continue
            while len(members) + self.booting.get(key, 0) < self.size and self._total() < self.max_total:
                self.booting[key] = self.booting.get(key, 0) + 1
                asyncio.get_running_loop().create_task(self._boot_one(key, entry["rootfs"]))
        self._write()

    async def _boot_one(self, key, rootfs: dict) -> None:
        from .guests import RootfsSpec
        m = Member(str(uuid.uuid4()), str(uuid.uuid4()), rootfs, key[1])
        try:
            self.guests.admit([m.size])
            self.booting_ids.add(m.session_id)
            self._write()
            await self.guests.boot(m.session_id, m.sandbox_id, RootfsSpec(**rootfs), {}, None, PLACEHOLDER_HOSTNAME,
                                   size=m.size)
            self.on_booted(m.session_id)
        except asyncio.CancelledError:
            await self._destroy(m.session_id)
            raise
        except Exception as e:
            log.warning("a warm guest of %s/%s failed to boot: %s", key[0], key[1], e)
            self.stats["failed"] += 1
            await self._destroy(m.session_id)
            return
        finally:
            self.booting[key] -= 1
            self.booting_ids.discard(m.session_id)
        if key in self.keys and self.keys[key]["rootfs"] == rootfs:
            self.stats["booted"] += 1
            self.ready.setdefault(key, []).append(m)
        else:
            self._discard(m)
        self._write()

    def _discard(self, m: Member) -> None:
        self.stats["discarded"] += 1
        asyncio.get_running_loop().create_task(self._destroy(m.session_id))

    async def _destroy(self, session_id: str) -> None:
        try:
            await self.guests.destroy(session_id)
        except Exception as e:
            log.warning("destroying warm guest %s failed: %s", session_id, e)

    def _sweep_leftovers(self) -> None:
        """Guests an earlier run of the plane pooled and never gave to a session: destroyed now."""
        try:
            with open(self.path) as f:
                leftovers = list(json.load(f).get("members") or [])
        except (OSError, ValueError, AttributeError):
            leftovers = []
        for sid in leftovers:
            if isinstance(sid, str):
                asyncio.get_running_loop().create_task(self._destroy(sid))
        self._write()

    async def shutdown(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        members, self.ready = self._members(), {}
        for m in members:
            await self._destroy(m.session_id)
        self._write()
