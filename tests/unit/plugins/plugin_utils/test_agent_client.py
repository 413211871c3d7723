"""The agent client against a fake in-process agent: exec, transfers, path guard, error mapping."""
import os

import grpc
import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import capped
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors


@pytest.fixture
def client(fake_agent):
    agent, channel = fake_agent
    return agent, ac.AgentClient(channel, "sess-1")


def test_exec_streams_stdin_and_keeps_stdout_stderr_apart(client):
    agent, c = client
    r = c.exec(["cat", "-"], env={"TMPDIR": "/workspace/.scratch/run.x", "RC": "3"}, stdin=b"payload" * 300000)
    assert r.exit_code == 3
    # exec() is the mux's own helpers' call: it keeps the first few KiB of each stream (capped.py)
    assert r.stdout == (b"argv=cat -\n" + b"payload" * 300000)[:capped.HELPER_OUTPUT_LIMIT] and r.truncated
    assert r.stderr == b"TMPDIR=/workspace/.scratch/run.x"
    call, feed = c.exec_stream(["cat", "-"], stdin=b"payload" * 300000)  # the stream carries everything
    assert b"".join(data for kind, data in c.iter_exec(call, feed) if kind == "stdout") == b"argv=cat -\n" + b"payload" * 300000
    small = c.exec(["cat", "-"], stdin=b"small")
    assert small.stdout == b"argv=cat -\nsmall" and not small.truncated


def test_exec_timed_out_flag(client):
    c = client[1]
    assert c.exec(["sleep", "9"], timeout=1).timed_out


def test_stream_without_exit_is_a_lost_command(client):
    agent, c = client
    agent.mode = "no-exit"
    with pytest.raises(errors.CommandLost, match="ended without an exit status.*not re-run"):
        c.exec(["true"])
    assert agent.calls == [("exec", ["true"])]  # never re-run


@pytest.mark.parametrize("mode", ["no-exit", "unavailable"])
def test_a_lost_stream_drops_its_connection_and_the_next_call_dials_afresh(fake_agent, tmp_path, mode):
    agent, channel = fake_agent
    dialled = []

    def redial():
        dialled.append(ac.open_channel("unix:" + str(tmp_path / "agent.sock")))
        return dialled[-1]

    c = ac.AgentClient(channel, "sess-1", redial=redial)
    agent.mode = mode
    with pytest.raises(errors.CommandLost):
        c.exec(["true"])
    assert len(dialled) == 1 and c.channel is dialled[0]
    with pytest.raises(ValueError):  # the old channel, and its connection, are closed
        channel.unary_unary("/x")(b"")
    agent.mode = "ok"
    assert c.exec(["true"]).exit_code == 0
    assert len(dialled) == 1
    c.close()


def test_a_refused_command_keeps_the_connection(fake_agent, tmp_path):
    agent, channel = fake_agent
    c = ac.AgentClient(channel, "sess-1", redial=lambda: pytest.fail("redialled after a refusal"))
    agent.mode = "denied"
    with pytest.raises(errors.Denied):
        c.download("/workspace/f", str(tmp_path / "f"))
    agent.mode = None
    with pytest.raises(errors.NotFound):
        c.download("/workspace/missing", str(tmp_path / "f"))
    assert c.channel is channel


def test_unavailable_is_a_lost_command(client):
    agent, c = client
    agent.mode = "unavailable"
    with pytest.raises(errors.CommandLost, match="sess-1.*UNAVAILABLE"):
        c.exec(["true"])
    assert len(agent.calls) == 1


def test_upload_streams_and_verifies(client, tmp_path):
    agent, c = client
    src = tmp_path / "src.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    src.write_bytes(data)
    assert c.upload(str(src), "/workspace/dst.bin", chunk_size=64 * 1024) == len(data)
    assert open(agent.host("/workspace/dst.bin"), "rb").read() == data


def test_download_verified_and_renamed_into_place(client, tmp_path):
    agent, c = client
    data = os.urandom(1024 * 1024 + 5)
    open(agent.host("/workspace/f.bin"), "wb").write(data)
    dest = tmp_path / "out" / "f.bin"
    dest.parent.mkdir()
    assert c.download("/workspace/f.bin", str(dest), chunk_size=100000) == len(data)
    assert dest.read_bytes() == data
    assert os.listdir(dest.parent) == ["f.bin"]


@pytest.mark.parametrize("mode, error", [("bad-sha", errors.ChecksumMismatch), ("cut", errors.GuestUnavailable),
                                         ("no-end", errors.GuestUnavailable)])
def test_broken_download_leaves_no_file(client, tmp_path, mode, error):
    agent, c = client
    open(agent.host("/workspace/f.bin"), "wb").write(os.urandom(500000))
    agent.mode = mode
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(error):
        c.download("/workspace/f.bin", str(out / "f.bin"), chunk_size=100000)
    assert os.listdir(out) == ["keep.txt"]


def test_missing_file_internal_404_is_not_found(client, tmp_path):
    c = client[1]
    with pytest.raises(errors.NotFound, match="/workspace/nope on session sess-1"):
        c.download("/workspace/nope", str(tmp_path / "x"))
    assert not os.path.exists(tmp_path / "x")


def test_permission_denied_is_transfer_denied(client, tmp_path):
    agent, c = client
    agent.mode = "denied"
    with pytest.raises(errors.Denied, match="path outside workspace"):
        c.download("/workspace/link-to-etc", str(tmp_path / "x"))


class NoNetwork:
    """A stub that fails the test if any RPC is attempted."""

    def __getattr__(self, name):
        raise AssertionError("network call %s attempted" % name)


class NoNetworkChannel:
    """A channel whose every RPC fails the test."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: NoNetwork()


@pytest.mark.parametrize("path", ["/tmp/x", "/workspace/../tmp/x", "relative/x", "/workspacex/y"])
def test_transfer_outside_workspace_refused_locally(tmp_path, path):
    c = ac.AgentClient(NoNetworkChannel(), "sess-1", "/workspace/.scratch")
    src = tmp_path / "f"
    src.write_text("x")
    with pytest.raises(errors.PathRefused) as e:  # the profile's refusal, as the family's member of kind "path"
        c.upload(str(src), path)
    assert "/workspace" in str(e.value)
    with pytest.raises(errors.PathRefused) as e:
        c.download(path, str(tmp_path / "g"))
    if path.startswith("/"):
        assert "outside /workspace" in str(e.value) and path in str(e.value) and "/workspace/.scratch" in str(e.value)
    assert not os.path.exists(tmp_path / "g")


class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("code, details, error", [
    (grpc.StatusCode.NOT_FOUND, "no such file", errors.NotFound),
    (grpc.StatusCode.INTERNAL, 'download status 404: {"code":404}', errors.NotFound),
    (grpc.StatusCode.INTERNAL, "disk on fire", errors.SandboxError),
    (grpc.StatusCode.PERMISSION_DENIED, 'path outside workspace: "/etc/x"', errors.Denied),
    (grpc.StatusCode.UNAVAILABLE, "reset", errors.GuestUnavailable),
])
def test_transfer_error_mapping(code, details, error):
    e = ac.transfer_error(FakeRpcError(code, details), "/workspace/x", "sess-1", "download")
    assert e.__class__ is error
    assert "sess-1" in str(e)
