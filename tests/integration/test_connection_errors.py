"""The error vocabulary through the real stack: worker's mux client -> mux -> both roads -> local plane -> guest.

Each failure reaches the worker as its kind's class (_shared/errors.py), whatever the guest's tools print, and
the one mapping (_worker/outcomes.py) gives its task outcome.
"""
import os

import pytest
from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import outcomes
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient
from microvm_plane_testing import run_transport, stop_muxes

# a run as the worker names one: its pid and that pid's start time (a wrong start reads as a run that ended,
# whose dir the mux removes while the test still stages through it)
THIS_START = str(mp.process_start_time(os.getpid()))


@pytest.fixture(params=["agent", "api"])
def client(request, plane, sandbox, tmp_path):
    """A mux client attached to the sandbox through one road; its mux is stopped afterwards."""
    if request.param == "agent" and run_transport() == "api":
        pytest.skip("agent road only: the api run closes the agent port (the api road's cases run there)")
    mux_dir = str(tmp_path / "mux")
    cfg = LinkConfig(session=sandbox["name"], token=plane.token, api_url=plane.url, persist=30,
                     transport=request.param)
    mux = MuxClient(mux_dir, cfg).connect()
    yield mux
    mux.close()
    stop_muxes(mux_dir)


def test_staged_fetch_of_a_missing_file_is_not_found_by_exit_code(client, tmp_path):
    """Outside /workspace a fetch is staged by a helper command: its exit code, not cp's words, says not found."""
    run = {"id": "errors-test-%d" % os.getpid(), "pid": os.getpid(), "start": THIS_START,
           "dir": "/workspace/.scratch/run.errors-test-%d" % os.getpid()}
    with pytest.raises(errors.NotFound) as e:
        client.fetch("/etc/no-such-file-here", str(tmp_path / "x"), run=run)
    assert "cannot fetch /etc/no-such-file-here" in str(e.value) and "no such file" in str(e.value)
    assert isinstance(outcomes.ansible_error(e.value, "microvm.sandbox.agent"), AnsibleFileNotFound)
    assert not (tmp_path / "x").exists()
    # a directory is no missing file: a plain failure, with the guest's own words as its message
    with pytest.raises(errors.SandboxError) as e:
        client.fetch("/etc", str(tmp_path / "x"), run=run)
    assert e.value.kind == errors.ERR_FAILED and "cannot stage /etc" in str(e.value)
    mapped = outcomes.ansible_error(e.value, "microvm.sandbox.agent")
    assert mapped.__class__ is AnsibleError  # exactly: no subclass such as AnsibleConnectionFailure


def test_staged_put_into_a_missing_directory_says_so(client, tmp_path):
    src = tmp_path / "f"
    src.write_text("x")
    run = {"id": "errors-put-%d" % os.getpid(), "pid": os.getpid(), "start": THIS_START,
           "dir": "/workspace/.scratch/run.errors-put-%d" % os.getpid()}
    with pytest.raises(errors.NotFound, match="cannot put /opt/no-such-dir/f into session .*its directory does not exist"):
        client.put(str(src), "/opt/no-such-dir/f", run=run)
    assert client.exec(["test", "-e", "/opt/no-such-dir"])[0] == 1  # nothing was made on the way


def test_a_path_the_profile_refuses_is_a_path_error_and_a_task_failure(client, tmp_path):
    src = tmp_path / "a.tar"
    src.write_bytes(b"")
    with pytest.raises(errors.PathRefused, match="outside /workspace") as e:
        client.put_archive(str(src), "/etc")  # archives are never staged: refused before any call
    assert not isinstance(outcomes.ansible_error(e.value, "microvm.sandbox.agent"), AnsibleConnectionFailure)


def test_a_session_deleted_under_the_link_is_gone_and_unreachable(plane, client):
    plane.client().delete_session(client.attached["session_id"])
    with pytest.raises(errors.SandboxError) as e:
        for _attempt in range(3):  # the link may take a command before it sees the session go
            client.exec(["true"])
    assert outcomes.outcome(e.value.kind) == outcomes.UNREACHABLE, e.value
    assert outcomes.ansible_error(e.value, "microvm.sandbox.agent").__class__ is AnsibleConnectionFailure
