"""microvm.sandbox.checkpoint and checkpoint_info against the fake plane."""
from ansible_collections.microvm.sandbox.plugins.modules import checkpoint, checkpoint_info

MAIN = checkpoint.main


def test_present_is_idempotent_by_label(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    first = run_module(MAIN, {"session": "web-1", "label": "deps"}, diff=True)
    assert first.result["changed"] is True
    assert first.result["checkpoint"]["label"] == "deps"
    assert first.result["diff"]["before"] == {}
    second = run_module(MAIN, {"session": s["session_id"], "label": "deps"})
    assert second.result["changed"] is False
    assert second.result["checkpoint"]["checkpoint_id"] == first.result["checkpoint"]["checkpoint_id"]
    assert len(fake_plane.checkpoints[s["session_id"]]) == 1


def test_failed_checkpoint_with_the_label_is_replaced(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    fake_plane.checkpoints[s["session_id"]].append(dict(checkpoint_id="c0", label="deps", status="FAILED"))
    assert run_module(MAIN, {"session": "web-1", "label": "deps"}).result["changed"] is True


def test_check_mode_creates_nothing(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    run = run_module(MAIN, {"session": "web-1", "label": "deps"}, check=True)
    assert run.result["changed"] is True
    assert fake_plane.checkpoints[s["session_id"]] == []


def test_rollback_always_changes_and_waits(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    cp = run_module(MAIN, {"session": "web-1", "label": "deps"}).result["checkpoint"]
    for args in ({"label": "deps"}, {"checkpoint_id": cp["checkpoint_id"]}):
        run = run_module(MAIN, dict(args, session="web-1", state="rolled_back"), diff=True)
        assert run.result["changed"] is True
        assert run.result["session"]["status"] == "SESSION_STATUS_READY"
        assert run.result["diff"]["before"]["sandbox_id"] != run.result["diff"]["after"]["sandbox_id"]
    before = len(fake_plane.mutating_calls())
    check = run_module(MAIN, {"session": "web-1", "label": "deps", "state": "rolled_back"}, check=True)
    assert check.result["changed"] is True and len(fake_plane.mutating_calls()) == before
    assert s["session_id"] == run.result["session"]["session_id"]


def test_rollback_to_unknown_label_names_it(run_module, fake_plane):
    fake_plane.add_session("web-1")
    run = run_module(MAIN, {"session": "web-1", "label": "nope", "state": "rolled_back"})
    assert run.failed
    assert "No checkpoint with id or name 'nope'" in run.result["msg"]
    assert "web-1" in run.result["msg"]


def test_unknown_session_names_it(run_module, fake_plane):
    run = run_module(MAIN, {"session": "ghost", "label": "x"})
    assert run.failed
    assert "No session with id or name 'ghost'" in run.result["msg"]
    run = run_module(checkpoint_info.main, {"session": "ghost"})
    assert run.failed and "'ghost'" in run.result["msg"]


def test_absent_by_label_and_id(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    a = run_module(MAIN, {"session": "web-1", "label": "a"}).result["checkpoint"]
    run_module(MAIN, {"session": "web-1", "label": "b"})
    run = run_module(MAIN, {"session": "web-1", "label": "b", "state": "absent"}, diff=True)
    assert run.result["changed"] is True and run.result["diff"]["after"] == {}
    assert run_module(MAIN, {"session": "web-1", "label": "b", "state": "absent"}).result["changed"] is False
    assert run_module(MAIN, {"session": "web-1", "checkpoint_id": a["checkpoint_id"], "state": "absent"}
                      ).result["changed"] is True
    assert fake_plane.checkpoints[s["session_id"]] == []


def test_argument_rules(run_module, fake_plane):
    fake_plane.add_session("web-1")
    run = run_module(MAIN, {"session": "web-1", "state": "rolled_back"})
    assert run.failed and "checkpoint_id" in run.result["msg"] and "label" in run.result["msg"]
    run = run_module(MAIN, {"session": "web-1", "state": "absent", "label": "a", "checkpoint_id": "b"})
    assert run.failed and "mutually exclusive" in run.result["msg"]
    run = run_module(MAIN, {"session": "web-1", "checkpoint_id": "b"})
    assert run.failed and "use label" in run.result["msg"]


def test_checkpoint_info(run_module, fake_plane):
    fake_plane.add_session("web-1")
    for label in ("a", "b", "a", "c"):
        run_module(MAIN, {"session": "web-1", "label": label + "-x" if label == "c" else label})
    run = run_module(checkpoint_info.main, {"session": "web-1"})
    assert [c["label"] for c in run.result["checkpoints"]] == ["c-x", "b", "a"]  # newest first, paged
    run = run_module(checkpoint_info.main, {"session": "web-1", "label": "a"})
    assert len(run.result["checkpoints"]) == 1
    run = run_module(checkpoint_info.main, {"session": "web-1", "checkpoint_id": "nope"})
    assert run.result["checkpoints"] == [] and not run.failed
