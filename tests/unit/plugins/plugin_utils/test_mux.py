"""The worker <-> mux protocol end to end in-process: a real MuxServer (minus tunnel and REST) over the fake agent."""
import json
import os
import socket
import stat
import threading
import time

import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import server as mux_mod
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import mux_client as mc
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import run_dirs
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import session_link
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import switch_interval
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import ProcessConfig, LinkConfig, process_dir


class NoTunnel:
    def errors_since(self, since):
        return []

    def stop(self):
        pass


CFG = LinkConfig(session="box", token="s3cr3t", api_url="http://127.0.0.1:9", persist=60)


def fake_link(server, channel, cfg=CFG):
    """A SessionLink of `server` already open on the fake agent's channel (no tunnel, no REST)."""
    link = server.link_for(cfg)
    link.session_id, link.label = "sid-" + cfg.session, "%s (sid-%s)" % (cfg.session, cfg.session)
    link.tunnel = NoTunnel()
    link.client = ac.AgentClient(channel, link.label)
    link.runners = module_runners.ModuleRunners(link.client)
    link.check_session = lambda: {"status": "SESSION_STATUS_READY"}
    link.opened = True
    return link


@pytest.fixture
def served(fake_agent, tmp_path):
    """(agent, MuxClient, MuxServer): a shared mux serving on its socket, its session link on the fake agent."""
    agent, channel = fake_agent
    base = str(tmp_path / "mux")
    mp.private_dir(base)
    server = mux_mod.MuxServer(ProcessConfig(dir=mp.private_dir(process_dir(base, 0))))
    fake_link(server, channel)
    server.listen()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    client = mc.MuxClient(base, CFG, pool_size=1)
    yield agent, client, server
    client.close()
    server.stop(clean=False)
    t.join(5)


RUN = {"id": "tag-1-2", "pid": os.getpid(), "start": mp.process_start_time(os.getpid()),
       "dir": "/workspace/.scratch/run.tag-1-2"}


def test_socket_is_0600_in_a_0700_dir(served):
    client, m = served[1:]
    assert stat.S_IMODE(os.stat(m.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(m.socket_path)).st_mode) == 0o700
    assert client.connect().attached["label"] == "box (sid-box)"


def test_exec_round_trip_with_big_stdin_and_run_dir(served):
    agent, client = served[:2]
    payload = os.urandom(3 * 1024 * 1024)
    rc, out, err, info = client.exec(["/bin/sh", "-c", "cat"], env={"TMPDIR": RUN["dir"], "RC": "7"}, stdin=payload,
                                     run=RUN)
    assert rc == 7 and info["rc"] == 7
    assert out == b"argv=/bin/sh -c cat\n" + payload
    assert err == ("TMPDIR=%s" % RUN["dir"]).encode()
    # the run's TMPDIR was made first, once
    assert agent.calls[0] == ("exec", ["/bin/sh", "-c", run_dirs.MAKE_RUN_DIR, "sh", RUN["dir"]])
    client.exec(["true"], run=RUN)
    assert sum(1 for c in agent.calls if "mkdir -p" in " ".join(c[1])) == 1


def test_several_requests_on_one_connection_stay_in_step(served):
    client = served[1]
    for i in range(5):
        rc, out = client.exec(["echo", str(i)], stdin=b"x%d" % i)[:2]
        assert out.endswith(b"x%d" % i) and rc == 0


def test_interactive_exec_holds_stdin_until_released(served):
    client = served[1]
    seen = []

    def interact(out, err):
        seen.append(out)
        return True if out.startswith(b"argv=") else None
    rc, out = client.exec(["sudo"], stdin=b"module", interact=interact)[:2]
    assert rc == 0 and out.endswith(b"module") and seen


def test_held_stdin_times_out_at_its_deadline_while_output_keeps_coming(served):
    """interact_timeout is a deadline from the start, not a silence: output always waiting to be read (here the
    interaction is slower than the guest) does not hold it off, and the command is stopped."""
    agent, client = served[:2]
    agent.mode = "chatter"

    def slow(out, err):
        time.sleep(0.005)

    with pytest.raises(mc.InteractTimeout) as e:
        client.exec(["su"], stdin=b"x", interact=slow, interact_timeout=0.5)
    assert e.value.stdout.startswith(b"argv=su\n")
    assert e.value.stdout.count(b".") < 1000  # 2000 wait to be read
    for _dummy in range(100):
        if ("chatter stopped", ["su"]) in agent.calls:
            break
        time.sleep(0.1)
    assert ("chatter stopped", ["su"]) in agent.calls


def test_lost_command_is_reported_lost(served):
    agent, client = served[:2]
    agent.mode = "no-exit"
    with pytest.raises(errors.CommandLost) as e:
        client.exec(["true"])
    assert e.value.kind == mp.ERR_LOST and "not re-run" in str(e.value)
    agent.mode = None
    assert client.exec(["true"])[0] == 0  # the connection is still usable


def test_put_and_fetch_inside_the_workspace(served, tmp_path):
    agent, client = served[:2]
    src = tmp_path / "in ☃.bin"
    src.write_bytes(os.urandom(2 * 1024 * 1024 + 3))
    # on the fake agent's gRPC channel (this link has no bulk lines)
    assert client.put(str(src), "/workspace/in.bin", run=RUN) == {"bytes": src.stat().st_size, "staged": False, "via": "grpc"}
    dest = tmp_path / "out ☃.bin"
    assert client.fetch("/workspace/in.bin", str(dest), run=RUN)["bytes"] == src.stat().st_size
    assert dest.read_bytes() == src.read_bytes()


def test_fetch_of_a_missing_file_is_not_found(served, tmp_path):
    client = served[1]
    with pytest.raises(errors.NotFound) as e:
        client.fetch("/workspace/nope", str(tmp_path / "x"))
    assert e.value.kind == mp.ERR_NOT_FOUND


def test_relative_and_home_guest_paths():
    assert profile.guest_path("x/y") == "/workspace/x/y"
    assert profile.guest_path("~/f") == "/workspace/home/f"
    assert profile.guest_path("/etc/../etc/x") == "/etc/x"


def test_run_liveness_uses_pid_and_start_time():
    me = os.getpid()
    assert mp.process_alive(me, mp.process_start_time(me))
    assert not mp.process_alive(me, "1")  # a reused pid is another process
    assert not mp.process_alive(2 ** 22 + 1, None)


def test_run_identity_names_the_playbook_process():
    run_id, pid, start = mc.run_identity(str(os.getpid()))
    tag, p, s = run_id.split("-")
    assert (int(p), s) == (os.getpid(), start) and tag == mc.host_tag() and len(tag) == 8


class OneShotServer:
    """A fake mux that hangs up on the first connection before acknowledging, then answers every request."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        self.requests = 0
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        first = True
        while True:
            conn = self.sock.accept()[0]
            if first:
                first = False
                conn.close()
                continue
            while True:
                frame = mp.recv_frame(conn)
                if frame is None:
                    break
                self.requests += 1
                mp.send_frame(conn, mp.ACK)
                mp.send_frame(conn, mp.RESULT, {"op": frame[1]["op"]})
            conn.close()


def test_a_request_never_acknowledged_is_retried_once(tmp_path):
    base = str(tmp_path / "m")
    mp.private_dir(mp.private_dir(base) and process_dir(base, 0))
    server = OneShotServer(os.path.join(process_dir(base, 0), mp.SOCKET_NAME))
    client = mc.MuxClient(base, CFG, pool_size=1)
    client.sock = mp.connect_in(client.dir)  # this connection will be dropped unacknowledged
    assert client.request("hello") == {"op": "hello"}
    assert server.requests == 2  # the attach of the new connection, then the request


def test_collections_root_contains_the_collection():
    root = mc.collections_root()
    assert os.path.isdir(os.path.join(root, "ansible_collections", "microvm", "sandbox"))


def test_token_is_not_in_reprs():
    client = mc.MuxClient("/tmp/x", CFG)
    assert "s3cr3t" not in repr(client) and "s3cr3t" not in repr(CFG) and "s3cr3t" not in client.key


def test_an_unresolved_link_never_asks_the_api_about_no_session_id(tmp_path):
    """Before resolve() the link has no session id: the checks say so instead of asking the API about `None`."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink
    asked = []

    class Api:
        def get_session(self, sid):
            asked.append(sid)
            return {"session_id": sid, "status": "SESSION_STATUS_READY"}

    link = SessionLink(CFG, str(tmp_path))
    link.api = Api()
    for check in (link.check_session, link.wake_if_paused):
        with pytest.raises(errors.Unreachable, match="session box has not been looked up yet"):
            check()
    assert asked == []


def test_a_failed_session_is_reported_with_its_warnings_not_an_error_text(tmp_path):
    """The session object has no error text (get_session); a FAILED session's documented words are its warnings."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink

    class Api:
        session = {"session_id": "sid-1", "name": "box", "status": "SESSION_STATUS_FAILED",
                   "warnings": ["the sandbox failed to boot: no space left"], "error_message": "never read"}

        def get_session(self, sid):
            return dict(self.session)

    link = SessionLink(CFG, str(tmp_path))
    link.api, link.session_id, link.label = Api(), "sid-1", "box (sid-1)"
    with pytest.raises(errors.SessionGone) as e:
        link.check_session()
    text = str(e.value)
    assert "box (sid-1) is FAILED" in text and "the sandbox failed to boot: no space left" in text
    assert "never read" not in text
    Api.session = dict(Api.session, warnings=[])
    with pytest.raises(errors.SessionGone) as e:
        link.check_session()
    assert str(e.value) == "session box (sid-1) is FAILED; it cannot run tasks any more"


def test_the_heap_is_trimmed_after_requests_and_not_while_idle(served, monkeypatch):
    client, server = served[1:]
    trims = []
    monkeypatch.setattr(mux_mod, "MALLOC_TRIM", trims.append)
    monkeypatch.setattr(mux_mod, "WATCH_INTERVAL", 0.05)
    time.sleep(1.2)  # the watch's current one-second wait ends
    idle = len(trims)
    client.exec(["echo", "x"], stdin=b"y")
    deadline = time.monotonic() + 5
    while len(trims) == idle and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    after = len(trims)
    # attach and exec are two requests: one pass or two trim after them; idle passes never do
    assert idle == 0 and after in (1, 2) and set(trims) == {0}
    time.sleep(0.3)
    assert len(trims) == after


def test_glibc_malloc_trim_is_found_here():
    if not os.path.exists("/lib/x86_64-linux-gnu/libc.so.6") and not os.path.exists("/lib/aarch64-linux-gnu/libc.so.6"):
        pytest.skip("not a glibc machine")
    assert mux_mod.MALLOC_TRIM is not None
    assert mux_mod.MALLOC_TRIM(0) in (0, 1)


def _every_member():
    """One instance of every class of the error family, as the mux's code raises them."""
    family = [errors.SandboxError("plain"), errors.Unreachable("no way in"),
              errors.TunnelFailure("close code 4001", close_code=4001), errors.SessionGone("box is DESTROYED"),
              errors.CommandLost("lost"), errors.GuestUnavailable("cut"), errors.NotFound("no such file"),
              errors.Denied("refused"), errors.PathRefused("outside /workspace"), errors.ChecksumMismatch("sha256"),
              errors.HttpRefused(500, "HTTP 500"), errors.ProtocolMismatch("unknown op"), errors.WarmRefused("cold")]
    return family


# kind -> the Ansible exception a task gets (the outcomes every path must give: see _worker/outcomes.py)
ANSIBLE_OF_KIND = {"unreachable": "AnsibleConnectionFailure", "gone": "AnsibleConnectionFailure",
                   "lost": "AnsibleConnectionFailure", "protocol": "AnsibleConnectionFailure",
                   "not_found": "AnsibleFileNotFound", "denied": "AnsibleError", "path": "AnsibleError",
                   "failed": "AnsibleError"}


@pytest.mark.parametrize("raised", _every_member(), ids=lambda e: type(e).__name__)
def test_each_error_reaches_the_task_as_its_kind_through_a_real_mux(served, monkeypatch, raised):
    """A member raised by an op in the mux crosses the ERROR frame, is rebuilt as its kind's class in the worker,
    and becomes the Ansible exception of its kind's outcome: one vocabulary end to end."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import outcomes

    client, server = served[1:]
    link = server.links[CFG.key]
    link.check_session = lambda: {"status": "SESSION_STATUS_READY"}

    def failing_put(link, req):
        raise raised
    monkeypatch.setitem(mux_mod.RESULT_OPS, "put", failing_put)
    with pytest.raises(errors.SandboxError) as e:
        client.put(__file__, "/workspace/x", run=None)
    rebuilt = e.value
    assert rebuilt.__class__ is errors.CLASS_OF_KIND[raised.kind] and rebuilt.kind == raised.kind
    assert str(rebuilt) == str(raised)
    if raised.kind == errors.ERR_WARM:
        return  # never a task outcome: the connection runs the module cold
    mapped = outcomes.ansible_error(rebuilt, "microvm.sandbox.agent")
    assert type(mapped).__name__ == ANSIBLE_OF_KIND[raised.kind]
    assert str(mapped).startswith("microvm.sandbox.agent: " + str(raised))


def test_only_a_lost_command_asks_the_platform_about_its_session(served):
    """A lost stream is explained by the session's state (a REST call); a command that exits costs none."""
    agent, client, server = served
    link = server.links[CFG.key]
    checks = []
    link.check_session = lambda: checks.append(1) or {"status": "SESSION_STATUS_READY"}
    assert client.exec(["true"])[0] == 0
    assert checks == []
    agent.mode = "no-exit"
    with pytest.raises(errors.CommandLost):
        client.exec(["true"])
    assert checks == [1]


class RefusingTunnel:
    """A tunnel whose every dial the platform refused with a pre-upgrade 502 (nothing listens on the port)."""

    def errors_since(self, since):
        return [errors.TunnelFailure("could not reach guest port 8443 (HTTP 502)", status=502)]

    def stop(self):
        pass


def probing_link(tmp_path, status):
    """An `auto` link on a session in `status` whose agent port refuses, with a channel that never connects."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink

    class Api:
        def get_session(self, sid):
            return {"session_id": sid, "status": "SESSION_STATUS_" + status}

        def wait_session(self, sid, timeout):
            return self.get_session(sid)

    link = SessionLink(LinkConfig(session="box", token="t", transport="auto"), str(tmp_path))
    link.api, link.session_id, link.label = Api(), "sid-1", "box (sid-1)"
    link.tunnel = RefusingTunnel()
    link.client = ac.AgentClient(ac.open_channel("unix:" + str(tmp_path / "nobody.sock")), link.label)
    return link


def test_auto_takes_a_refused_agent_port_on_a_usable_session_as_the_answer(tmp_path, monkeypatch):
    """The refusal itself ends auto's probe (not the probe's time running out)."""
    monkeypatch.setattr(session_link, "REFUSAL_GRACE_SECONDS", 0.2)
    link = probing_link(tmp_path, "READY")
    try:
        with pytest.raises(errors.TunnelFailure) as e:
            link.ensure_ready(limit=30, refusal_ends=True)
        assert e.value.status == 502
    finally:
        link.client.close()


def test_auto_does_not_believe_a_refusal_while_the_session_is_not_usable(tmp_path):
    """A 502 while the sandbox is still starting says nothing about the port: the probe goes on to its end."""
    link = probing_link(tmp_path, "PROVISIONING")
    try:
        with pytest.raises(errors.Unreachable, match=r"within 1 s \(transport auto's probe\)") as e:
            link.ensure_ready(limit=1, refusal_ends=True)
        assert not isinstance(e.value, errors.TunnelFailure)
    finally:
        link.client.close()


def refused(at):
    e = errors.TunnelFailure("could not reach guest port 8443 (HTTP 502)", status=502)
    e.at = at
    return e


@pytest.mark.parametrize("at, usable_at, out_of_time, believed", [
    (10.0, None, False, False),   # the session was not seen usable: a 502 of a sandbox still booting
    (10.0, None, True, False),
    (9.0, 9.5, True, False),      # refused before the session was seen usable: says nothing about the port
    (10.0, 9.5, False, False),    # within the grace: an agent still starting
    (11.5, 9.5, False, True),     # refused the grace after the session was seen usable: nothing listens
    (10.0, 9.5, True, True),      # still refused when the wait ran out
])
def test_a_refused_agent_port_is_believed_only_on_a_usable_session_after_the_grace(at, usable_at, out_of_time, believed):
    assert session_link.REFUSAL_GRACE_SECONDS == 2.0
    assert session_link.SessionLink._refusal_believed(refused(at), usable_at, out_of_time) is believed


@pytest.mark.parametrize("at, usable_at, believed", [
    (9.0, 9.5, False),            # auto too: refused before the session was seen usable says nothing
    (9.5, 9.5, True),             # auto has the api road to fall back on: a refusal on a usable session at once
])
def test_auto_takes_a_refusal_on_a_usable_session_without_a_grace(at, usable_at, believed):
    assert session_link.SessionLink._refusal_believed(refused(at), usable_at, False, grace=0.0) is believed


class ListeningLater:
    """A port-forward refused until `listen()` (the guest's agent starting), then carrying to a real agent.

    `on_look(tunnel)` is called at each look at its errors once the session was reported READY.
    """

    url, ssl_context = "ws://127.0.0.1:9/no-bulk-lines-here", None  # what a link's bulk lines would dial

    def __init__(self, socket_path, on_look=None):
        self.socket_path = socket_path
        self.on_look = on_look
        self.listening = False
        self.ready = False
        self.refused_after_ready = 0
        self.seen = []

    def start(self):
        pass

    def listen(self):
        self.listening = True

    def errors_since(self, since):
        if self.ready and self.on_look is not None:
            self.on_look(self)
        if not self.listening:  # every dial the channel makes is refused while nothing listens
            self.seen.append(refused(time.monotonic()))
            self.refused_after_ready += self.ready
        return [e for e in self.seen if e.at >= since]

    def stop(self):
        pass


def agent_link(tmp_path, monkeypatch, socket_path, on_look=None):
    """A `transport: agent` link on a READY session whose tunnel is a ListeningLater on `socket_path`."""
    tunnels = []

    def tunnel(*_args, **kwargs):
        tunnels.append(ListeningLater(socket_path, on_look))
        return tunnels[-1]

    class Api:
        def get_session(self, sid):
            tunnels[-1].ready = True
            return {"session_id": sid, "status": "SESSION_STATUS_READY"}

    monkeypatch.setattr(session_link, "Tunnel", tunnel)
    link = session_link.SessionLink(LinkConfig(session="box", token="t", transport="agent", connect_timeout=30),
                                    str(tmp_path / "link"))
    link.api, link.session_id, link.label = Api(), "sid-1", "box (sid-1)"
    return link


def test_agent_fails_a_refused_agent_port_naming_the_transport_not_after_connect_timeout(tmp_path, monkeypatch):
    """transport agent, nothing on the agent port of a usable session: UNREACHABLE with what to do, at once."""
    link = agent_link(tmp_path, monkeypatch, str(tmp_path / "nobody.sock"))
    with pytest.raises(errors.Unreachable) as e:
        link._open_agent_road()
    text = str(e.value)
    assert not isinstance(e.value, errors.TunnelFailure) and "within 30s" not in text, text
    assert "could not reach guest port 8443 (HTTP 502)" in text and "the template has no guest agent" in text, text
    assert "Set transport to auto or api" in text and "agent_port" in text, text


def test_agent_waits_for_an_agent_that_listens_just_after_the_session_is_usable(fake_agent, tmp_path, monkeypatch):
    """Dials are still refused after the session reports READY (its agent starting), then the agent listens: the
    refusals within the grace fail nothing. The agent starts on the second look at the tunnel after READY, so a
    refusal believed without the grace would have failed the link first."""
    looks_after_ready = []

    def starts(tunnel):  # the agent's socket appears (fake_agent serves it) a moment after READY
        looks_after_ready.append(1)
        if len(looks_after_ready) == 2 and not tunnel.listening:
            os.symlink(str(tmp_path / "agent.sock"), tunnel.socket_path)
            tunnel.listen()

    link = agent_link(tmp_path, monkeypatch, str(tmp_path / "later.sock"), on_look=starts)
    try:
        assert link._open_agent_road() is True
        assert len(looks_after_ready) >= 2 and link.tunnel.refused_after_ready  # it was refused on a READY session
        assert link.client.exec(["echo", "hi"]).exit_code == 0
    finally:
        link._teardown()


def test_the_choice_is_told_once_to_each_run(tmp_path):
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import SessionLink
    link = SessionLink(CFG, str(tmp_path))
    assert link.road_note("run-1") is None  # no choice made (yet, or not auto): nothing to tell
    link.label, link.road, link.road_why = "box (sid-1)", "api", "the agent port refused: HTTP 502"
    note = link.road_note("run-1")
    assert note == "session box (sid-1): transport auto chose api (the agent port refused: HTTP 502)"
    assert link.road_note("run-1") is None and link.road_note("") is None
    assert link.road_note("run-2") == note


def test_switch_interval_is_short_only_while_requests_compete(served):
    """Issue 45: the mux's GIL switch interval is 0.5 ms while two requests are in flight (one session's flood must
    not slow another's small commands) and Python's 5 ms while one request runs alone (a playbook's tasks)."""
    agent, client, server = served
    now = [100.0]
    seen = []
    server.switch_interval = switch_interval.SwitchInterval(setter=seen.append, clock=lambda: now[0])
    assert client.exec(["true"])[0] == 0
    assert seen == [switch_interval.LONG]  # one request at a time: never short
    holding, go = threading.Event(), threading.Event()

    def interact(out, err):  # a's command stays in flight (stdin held back) until b's is done
        holding.set()
        go.wait(10)
        return True
    other = mc.MuxClient(os.path.dirname(client.dir), CFG, pool_size=1)
    held = threading.Thread(target=client.exec, args=(["sudo"],), kwargs={"stdin": b"x", "interact": interact})
    held.start()
    try:
        assert holding.wait(10)
        assert other.exec(["true"])[0] == 0
        assert seen[-1] == switch_interval.SHORT
    finally:
        go.set()
        held.join(10)
        other.close()
    now[0] += switch_interval.HOLD / 2
    assert client.exec(["true"])[0] == 0
    assert seen[-1] == switch_interval.SHORT  # a neighbour's next command within HOLD: still short
    now[0] += switch_interval.HOLD * 2
    assert client.exec(["true"])[0] == 0
    assert seen[-1] == switch_interval.LONG


def test_hop_stamps_join_the_worker_and_the_mux_by_the_request_s_id(served, monkeypatch, tmp_path):
    """With MICROVM_HOPS (bench/hops_bench.py), the worker's and the mux's lines of each request share its id;
    without it, nothing is written."""
    client, server = served[1:]
    path = tmp_path / "hops"
    assert client.exec(["true"])[0] == 0 and not path.exists()
    monkeypatch.setenv(hops.SWITCH, str(path))
    monkeypatch.setattr(mux_mod, "HOPS_FILE", str(path))
    client.close()  # the next request attaches anew: stamped too
    assert client.exec(["true"])[0] == 0
    client.close()  # an exec's request ends in the mux when the worker's next one comes, or it hangs up
    deadline = time.monotonic() + 10
    while path.read_text().count('"side": "mux"') < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the mux writes its line once the request has ended
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    worker = {line["op"]: line for line in lines if line["side"] == "worker"}
    mux = {line["hop"]: line for line in lines if line["side"] == "mux"}
    assert set(worker) == {"attach", "exec"}
    for op, line in worker.items():
        seen = mux[line["hop"]]
        assert seen["op"] == op and line["req"] <= seen["in"] <= seen["out"] and seen["in"] <= line["exit"]


@pytest.fixture
def a_run():
    """A run (as a worker names one) whose ansible-playbook is a process the test ends: end() -> the run is over."""
    import subprocess
    proc = subprocess.Popen(["sleep", "600"])
    start = mp.process_start_time(proc.pid)
    run = {"id": "tag-%d-%s" % (proc.pid, start), "pid": proc.pid, "start": start,
           "dir": "/workspace/.scratch/run.tag-%d-%s" % (proc.pid, start)}

    def end():
        proc.kill()
        proc.wait()
    yield run, end
    end()


def settled(link, client):
    """The link once its worker is gone, as a task's worker goes (the mux holds an exec until the worker's next
    request or hang-up: see exec_ops._pump_stdin)."""
    client.close()
    deadline = time.monotonic() + 10
    while link.users and time.monotonic() < deadline:
        time.sleep(0.01)
    return link


def rm_calls(agent):
    return [c[1] for c in agent.calls if c[0] == "exec" and c[1][2:3] == ['rm -rf -- "$@"']]


def test_a_link_lives_as_long_as_its_run_and_persist_counts_from_the_run_s_end(served, a_run):
    """Far-apart tasks of one run keep one link: idle for hours while its ansible-playbook lives is not idle."""
    agent, client, server = served
    run, end = a_run
    client.exec(["true"], run=run)
    link = settled(server.links[CFG.key], client)
    later = time.monotonic() + 10 * CFG.persist
    assert link.next_due() >= link.next_check  # only the session check is due: no idle close while the run lives
    assert link.maintain(later) is None and not link.closed.is_set()
    end()
    ended_at = time.monotonic()
    assert link.maintain(ended_at) is None  # the run's end is noted; persist starts now
    assert ended_at + CFG.persist - 1 <= link.next_due() <= time.monotonic() + CFG.persist
    assert link.maintain(ended_at + CFG.persist - 1) is None
    assert link.maintain(time.monotonic() + CFG.persist + 1)[0].startswith("idle for 60s")
    assert rm_calls(agent) == []  # maintaining never removed the ended run's TMPDIR: that waits for a use or the close


def test_an_ended_run_s_tmpdir_goes_with_the_next_run_s_first_request(served, a_run):
    agent, client, server = served
    run, end = a_run
    client.exec(["true"], run=run)
    end()
    link = settled(server.links[CFG.key], client)
    link.maintain(time.monotonic())
    assert rm_calls(agent) == [] and link.runs.runs[run["id"]]["ended"] is not None
    client.exec(["true"], run=RUN)  # the next run: its TMPDIR made, the ended one's removed, in one exec
    made = [c[1] for c in agent.calls if c[0] == "exec" and c[1][2:3] == [run_dirs.MAKE_RUN_DIR]]
    assert made[-1][3:] == ["sh", RUN["dir"], run["dir"]]
    assert run["id"] not in link.runs.runs


def test_a_request_of_a_live_run_removes_an_ended_run_s_tmpdir_beside_it(served, a_run):
    agent, client, server = served
    run, end = a_run
    client.exec(["true"], run=RUN)
    client.exec(["true"], run=run)
    end()
    link = server.links[CFG.key]
    link.maintain(time.monotonic())
    client.exec(["true"], run=RUN)
    deadline = time.monotonic() + 10
    while not rm_calls(agent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rm_calls(agent) == [["/bin/sh", "-c", 'rm -rf -- "$@"', "sh", run["dir"]]]


@pytest.mark.parametrize("status, removed", [("SESSION_STATUS_READY", True), ("SESSION_STATUS_PAUSED", False)])
def test_the_close_removes_ended_runs_tmpdirs_only_on_a_usable_session(served, a_run, status, removed):
    """A session paused once the playbook ended is never woken by the mux's housekeeping (input resumes it)."""
    agent, client, server = served
    run, end = a_run
    client.exec(["true"], run=run)
    end()
    link = server.links[CFG.key]
    link.check_session = lambda: {"status": status}
    server.close_link(link, "test")
    assert rm_calls(agent) == ([["/bin/sh", "-c", 'rm -rf -- "$@"', "sh", run["dir"]]] if removed else [])
    assert link.runs.runs == {}


def test_an_idle_link_of_a_live_run_asks_the_platform_about_its_session_seldom(served, a_run):
    """500 links kept open by their runs between far-apart tasks must not ask the platform every 10 s each."""
    client, server = served[1:]
    run = a_run[0]
    client.exec(["true"], run=run)
    link = server.links[CFG.key]
    asked = []
    link.check_session = lambda: asked.append(1) or {"status": "SESSION_STATUS_READY"}
    now = time.monotonic()
    link.maintain(now + session_link.SESSION_CHECK_INTERVAL + 1)  # used since the link was born: checked
    assert len(asked) == 1
    link.maintain(now + 3 * session_link.SESSION_CHECK_INTERVAL)  # no request since: not asked again
    assert len(asked) == 1
    assert link.next_due() >= now + session_link.SESSION_CHECK_IDLE_INTERVAL
    link.maintain(now + session_link.SESSION_CHECK_IDLE_INTERVAL + 2 * session_link.SESSION_CHECK_INTERVAL)
    assert len(asked) == 2
