"""Big transfers on the bulk line (one socket: gRPC over h2 over the port-forward's WebSocket), through the real stack.

worker's mux client -> mux -> bulk line -> local plane's port-forward -> guest agent, and the same through a
playbook. Each test fails when a big transfer does not take the bulk line (the mux says which path carried it),
and MICROVM_MUX_BULK=off sends the same transfers through the gRPC channel.
"""
import hashlib
import io
import os
import tarfile

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient, pool_status
from microvm_plane_testing import run_transport
# fixtures re-used from test_connection
from test_connection import env, inventory, mux_dir  # noqa: F401  # pylint: disable=unused-import

# a run as the worker names one: its pid and that pid's start time (a wrong start reads as a run that ended,
# whose dir the mux removes while the test still stages through it)
THIS_START = str(mp.process_start_time(os.getpid()))

pytestmark = pytest.mark.skipif(run_transport() == "api", reason="agent road only: the api run closes the agent port")

BIG = 9 * 1024 * 1024 + 123  # over a chunk, a frame and a WebSocket message, and not a multiple of any


def attach(plane, sandbox, directory):
    cfg = LinkConfig(session=sandbox["name"], token=plane.token, api_url=plane.url, persist=30, transport="agent")
    return MuxClient(directory, cfg).connect()


def sha(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def moved(directory, sandbox):
    counts = {}
    for status in pool_status(directory).values():
        for via, n in status.get("moved_by_session", {}).get(sandbox["session_id"], {}).items():
            counts[via] = counts.get(via, 0) + n
    return counts


def test_big_put_and_fetch_take_the_bulk_line(plane, sandbox, mux_dir, tmp_path):  # noqa: F811
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(BIG))
    mux = attach(plane, sandbox, mux_dir)
    try:
        put = mux.put(str(src), "/workspace/bulk/big.bin")
        assert put == {"bytes": BIG, "staged": False, "via": "bulk"}, put
        back = mux.fetch("/workspace/bulk/big.bin", str(tmp_path / "back.bin"))
        assert back["via"] == "bulk" and back["bytes"] == BIG, back
        assert sha(tmp_path / "back.bin") == sha(src)
        # outside /workspace: staged through the run's dir, the bytes still on the bulk line
        run = {"id": "bulk-%d" % os.getpid(), "pid": os.getpid(), "start": THIS_START,
               "dir": "/workspace/.scratch/run.bulk-%d" % os.getpid()}
        staged = mux.put(str(src), "/root/big.bin", run=run)
        assert staged["staged"] and staged["via"] == "bulk", staged
        out = mux.fetch("/root/big.bin", str(tmp_path / "staged.bin"), run=run)
        assert out["staged"] and out["via"] == "bulk" and sha(tmp_path / "staged.bin") == sha(src), out
        # a small put rides an idle line when there is one; an empty file too
        (tmp_path / "empty").write_bytes(b"")
        empty = mux.put(str(tmp_path / "empty"), "/workspace/bulk/empty")
        assert empty == {"bytes": 0, "staged": False, "via": "bulk"}, empty
        assert mux.fetch("/workspace/bulk/empty", str(tmp_path / "empty.back"))["bytes"] == 0
        assert (tmp_path / "empty.back").read_bytes() == b""
    finally:
        mux.close()
    assert moved(mux_dir, sandbox) == {"put_via_bulk": 3, "fetch_via_bulk": 3}


def test_an_archive_is_extracted_from_the_bulk_line(plane, sandbox, mux_dir, tmp_path):  # noqa: F811
    buf = io.BytesIO()
    payload = os.urandom(3 * 1024 * 1024)
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("tree/data.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "tree.tar").write_bytes(buf.getvalue())
    mux = attach(plane, sandbox, mux_dir)
    try:
        done = mux.put_archive(str(tmp_path / "tree.tar"), "/workspace/bulk-archive")
        assert done["via"] == "bulk", done
        mux.fetch("/workspace/bulk-archive/tree/data.bin", str(tmp_path / "data.bin"))
        assert (tmp_path / "data.bin").read_bytes() == payload
    finally:
        mux.close()


def test_a_refusal_on_the_bulk_line_reads_like_the_channels(plane, sandbox, mux_dir, tmp_path):  # noqa: F811
    """The agent's refusals arrive as gRPC statuses in HTTP/2 trailers: the same errors as on the gRPC channel."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

    mux = attach(plane, sandbox, mux_dir)
    try:
        with pytest.raises(errors.NotFound) as e:
            mux.fetch("/workspace/no-such-file", str(tmp_path / "nothing"))
        assert "no such file" in str(e.value)
        assert not (tmp_path / "nothing").exists()
        # the line that carried the refusal carries the next transfer
        (tmp_path / "small").write_bytes(b"x" * 10)
        assert mux.put(str(tmp_path / "small"), "/workspace/bulk/small")["via"] == "bulk"
    finally:
        mux.close()


def test_the_switch_sends_big_transfers_through_the_grpc_channel(plane, sandbox, mux_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MICROVM_MUX_BULK", "off")  # read by the mux this client starts
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(BIG))
    mux = attach(plane, sandbox, mux_dir)
    try:
        assert mux.put(str(src), "/workspace/bulk/off.bin")["via"] == "grpc"
        assert mux.fetch("/workspace/bulk/off.bin", str(tmp_path / "back.bin"))["via"] == "grpc"
    finally:
        mux.close()
    assert sha(tmp_path / "back.bin") == sha(src)


PLAY = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.copy: {src: "{{ big }}", dest: /workspace/play.bin, mode: "0600"}
    - ansible.builtin.fetch: {src: /workspace/play.bin, dest: "{{ out }}/", flat: true}
"""


def test_a_playbooks_copy_and_fetch_take_the_bulk_line(plane, sandbox, env, mux_dir, tmp_path, playbook_runner):  # noqa: F811
    """put_file and fetch_file of the connection plugin, through ansible-playbook; -vvv names the path."""
    src = tmp_path / "play.bin"
    src.write_bytes(os.urandom(BIG))
    res = playbook_runner(PLAY, inventory({"box": sandbox["name"]}), env, extra_args=[
        "-vvv", "-e", "big=%s" % src, "-e", "out=%s" % (tmp_path / "out")])
    assert res.rc == 0 and "failed=0" in res.stdout, res.stdout[-4000:]
    assert sha(tmp_path / "out" / "play.bin") == sha(src)
    assert "PUT done: %d bytes over the bulk path" % BIG in res.stdout, res.stdout[-3000:]
    assert "FETCH done: %d bytes over the bulk path" % BIG in res.stdout, res.stdout[-3000:]
    assert moved(mux_dir, sandbox) == {"put_via_bulk": 1, "fetch_via_bulk": 1}
