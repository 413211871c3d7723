"""The worker <-> mux protocol end to end in-process: a real Mux (minus tunnel and REST) over the fake agent."""
import os
import socket
import stat
import threading

import grpc
import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils import mux as mux_mod
from ansible_collections.microvm.sandbox.plugins.plugin_utils import mux_client as mc
from ansible_collections.microvm.sandbox.plugins.plugin_utils import mux_protocol as mp


class NoTunnel:
    def errors_since(self, since):
        return []


@pytest.fixture
def served(fake_agent, tmp_path):
    """(agent, MuxClient): a Mux serving on <tmp>/mux/k/mux.sock, talking to the fake agent."""
    agent, channel = fake_agent
    base = str(tmp_path / "mux")
    mp.private_dir(base)
    d = mp.private_dir(os.path.join(base, "k"))
    m = mux_mod.Mux({"dir": d, "session": "box", "api_url": "http://127.0.0.1:9", "token": "s3cr3t", "persist": 60})
    m.session_id, m.label = "sid-1", "box (sid-1)"
    m.tunnel = NoTunnel()
    m.agent = ac.AgentClient(channel, m.label)
    m.state = grpc.ChannelConnectivity.READY
    m.check_session = lambda: {"status": "SESSION_STATUS_READY"}
    m.listen()
    t = threading.Thread(target=m.serve_forever, daemon=True)
    t.start()
    client = mc.MuxClient(base, "k", {}, None)
    yield agent, client, m
    client.close()
    m.stop(clean=False)
    t.join(5)


RUN = {"id": "tag-1-2", "pid": os.getpid(), "start": mc.process_start(os.getpid()), "dir": "/workspace/.scratch/run.tag-1-2"}


def test_socket_is_0600_in_a_0700_dir(served):
    client, m = served[1:]
    assert stat.S_IMODE(os.stat(m.socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(m.socket_path)).st_mode) == 0o700


def test_exec_round_trip_with_big_stdin_and_run_dir(served):
    agent, client = served[:2]
    payload = os.urandom(3 * 1024 * 1024)
    rc, out, err, info = client.exec(["/bin/sh", "-c", "cat"], env={"TMPDIR": RUN["dir"], "RC": "7"}, stdin=payload,
                                     run=RUN)
    assert rc == 7 and info["rc"] == 7
    assert out == b"argv=/bin/sh -c cat\n" + payload
    assert err == ("TMPDIR=%s" % RUN["dir"]).encode()
    # the run's TMPDIR was made first, once
    assert agent.calls[0] == ("exec", ["/bin/sh", "-c", 'mkdir -p -- "$1" && chmod 1777 -- "$1"', "sh", RUN["dir"]])
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


def test_lost_command_is_reported_lost(served):
    agent, client = served[:2]
    agent.mode = "no-exit"
    with pytest.raises(mp.MuxError) as e:
        client.exec(["true"])
    assert e.value.kind == mp.ERR_LOST and "not re-run" in str(e.value)
    agent.mode = None
    assert client.exec(["true"])[0] == 0  # the connection is still usable


def test_put_and_fetch_inside_the_workspace(served, tmp_path):
    agent, client = served[:2]
    src = tmp_path / "in ☃.bin"
    src.write_bytes(os.urandom(2 * 1024 * 1024 + 3))
    assert client.put(str(src), "/workspace/in.bin", run=RUN) == {"bytes": src.stat().st_size, "staged": False}
    dest = tmp_path / "out ☃.bin"
    assert client.fetch("/workspace/in.bin", str(dest), run=RUN)["bytes"] == src.stat().st_size
    assert dest.read_bytes() == src.read_bytes()


def test_fetch_of_a_missing_file_is_not_found(served, tmp_path):
    client = served[1]
    with pytest.raises(mp.MuxError) as e:
        client.fetch("/workspace/nope", str(tmp_path / "x"))
    assert e.value.kind == mp.ERR_NOT_FOUND


def test_relative_and_home_guest_paths():
    assert mux_mod.Mux.guest_path("x/y") == "/workspace/x/y"
    assert mux_mod.Mux.guest_path("~/f") == "/workspace/home/f"
    assert mux_mod.Mux.guest_path("/etc/../etc/x") == "/etc/x"


def test_run_liveness_uses_pid_and_start_time():
    me = os.getpid()
    assert mux_mod.run_alive(me, mux_mod.pid_start_time(me))
    assert not mux_mod.run_alive(me, "1")  # a reused pid is another process
    assert not mux_mod.run_alive(2 ** 22 + 1, None)


def test_run_identity_names_the_playbook_process():
    run_id, pid, start = mc.run_identity(str(os.getpid()))
    tag, p, s = run_id.split("-")
    assert (int(p), s) == (os.getpid(), start) and tag == mc.host_tag() and len(tag) == 8


class OneShotServer:
    """A fake mux that hangs up on the first connection before acknowledging, then answers."""

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
            req = mp.recv_frame(conn)[1]
            self.requests += 1
            mp.send_frame(conn, mp.ACK)
            mp.send_frame(conn, mp.RESULT, {"op": req["op"]})
            conn.close()


def test_a_request_never_acknowledged_is_retried_once(tmp_path):
    base = str(tmp_path / "m")
    mp.private_dir(mp.private_dir(base) and os.path.join(base, "k"))
    server = OneShotServer(os.path.join(base, "k", mp.SOCKET_NAME))
    client = mc.MuxClient(base, "k", {}, None)
    client.sock = mp.connect(client.socket_path)  # this connection will be dropped unacknowledged
    assert client.request("hello") == {"op": "hello"}
    assert server.requests == 1


def test_collections_root_contains_the_collection():
    root = mc.collections_root()
    assert os.path.isdir(os.path.join(root, "ansible_collections", "microvm", "sandbox"))


def test_token_is_not_in_reprs():
    client = mc.MuxClient("/tmp/x", "k", {"session": "s"}, "s3cr3t")
    assert "s3cr3t" not in repr(client)
