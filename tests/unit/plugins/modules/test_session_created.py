"""microvm.sandbox.session reports `created` (what the cleanup callback reads) and predicts a new session in check
mode without made-up ids; the callback's reading of task results."""
from microvm_fake_plane import FakeClient

from ansible_collections.microvm.sandbox.plugins.callback.cleanup import created_sessions
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import WaitTimeout
from ansible_collections.microvm.sandbox.plugins.modules import session as session_module

MAIN = session_module.main


def test_created_only_when_this_task_created_it(run_module, fake_plane):
    first = run_module(MAIN, {"name": "web-1"})
    assert first.result["created"] is True and first.result["session"]["session_id"]
    again = run_module(MAIN, {"name": "web-1", "state": "running"})
    assert again.result["created"] is False
    gone = run_module(MAIN, {"name": "web-1", "state": "absent"})
    assert gone.result["changed"] is True and gone.result["created"] is False


def test_recreate_is_created(run_module, fake_plane):
    fake_plane.add_session("web-1", idle_timeout_seconds=600)
    run = run_module(MAIN, {"name": "web-1", "idle_timeout": "5m", "recreate": True})
    assert run.result["created"] is True


def test_a_failure_after_the_create_still_says_created(run_module, fake_plane, monkeypatch):
    def never_ready(self, session_id, **kwargs):
        raise WaitTimeout("session %s did not become usable" % session_id, last=fake_plane.sessions[session_id],
                          status="PROVISIONING", timeout=1, what="session")
    monkeypatch.setattr(FakeClient, "wait_session", never_ready)
    run = run_module(MAIN, {"name": "web-1"})
    assert run.failed and run.result.get("created") is True, run.result
    sid = run.result["session"]["session_id"]
    assert sid in fake_plane.sessions


def test_check_mode_predicts_what_it_can_and_no_ids(run_module, fake_plane):
    run = run_module(MAIN, {"name": "web-1", "idle_timeout": "5m", "persistent_workspace": True}, check=True)
    predicted = run.result["session"]
    assert run.result["created"] is True and fake_plane.sessions == {}
    assert predicted["name"] == "web-1" and predicted["status"] == "SESSION_STATUS_READY"
    assert predicted["parent_session_id"] == "" and predicted["fork_from_checkpoint_id"] == ""
    for unknown in ("session_id", "sandbox_id", "created_at", "workspace_id"):
        assert unknown not in predicted
    assert not any("known after" in str(v) for v in predicted.values())


def test_callback_reads_created_sessions_from_results():
    made = {"session_id": "s1", "name": "a"}
    assert created_sessions("microvm.sandbox.session", {"created": True, "session": made}) == [made]
    assert created_sessions("microvm.sandbox.session", {"created": False, "session": made}) == []
    # check mode: created, but no id yet
    assert created_sessions("microvm.sandbox.session", {"created": True, "session": {"name": "a"}}) == []
    forks = [{"session_id": "f1", "name": "a-fork-1"}, {"session_id": "f2", "name": "a-fork-2"}]
    assert created_sessions("microvm.sandbox.session_fork", {"created": ["a-fork-2"], "sessions": forks}) == [forks[1]]
    assert created_sessions("microvm.sandbox.session_fork", {"created": ["a-fork-3"],
                                                             "sessions": [{"name": "a-fork-3"}]}) == []
