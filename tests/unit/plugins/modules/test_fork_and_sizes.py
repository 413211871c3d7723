"""microvm.sandbox.session_fork and size_info against the fake plane."""
import pytest

from ansible_collections.microvm.sandbox.plugins.modules import session_fork, size_info

FORK = session_fork.main


def test_fork_then_unchanged_by_lineage(run_module, fake_plane):
    src = fake_plane.add_session("base")
    first = run_module(FORK, {"source": "base", "count": 3}, diff=True)
    assert first.result["changed"] is True
    assert first.result["names"] == ["base-fork-1", "base-fork-2", "base-fork-3"]
    assert first.result["created"] == first.result["names"]
    assert all(s["parent_session_id"] == src["session_id"] for s in first.result["sessions"])
    assert first.result["diff"] == {"before": {"forks": []}, "after": {"forks": first.result["names"]}}
    again = run_module(FORK, {"source": "base", "count": 3})
    assert again.result["changed"] is False and again.result["names"] == first.result["names"]
    assert len([c for c in fake_plane.mutating_calls() if c[1].endswith("/fork")]) == 1


def test_fork_tops_up_to_count(run_module, fake_plane):
    fake_plane.add_session("base")
    run_module(FORK, {"source": "base", "count": 1})
    run = run_module(FORK, {"source": "base", "count": 3})
    assert run.result["changed"] is True and len(run.result["sessions"]) == 3 and len(run.result["created"]) == 2


def test_fork_from_a_checkpoint_label(run_module, fake_plane):
    src = fake_plane.add_session("base")
    fake_plane._post_sessions_x_checkpoints(["sessions", src["session_id"], "checkpoints"], {"label": "deps"}, {})
    cp = fake_plane.checkpoints[src["session_id"]][0]
    run = run_module(FORK, {"source": "base", "checkpoint": "deps", "count": 2})
    assert run.result["checkpoint"]["checkpoint_id"] == cp["checkpoint_id"]
    assert all(s["fork_from_checkpoint_id"] == cp["checkpoint_id"] for s in run.result["sessions"])
    # Forks of the same source from another checkpoint (or from now) are not these.
    other = run_module(FORK, {"source": "base", "count": 1})
    assert other.result["changed"] is False  # any fork of the source counts when no checkpoint is named


def test_fork_check_mode_and_bad_count(run_module, fake_plane):
    fake_plane.add_session("base")
    run = run_module(FORK, {"source": "base", "count": 2}, check=True)
    assert run.result["changed"] is True and run.result["created"] == ["base-fork-1", "base-fork-2"]
    assert fake_plane.mutating_calls() == []
    bad = run_module(FORK, {"source": "base", "count": 5})
    assert bad.failed and "count must be from 1 to 4" in bad.result["msg"]
    missing = run_module(FORK, {"source": "nope"})
    assert missing.failed and "nope" in missing.result["msg"]


def test_check_mode_predicts_the_lowest_free_numbers_like_a_real_run(run_module, fake_plane):
    """With fork-1 deleted and fork-3 taken by an unrelated session, the plane picks 1 and 4: so does check mode."""
    src = fake_plane.add_session("base")
    fake_plane.add_session("base-fork-2", parent_session_id=src["session_id"])
    fake_plane.add_session("BASE-FORK-3")                       # not a fork, but its name is taken (any case)
    fake_plane.add_session("base-fork-1", status="DESTROYED")   # gone: its name is free again
    run = run_module(FORK, {"source": "base", "count": 3}, check=True)
    assert run.result["created"] == ["base-fork-1", "base-fork-4"]
    assert run.result["names"] == ["base-fork-2", "base-fork-1", "base-fork-4"]


def test_two_fork_tasks_on_one_source_share_the_count_unless_their_checkpoints_differ(run_module, fake_plane):
    """What the module docs promise: lineage is the identity, so unrelated tasks see each other's forks."""
    src = fake_plane.add_session("base")
    for label in ("lint", "test"):
        fake_plane._post_sessions_x_checkpoints(["sessions", src["session_id"], "checkpoints"], {"label": label}, {})
    assert len(run_module(FORK, {"source": "base", "count": 3}).result["created"]) == 3
    assert run_module(FORK, {"source": "base", "count": 2}).result["changed"] is False   # 3 forks already
    assert len(run_module(FORK, {"source": "base", "count": 4}).result["created"]) == 1  # tops up to 4
    # Forks from a checkpoint are counted apart: each labelled fan-out keeps its own count.
    lint = run_module(FORK, {"source": "base", "checkpoint": "lint", "count": 2})
    test = run_module(FORK, {"source": "base", "checkpoint": "test", "count": 2})
    assert len(lint.result["created"]) == 2 and len(test.result["created"]) == 2
    ids = [set(s["session_id"] for s in r.result["sessions"]) for r in (lint, test)]
    assert not ids[0] & ids[1]
    run_module(FORK, {"source": "base", "checkpoint": "lint", "state": "absent"})
    assert run_module(FORK, {"source": "base", "checkpoint": "test", "count": 2}).result["changed"] is False


def test_predicted_names_follow_the_local_planes_rule():
    """The module's prediction and the plane's own naming are two copies of one rule: keep them in step."""
    checkpoints = pytest.importorskip("microvm_localplane.checkpoints")
    cases = [("base", []), ("base", ["base-fork-1", "base-fork-3"]), ("x" * 64, []), ("a" * 57 + "-._b", []),
             ("n" * 59 + ".", ["N" * 59 + "-fork-1"]), ("box", ["BOX-FORK-1", "box-fork-2"])]
    for parent, taken in cases:
        plane_names, used = [], set(t.lower() for t in taken)
        for _i in range(4):
            name = checkpoints.fork_name(parent, lambda n, u=used: n.lower() in u)
            used.add(name.lower())
            plane_names.append(name)
        assert session_fork.fork_names(parent, taken, 4) == plane_names, (parent, taken)
        assert all(len(n) <= 64 for n in plane_names)


def test_fork_absent_deletes_the_forks(run_module, fake_plane):
    fake_plane.add_session("base")
    run_module(FORK, {"source": "base", "count": 2})
    gone = run_module(FORK, {"source": "base", "state": "absent"})
    assert gone.result["changed"] is True and gone.result["sessions"] == []
    assert run_module(FORK, {"source": "base", "state": "absent"}).result["changed"] is False


def test_size_info(run_module, fake_plane):
    run = run_module(size_info.main, {})
    assert run.result["slugs"] == ["mars-2vcpu-4gb"] and run.result["changed"] is False
    assert run_module(size_info.main, {"slug": "mars-2vcpu-4gb"}).result["sizes"][0]["vcpus"] == 2
    bad = run_module(size_info.main, {"slug": "small"})
    assert bad.failed and "mars-2vcpu-4gb" in bad.result["msg"]


@pytest.mark.parametrize("prefix", ["/v2/harness-runtime", "/v2/agents"])
def test_an_unknown_size_names_the_catalog_route_of_the_prefix_in_use(run_module, fake_plane, prefix):
    bad = run_module(size_info.main, {"slug": "small", "route_prefix": prefix})
    assert bad.failed and "(GET %s/sessions/sandbox/sizes)" % prefix in bad.result["msg"], bad.result["msg"]
    other = "/v2/agents" if prefix == "/v2/harness-runtime" else "/v2/harness-runtime"
    assert other not in bad.result["msg"]


@pytest.mark.parametrize("prefix", ["/v2/harness-runtime", "/v2/agents"])
def test_a_create_refused_for_its_size_points_at_the_catalog_of_the_prefix_in_use(run_module, fake_plane, prefix):
    from ansible_collections.microvm.sandbox.plugins.modules import session
    fake_plane.fail_next.append(("POST", "/sessions", 400, "unknown size 'small'"))
    bad = run_module(session.main, {"name": "web-1", "size": "small", "route_prefix": prefix})
    msg = bad.result["msg"]
    assert bad.failed and bad.result["http_status"] == 400 and "unknown size 'small'" in msg, msg
    assert "microvm.sandbox.size_info (GET %s/sessions/sandbox/sizes)" % prefix in msg, msg
    other = "/v2/agents" if prefix == "/v2/harness-runtime" else "/v2/harness-runtime"
    assert other not in msg


def test_a_create_refused_for_something_else_gets_no_size_advice(run_module, fake_plane):
    from ansible_collections.microvm.sandbox.plugins.modules import session
    fake_plane.fail_next.append(("POST", "/sessions", 400, "unknown agent 'none'"))
    bad = run_module(session.main, {"name": "web-1", "size": "mars-2vcpu-4gb"})
    assert bad.failed and "size_info" not in bad.result["msg"], bad.result["msg"]


def test_a_fork_of_the_session_now_is_refused_while_credentials_are_staged(run_module, fake_plane):
    src = fake_plane.add_session("base")
    fake_plane.staged[src["session_id"]] = ["/workspace/.scratch/credentials.abc"]
    run = run_module(FORK, {"source": "base", "count": 1}, check=True)
    assert run.failed and "/workspace/.scratch/credentials.abc" in run.result["msg"], run.result
    assert run.result["staged_credentials"] == ["/workspace/.scratch/credentials.abc"]
    run = run_module(FORK, {"source": "base", "count": 1})
    assert run.failed and not [c for c in fake_plane.mutating_calls() if c[1].endswith("/fork")]
    # a fork from an existing checkpoint copies that checkpoint, not the session now: no check
    fake_plane._post_sessions_x_checkpoints(["sessions", src["session_id"], "checkpoints"], {"label": "deps"}, {})
    execs = len(fake_plane.execs)
    assert not run_module(FORK, {"source": "base", "checkpoint": "deps", "count": 1}).failed
    assert len(fake_plane.execs) == execs
    assert not run_module(FORK, {"source": "base", "count": 1, "check_staged_credentials": False}).failed
    assert len(fake_plane.execs) == execs
    fake_plane.staged.clear()
    assert not run_module(FORK, {"source": "base", "count": 2}).failed
