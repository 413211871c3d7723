"""microvm.sandbox.checkpoint retake: a rerun on a kept session takes its labelled checkpoint again."""
from ansible_collections.microvm.sandbox.plugins.modules import checkpoint

MAIN = checkpoint.main


def test_retake_takes_a_new_checkpoint_and_deletes_the_older_ones_with_the_label(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    first = run_module(MAIN, {"session": "web-1", "label": "deps"}).result["checkpoint"]
    other = run_module(MAIN, {"session": "web-1", "label": "other"}).result["checkpoint"]
    run = run_module(MAIN, {"session": "web-1", "label": "deps", "retake": True}, diff=True)
    assert run.result["changed"] is True
    new = run.result["checkpoint"]
    assert new["checkpoint_id"] != first["checkpoint_id"] and new["label"] == "deps"
    assert run.result["replaced"] == [first["checkpoint_id"]]
    assert run.result["diff"]["before"]["checkpoint_id"] == first["checkpoint_id"]
    left = [(cp["checkpoint_id"], cp["label"]) for cp in fake_plane.checkpoints[s["session_id"]]]
    assert left == [(new["checkpoint_id"], "deps"), (other["checkpoint_id"], "other")]
    # and without retake the label finds the new one
    again = run_module(MAIN, {"session": "web-1", "label": "deps"})
    assert again.result["changed"] is False and again.result["checkpoint"]["checkpoint_id"] == new["checkpoint_id"]


def test_retake_with_no_checkpoint_yet_just_takes_one(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    run = run_module(MAIN, {"session": "web-1", "label": "deps", "retake": True})
    assert run.result["changed"] is True and run.result["replaced"] == []
    assert len(fake_plane.checkpoints[s["session_id"]]) == 1


def test_retake_in_check_mode_changes_nothing_and_says_what_it_would_replace(run_module, fake_plane):
    s = fake_plane.add_session("web-1")
    first = run_module(MAIN, {"session": "web-1", "label": "deps"}).result["checkpoint"]
    before = len(fake_plane.mutating_calls())
    run = run_module(MAIN, {"session": "web-1", "label": "deps", "retake": True}, check=True)
    assert run.result["changed"] is True and run.result["replaced"] == [first["checkpoint_id"]]
    assert len(fake_plane.mutating_calls()) == before
    assert [cp["checkpoint_id"] for cp in fake_plane.checkpoints[s["session_id"]]] == [first["checkpoint_id"]]


def test_retake_keeps_the_old_checkpoint_when_the_new_one_failed(run_module, fake_plane, monkeypatch):
    s = fake_plane.add_session("web-1")
    first = run_module(MAIN, {"session": "web-1", "label": "deps"}).result["checkpoint"]
    taken = fake_plane._post_sessions_x_checkpoints

    def failing(parts, body, query):
        out = taken(parts, body, query)
        out["checkpoint"]["status"] = "FAILED"
        return out
    monkeypatch.setattr(fake_plane, "_post_sessions_x_checkpoints", failing)
    run = run_module(MAIN, {"session": "web-1", "label": "deps", "retake": True})
    assert run.result["replaced"] == []
    assert first["checkpoint_id"] in [cp["checkpoint_id"] for cp in fake_plane.checkpoints[s["session_id"]]]


def test_retake_needs_a_label_and_present(run_module, fake_plane):
    fake_plane.add_session("web-1")
    for args in ({"session": "web-1", "retake": True},
                 {"session": "web-1", "label": "deps", "state": "absent", "retake": True}):
        run = run_module(MAIN, args)
        assert run.failed and "retake needs state: present and a label" in run.result["msg"]
