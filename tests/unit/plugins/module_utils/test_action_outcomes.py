"""The sync and workspace_archive actions give a lost connection the one outcome (_worker/outcomes.py): UNREACHABLE.

One layer: the action plugin with a stand-in connection; the real stack is in tests/integration.
"""
import io
import tarfile
import types

import pytest
from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.parsing.dataloader import DataLoader
from ansible.playbook.play_context import PlayContext
from ansible.playbook.task import Task

from ansible_collections.microvm.sandbox.plugins.action import workspace_archive


class Conn:
    """A connection whose archive upload fails as the agent connection reports it."""

    transport = "microvm.sandbox.agent"

    def __init__(self, error):
        self.error = error
        self._shell = types.SimpleNamespace(tmpdir="/workspace/.scratch/t")

    def put_archive(self, src, dest):
        raise self.error


def run_action(tmp_path, error):
    tar = tmp_path / "a.tar"
    with tarfile.open(tar, "w") as t:
        info = tarfile.TarInfo("f")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    task = Task()
    task.args = {"src": str(tar), "dest": "/workspace/restored"}
    action = workspace_archive.ActionModule(task, Conn(error), PlayContext(), loader=DataLoader(), templar=None,
                                            shared_loader_obj=None)
    return action.run(task_vars={})


def test_a_lost_connection_during_the_upload_makes_the_host_unreachable(tmp_path):
    lost = AnsibleConnectionFailure("microvm.sandbox.agent: lost the command on session box; session box is DESTROYED")
    with pytest.raises(AnsibleConnectionFailure) as e:
        run_action(tmp_path, lost)
    assert e.value is lost


def test_a_refused_archive_fails_the_task(tmp_path):
    result = run_action(tmp_path, AnsibleError("microvm.sandbox.agent: the guest agent refused to extract an archive"))
    assert result["failed"] and "the sandbox refused or failed to extract" in result["msg"], result
    assert result["changed"] is False
