# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""One session inside the shared mux: its port-forward, its gRPC channel, its health and wake-up.

A SessionLink is opened by the first worker that attaches to it, serves every task of every run
on that session, and is closed `persist` idle seconds after the last run that used it ended (never while
one of its runs lives, however far apart its tasks), when its session is deleted, or by
`meta: reset_connection`. Nothing here touches another session's link: one
session's trouble (deleted, paused, cut) stays in its own link.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError, WaitTimeout
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_road
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import bulk_line
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import capped
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.http_stdlib import stdlib_open
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.run_dirs import RunDirs
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.tunnel import Tunnel, port_refused

grpc = ac.grpc
log = logging.getLogger("microvm.mux")

SESSION_CHECK_INTERVAL = 10.0  # REST check that the session still exists, while the link is used
# A link with no request since its last check (a run that keeps it open between far-apart tasks) is checked this
# seldom: a fleet's links would otherwise ask the platform about every session every 10 s for nothing; its next
# request finds a deleted session anyway.
SESSION_CHECK_IDLE_INTERVAL = 300.0
# A refused agent port is believed only for a dial refused at least this long after the link saw the session usable
# (usable_since). No page says READY waits for the guest's agent to listen (the create returns before the sandbox boots;
# READY says the sandbox runs), and an agent that exited is restarted by the guest's init after a back-off (the local
# plane: 0.2 s, doubling): a refusal may precede a listening agent by a moment. gRPC redials at least every 2 s
# (agent_client.CHANNEL_OPTIONS), so a refusal is the answer 2-4 s after the session is seen usable, not connect_timeout.
REFUSAL_GRACE_SECONDS = 2.0
NOTED_RUNS = 64                # runs a link remembers having told which road `auto` chose (road_note)
TMP_WARNINGS_KEPT = 8          # unawaited tmp dir rm failures a link keeps for the next attach (older ones: log only)
RoadClient = ac.AgentClient | api_road.ApiRoadClient    # one road's client: the same methods on both
Runners = module_runners.ModuleRunners

# Exit codes of the mux's own helper scripts in the guest (guest()) that say what went wrong, so a kind is
# never picked from the words a guest's tools print (another language, another coreutils, a hostile guest).
RC_NOT_FOUND = 3
RC_DENIED = 4
HELPER_EXIT_CODES: dict[int, type[errors.SandboxError]] = {RC_NOT_FOUND: errors.NotFound, RC_DENIED: errors.Denied}


class LinkClosed(Exception):
    """The link was closed before the request began: the request may go to a fresh link."""


def connectivity(channel: grpc.Channel | None) -> grpc.ChannelConnectivity | None:
    """The channel's state now, without making it connect; None when it cannot be told.

    Asked when a request needs it: grpc's subscribe() runs a thread per channel that wakes five times a
    second, which kept an idle mux busy.
    """
    inner = getattr(channel, "_channel", None)
    if inner is None:
        return None
    try:
        from grpc import _common  # grpc's own table of its C core's states
        return _common.CYGRPC_CONNECTIVITY_STATE_TO_CHANNEL_CONNECTIVITY[inner.check_connectivity_state(False)]
    except Exception:  # another grpc's internals: the caller then checks the slow way
        return None


class SessionLink:
    """The channel to one session's guest agent, shared by every worker attached to it."""

    def __init__(self, cfg: LinkConfig, socket_dir: str, generation: int = 1,
                 on_close: Callable[[], None] | None = None) -> None:
        self.cfg = cfg
        self.key = cfg.key
        self.generation = generation  # how many links this mux process opened for this key so far
        self.socket_dir = socket_dir  # private dir of this link's tunnel socket
        self.api = ApiClient(cfg.api_url, cfg.token, prefix=cfg.prefix, timeout=min(cfg.connect_timeout, 30.0),
                             retries=3, validate_certs=cfg.validate_certs, opener=stdlib_open)
        self.session_id: str | None = None
        self.usable_since: float | None = None  # _note_status()
        self.label = cfg.session
        self.tunnel: Tunnel | None = None
        self._client: RoadClient | None = None     # see the client property
        self.road = "agent"  # or "api": the documented exec and file API (api_road.attach)
        self.road_why = ""   # `auto`: why it chose self.road (the mux log, and each run's workers once: road_note)
        self._noted_runs: list[str] = []
        self._runners: Runners | None = None
        self.runs = RunDirs(self)
        self.opened = False
        self.closed = threading.Event()   # set: no new request is taken
        self.torn_down = False
        self.closed_because: errors.SandboxError | None = None  # why a closed link refuses requests
        self.open_lock = threading.Lock()
        self.ready_lock = threading.Lock()
        self.lock = threading.Lock()
        self.users = 0                    # requests in progress
        self.last_activity = time.monotonic()
        self.next_check = time.monotonic() + SESSION_CHECK_INTERVAL
        self.checked_at = time.monotonic()  # the last session check (or the link's birth)
        self.maintaining = False          # a watch pass of this link is running
        self.maintained_at = 0.0          # when the last one started
        self.on_close = on_close          # the mux's watch thread is told (it sleeps until something is due)
        # task tmp dir rms that failed unawaited (exec_ops.op_tmp "nowait"): the next attach of this session shows them
        self.tmp_warnings: collections.deque[str] = collections.deque(maxlen=TMP_WARNINGS_KEPT)
        # requests being served unanswered ("nowait"): the session's next requests wait for them (exec_ops.Unawaited)
        self.unawaited = 0
        self.unawaited_done = threading.Condition()

    def __repr__(self) -> str:
        return "SessionLink(%r, generation=%d)" % (self.label, self.generation)

    @property
    def resolved_id(self) -> str:
        """The session's id, known once resolve() ran (open() runs it first)."""
        if self.session_id is None:
            raise errors.Unreachable("session %s has not been looked up yet: the link is not open" % self.label)
        return self.session_id

    @property
    def client(self) -> RoadClient:
        """The road's client: the guest agent's gRPC client, or the documented API's (same methods)."""
        if self._client is None:
            raise errors.Unreachable("the link to session %s is not open" % self.label)
        return self._client

    @client.setter
    def client(self, value: RoadClient | None) -> None:
        self._client = value

    @property
    def runners(self) -> Runners:
        """The session's warm module runners (module_runners.ApiModuleRunners on the api road)."""
        if self._runners is None:
            raise errors.WarmRefused("the link to session %s has no module runner" % self.label)
        return self._runners

    @runners.setter
    def runners(self, value: Runners | None) -> None:
        self._runners = value

    # -- opening and closing ------------------------------------------------------------
    def open(self) -> None:
        """Resolve the session, start its tunnel and channel, and wait until the agent answers (once)."""
        if self.opened:
            return
        with self.open_lock:
            if self.closed.is_set():
                raise self.closed_because or errors.Unreachable("the link to session %s was closed" % self.label)
            if self.opened:
                return
            self.resolve()
            if self.cfg.transport == "api" or not self._open_agent_road():
                api_road.attach(self)
            self.opened = True
        if self.road_why:
            log.info("%s", self.road_choice())
        log.info("session %s: link %d open", self.label, self.generation)
        if self.cfg.host_tag:
            threading.Thread(target=self.runs.sweep_stale, args=(self.cfg.host_tag,), name="sweep", daemon=True).start()

    def _open_agent_road(self) -> bool:
        """The tunnel and gRPC channel to the agent; False when `auto` finds no agent (then api).

        `auto` decides in one step: a port that refuses the platform's dial (a template without the agent) falls
        back at once; a port that takes the dial but whose agent stays silent falls back after
        api_road.AUTO_PROBE_SECONDS. A gone session is an error on every road, never a fallback.
        """
        auto = self.cfg.transport == "auto"
        if auto:
            self.wake_if_paused()  # a paused session is woken first, so its quiet agent is not mistaken for none
        self.tunnel = Tunnel(self.cfg.api_url, self.cfg.prefix, self.session_id or self.cfg.session, self.cfg.token,
                             port=self.cfg.agent_port, label=self.label, connect_timeout=self.cfg.connect_timeout,
                             validate_certs=self.cfg.validate_certs, socket_dir=self.socket_dir)
        self.tunnel.start()
        # A lost stream drops its connection: the agent client then dials through a fresh channel (_dial).
        client = ac.AgentClient(self._dial(), self.label, self.cfg.scratch_dir, redial=self._dial, bulk=self._bulk_pool())
        self.client, self.runners = client, module_runners.ModuleRunners(client, self.cfg.scratch_dir)
        try:
            self.ensure_ready(limit=api_road.AUTO_PROBE_SECONDS if auto else None, refusal_ends=True)
        except errors.SandboxError as e:
            self._teardown()
            if isinstance(e, errors.SessionGone):
                raise
            refusal = e if isinstance(e, errors.TunnelFailure) and port_refused(e) else None
            if not auto:
                if refusal is not None:  # the answer, not a reason to wait connect_timeout for an agent never there
                    raise errors.Unreachable(self._no_agent_message(refusal)) from e
                raise
            if refusal is None:
                self.check_session()  # deleted while the agent was silent: an error, not the api road
            self.tunnel = self._client = self._runners = None
            self.road_why = (self._refusal(refusal) if refusal is not None
                             else "the agent did not answer within %g s: %s" % (api_road.AUTO_PROBE_SECONDS, e))
            return False
        if auto:
            self.road_why = "the agent answered on port %d" % self.cfg.agent_port
        return True

    def _refusal(self, e: errors.TunnelFailure) -> str:
        # not the tunnel's own words, which say "tries again": here the refusal is the answer
        how = "HTTP %s" % e.status if e.status else "close code %s" % e.close_code
        return "the agent port refused: the platform could not reach guest port %d (%s)" % (self.cfg.agent_port, how)

    def _no_agent_message(self, e: errors.TunnelFailure) -> str:
        """transport agent on a refused agent port: what happened and what to do."""
        return ("session %s: %s; the template has no guest agent, or it does not listen there. Set transport to auto "
                "or api (ansible_microvm_transport) to use the platform's documented exec and file API, or agent_port "
                "(ansible_microvm_agent_port) if the agent listens on another port" % (self.label, self._refusal(e)))

    def road_choice(self) -> str:
        """What `auto` chose and why, in one line."""
        return "session %s: transport auto chose %s (%s)" % (self.label, self.road, self.road_why)

    def road_note(self, run: str) -> str | None:
        """road_choice() the first time a run asks on this link (the workers show it at -v once), None after."""
        if not self.road_why or not run:
            return None
        with self.lock:
            if run in self._noted_runs:
                return None
            self._noted_runs.append(run)
            del self._noted_runs[:-NOTED_RUNS]
        return self.road_choice()

    def close(self, why: str, clean: bool = True, because: errors.SandboxError | None = None) -> None:
        """Close this link only: its warm runners, channel and tunnel. With clean, its housekeeping in the guest
        first (ended runs' TMPDIRs, the api road's runner dirs), only on a session usable now (_may_touch_guest)."""
        with self.lock:
            if self.torn_down:
                return
            self.torn_down = True
            if because is not None or not self.closed.is_set():
                self.closed_because = because
            self.closed.set()
        touch_guest = clean and self.opened and self._may_touch_guest()
        if clean and self.opened:
            if touch_guest:
                self.runs.remove_ended()
            else:
                self.runs.leave_ended()
        self._teardown(touch_guest)
        log.info("session %s: link %d closed (%s)", self.label, self.generation, why)
        if self.on_close is not None:
            self.on_close()

    def _teardown(self, touch_guest: bool = True) -> None:
        if self._runners is not None:
            self._runners.stop(touch_guest)
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        if self.tunnel is not None:
            self.tunnel.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def _may_touch_guest(self) -> bool:
        """At a clean close: whether its housekeeping in the guest (ended runs' TMPDIRs, the api road's runner dirs)
        may run, asked of the platform only when there is some. Never on a session not usable now: any input wakes
        a paused one, so its files are left to a later link's sweep."""
        self.runs.note_ended(time.monotonic())
        if not self.runs.has_ended_dirs() and not (self._runners is not None and self._runners.leave_files()):
            return False
        return self.usable_now()

    def _idle_since(self) -> float | None:
        """Since when the link is idle (its last request, or its last run's end), None while in use or a run lives.

        Under self.lock.
        """
        if self.users or self.runs.live():
            return None
        return max(self.last_activity, self.runs.last_end)

    def try_close_idle(self, now: float) -> bool:
        """Stop taking requests if idle for `persist` seconds after its runs ended; atomic with in_use(), so none
        slips in."""
        with self.lock:
            since = self._idle_since()
            if since is None or now - since < self.cfg.persist or self.closed.is_set():
                return False
            self.closed.set()
            return True

    @contextlib.contextmanager
    def in_use(self) -> Iterator[SessionLink]:
        """Count a request in progress, so the link is not closed as idle under it (LinkClosed if it was)."""
        with self.lock:
            if self.closed.is_set():
                raise LinkClosed()
            self.users += 1
            self.last_activity = time.monotonic()
        try:
            yield self
        finally:
            with self.lock:
                self.users -= 1
                self.last_activity = time.monotonic()

    def next_due(self) -> float:
        """When maintain() has work next: the idle close (no request running, no run alive) or the session check."""
        with self.lock:
            since = self._idle_since()
            idle_at = since + self.cfg.persist if since is not None else float("inf")
            return min(idle_at, self._check_at())

    def _check_at(self) -> float:
        """When the session is checked next: SESSION_CHECK_INTERVAL after the last check while the link is used,
        SESSION_CHECK_IDLE_INTERVAL when no request came since. Under self.lock."""
        if self.last_activity > self.checked_at:
            return self.next_check
        return self.checked_at + SESSION_CHECK_IDLE_INTERVAL

    def idle_for(self, now: float) -> float:
        with self.lock:
            return 0.0 if self.users else now - self.last_activity

    # -- the session's health -------------------------------------------------------------
    def resolve(self) -> dict:
        """Session name or id -> id; a destroyed or unknown session is a clear error."""
        try:
            found = self.api.find_session(self.cfg.session)
        except ApiError as e:
            raise errors.Unreachable("cannot look up session %s: %s" % (self.cfg.session, e)) from e
        if not found:
            raise errors.SessionGone("session %s does not exist (no live session has this id or name)" % self.cfg.session)
        self.session_id = found.get("session_id") or self.cfg.session
        name = found.get("name")
        self.label = "%s (%s)" % (name, self.session_id) if name and name != self.session_id else self.session_id
        self._note_status(found)
        if profile.short_status(found.get("status")) in profile.GONE:
            raise errors.SessionGone(self._gone_message(found))
        return found

    def _gone_message(self, session: dict) -> str:
        # The session object carries no error text; its documented `warnings` are all it says about a failure.
        msg = "session %s is %s%s" % (self.label, profile.short_status(session.get("status")),
                                      profile.warnings_note(session))
        return msg + "; it cannot run tasks any more"

    def check_session(self) -> dict:
        """Raise SessionGone when the session is deleted, failed or unknown; return it otherwise."""
        try:
            session = self.api.get_session(self.resolved_id)
        except ApiError as e:
            if e.gone:
                raise errors.SessionGone("session %s no longer exists (HTTP %d): it was deleted" % (self.label, e.status)) from e
            raise errors.Unreachable("cannot check session %s: %s" % (self.label, e)) from e
        self._note_status(session)
        if profile.short_status(session.get("status")) in profile.GONE:
            raise errors.SessionGone(self._gone_message(session))
        return session

    def wake_if_paused(self) -> None:
        session = self.check_session()
        status = profile.short_status(session.get("status"))
        try:
            if status == "PAUSED":
                log.info("session %s is paused: resuming it", self.label)
                try:
                    self.api.resume_session(self.resolved_id)
                except ApiError as e:
                    if e.status != 409:  # someone else resumed it meanwhile
                        raise
            if status in ("PAUSED", "PROVISIONING"):
                self.api.wait_session(self.resolved_id, timeout=self.cfg.connect_timeout)
        except (ApiError, WaitTimeout) as e:
            raise errors.Unreachable("session %s is %s and could not be made ready: %s" % (self.label, status, e)) from e

    @property
    def channel(self) -> grpc.Channel | None:
        return self._client.channel if self._client is not None else None

    def _bulk_pool(self) -> bulk_line.Pool | None:
        """The session's bulk lines (big transfers on one socket each), unless switched off or h2 is missing."""
        if not bulk_line.enabled():
            if bulk_line.BULK_IMPORT_ERROR is not None:
                log.info("session %s: transfers take the gRPC channel: %s (pip install h2 for the bulk path)",
                         self.label, bulk_line.BULK_IMPORT_ERROR)
            return None
        if self.tunnel is None:  # set by _open_agent_road just before
            return None
        target = bulk_line.Target(self.tunnel.url, self.cfg.token, self.tunnel.ssl_context, self.cfg.connect_timeout,
                                  self.label, self.cfg.agent_port)
        return bulk_line.Pool(lambda: bulk_line.Line.dial(target))

    def _dial(self) -> grpc.Channel:
        """A gRPC channel through the tunnel (its state is asked when needed: connectivity())."""
        if self.tunnel is None:
            raise errors.Unreachable("the tunnel to session %s is closed" % self.label)
        return ac.open_channel("unix:" + self.tunnel.socket_path)

    def usable_now(self) -> bool:
        """Whether guest helpers may run without waking the session (for housekeeping only).

        Asked of the platform, not of the channel: a channel still READY may not have seen a pause yet, and its
        next bytes would wake the session (input resumes a paused one).
        """
        try:
            return profile.short_status(self.check_session().get("status")) in profile.USABLE
        except errors.SandboxError:
            return False

    def ensure_ready(self, limit: float | None = None, refusal_ends: bool = False) -> None:
        """Wait until the gRPC channel is connected; wake a paused session; fail clearly otherwise.

        On the api road there is no channel: the data plane wakes a paused session by itself. With `refusal_ends`
        (opening a link on `agent` or `auto`), the agent port refusing the dial on a usable session ends the wait,
        raising that refusal (a TunnelFailure for which tunnel.port_refused() is true): see _refusal_believed().
        """
        if self.road == "api" or connectivity(self.channel) == grpc.ChannelConnectivity.READY:
            return
        tunnel = self.tunnel
        if tunnel is None:
            raise errors.Unreachable("the link to session %s is closed" % self.label)
        with self.ready_lock:
            since = time.monotonic()
            deadline = since + (limit or self.cfg.connect_timeout)
            checked = 0.0
            while True:
                channel = self.channel  # read each time: a lost stream may have redialled it
                if channel is None:
                    raise errors.Unreachable("the link to session %s is closed" % self.label)
                future = grpc.channel_ready_future(channel)
                try:
                    future.result(timeout=0.5)
                    return
                except grpc.FutureTimeoutError:
                    future.cancel()
                errors_seen = tunnel.errors_since(since)
                now = time.monotonic()
                if errors_seen and errors_seen[-1].fatal:
                    self.check_session()  # a deleted session is reported as such
                    raise errors.Unreachable(str(errors_seen[-1]))
                last = errors_seen[-1] if errors_seen else None
                if refusal_ends and last is not None and port_refused(last):
                    if self.usable_since is None:
                        self.check_session()  # notes when the session is seen usable
                    # auto has a road to fall back on, so it takes a refusal at once; agent fails, so it grants a grace
                    grace = 0.0 if self.cfg.transport == "auto" else REFUSAL_GRACE_SECONDS
                    if self._refusal_believed(last, self.usable_since, now >= deadline, grace):
                        raise errors.TunnelFailure(str(last), status=last.status, close_code=last.close_code)
                if errors_seen and now - checked > 2.0:
                    checked = now
                    self.wake_if_paused()
                if now >= deadline:
                    said = (": last error: %s" % last) if last is not None else ""
                    bound = "%g s (transport auto's probe)" % limit if limit else "%ss (option connect_timeout)" % int(
                        self.cfg.connect_timeout)
                    raise errors.Unreachable("could not connect to the guest agent of session %s within %s%s"
                                             % (self.label, bound, said))

    @staticmethod
    def _refusal_believed(refusal: errors.TunnelFailure, usable_at: float | None, out_of_time: bool,
                          grace: float = REFUSAL_GRACE_SECONDS) -> bool:
        """Whether a refused agent port is the answer (no agent there) rather than an agent still starting.

        Only on a session seen usable (a 502 from a sandbox still booting says nothing about the port), and only for
        a dial refused `grace` seconds after that; a refusal still coming when the wait runs out is one too.
        """
        if usable_at is None or refusal.at < usable_at:
            return False
        return out_of_time or refusal.at >= usable_at + grace

    def _note_status(self, session: dict) -> None:
        """Keep usable_since: when this link saw the session usable, after last seeing it not (see REFUSAL_GRACE_SECONDS)."""
        if profile.short_status(session.get("status")) not in profile.USABLE:
            self.usable_since = None
        elif self.usable_since is None:
            self.usable_since = time.monotonic()

    def report(self, e: errors.SandboxError) -> dict[str, str]:
        """The ERROR payload of a failure on this session.

        A lost stream keeps its kind (it is never re-run, whatever the cause) and gets what the session's
        state and the tunnel know appended (`session box (id) is DESTROYED`). A gone session also closes
        this link (only this one).
        """
        gone = e if isinstance(e, errors.SessionGone) else None
        if isinstance(e, errors.CommandLost):
            try:
                self.check_session()
            except errors.SessionGone as why:
                gone, e = why, e.with_context(str(why))
            except errors.Unreachable as why:
                e = e.with_context(str(why))
            else:
                recent = self.tunnel.errors_since(time.monotonic() - 60) if self.tunnel else []
                if recent:
                    e = e.with_context("tunnel: %s" % recent[-1])
        if gone is not None:
            threading.Thread(target=self.close, args=("the session is gone",),
                             kwargs={"clean": False, "because": gone}, daemon=True).start()
        return e.to_frame()

    # -- helpers in the guest ------------------------------------------------------------------
    def guest(self, script: str, *args: str) -> ac.ExecResult:
        """Run a small sh script in the guest (the mux's own helpers); raise on failure.

        The script says what failed by its exit code: RC_NOT_FOUND, RC_DENIED (HELPER_EXIT_CODES); any
        other code is a plain failure with the script's stderr as its message. Only the first few KiB of
        its output are kept (capped.py): a guest's tools cannot grow the mux.
        """
        self.ensure_ready()
        result = self.client.exec(["/bin/sh", "-c", script, "sh"] + list(args), deadline=self.cfg.connect_timeout + 60)
        if result.exit_code != 0:
            raise HELPER_EXIT_CODES.get(result.exit_code, errors.SandboxError)(capped.message(result))
        return result

    # -- housekeeping (the mux's watch thread calls this when next_due() comes, or a run ended) -----------
    def maintain(self, now: float) -> tuple[str, bool, errors.SandboxError | None] | None:
        """Note ended runs, close the link when idle, check the session now and then.

        Returns None, or why to close the link: (reason, clean, the error later requests get).
        An ended run's TMPDIR is not removed here (that would wake a session paused since): see run_dirs.RunDirs.
        """
        self.runs.note_ended(now)
        if self.try_close_idle(now):
            return "idle for %ss after its last run" % int(self.cfg.persist), True, None
        with self.lock:
            check_at = self._check_at()
        if now >= check_at:
            self.next_check, self.checked_at = now + SESSION_CHECK_INTERVAL, now
            try:
                self.check_session()
            except errors.SessionGone as e:
                return str(e), False, e
            except errors.Unreachable as e:
                log.warning("%s", e)
        return None
