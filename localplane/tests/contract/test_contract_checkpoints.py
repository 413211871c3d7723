"""Checkpoints, rollback and fork: files are restored exactly, ids behave as on the platform."""
import threading
import time
import uuid

import pytest

from contract_support import error_message, local_only, run_exec


def write(stub, path, text):
    assert run_exec(stub, ["sh", "-c", 'mkdir -p "$(dirname "$1")" && printf %s "$2" > "$1"', "sh", path, text])[0] == 0


def read(stub, path):
    code, out, _err = run_exec(stub, ["cat", path])
    return out.decode() if code == 0 else None


def test_checkpoint_create_list_get_delete(plane, api, sandbox):
    sid = sandbox["session_id"]
    client = plane.client()
    first = client.create_checkpoint(sid, label="first")
    second = client.create_checkpoint(sid)
    for cp in (first, second):
        assert cp["status"] == "READY"
        assert cp["session_id"] == sid
        assert set(cp) >= {"checkpoint_id", "session_id", "status", "label", "size_bytes", "created_at"}
    assert first["label"] == "first"
    listed = [c["checkpoint_id"] for c in client.list_checkpoints(sid)]
    assert listed[:2] == [second["checkpoint_id"], first["checkpoint_id"]]
    page = api.call("GET", "/sessions/%s/checkpoints" % sid, params={"page_size": 1}).json()
    assert len(page["checkpoints"]) == 1 and page["next_page_token"]
    assert client.get_checkpoint(sid, first["checkpoint_id"])["label"] == "first"
    assert api.call("DELETE", "/sessions/%s/checkpoints/%s" % (sid, first["checkpoint_id"])).status_code in (200, 204)
    # Deleting what is already gone succeeds.
    assert api.call("DELETE", "/sessions/%s/checkpoints/%s" % (sid, first["checkpoint_id"])).status_code in (200, 204)
    assert api.call("GET", "/sessions/%s/checkpoints/%s" % (sid, first["checkpoint_id"])).status_code == 404


def test_checkpoint_refuses_unknown_keys(api, sandbox):
    resp = api.call("POST", "/sessions/%s/checkpoints" % sandbox["session_id"], json={"lable": "typo"})
    assert resp.status_code == 400
    assert "lable" in error_message(resp)


def test_rollback_restores_files_exactly_with_a_new_sandbox(plane, api, sandbox, agent):
    sid = sandbox["session_id"]
    client = plane.client()
    stub = agent(sid)
    write(stub, "/workspace/keep.txt", "before")
    cp = client.create_checkpoint(sid, label="before")
    write(stub, "/workspace/keep.txt", "after")
    write(stub, "/workspace/new.txt", "created after the checkpoint")
    old_sandbox = client.get_session(sid)["sandbox_id"]
    rolled = client.rollback(sid, cp["checkpoint_id"])
    assert rolled["session_id"] == sid
    ready = client.wait_session(sid)
    assert ready["sandbox_id"] and ready["sandbox_id"] != old_sandbox
    stub = agent(sid)
    assert read(stub, "/workspace/keep.txt") == "before"
    assert read(stub, "/workspace/new.txt") is None


def test_rollback_works_on_a_paused_session(plane, api, sandbox, agent):
    sid = sandbox["session_id"]
    client = plane.client()
    write(agent(sid), "/workspace/p.txt", "one")
    cp = client.create_checkpoint(sid)
    write(agent(sid), "/workspace/p.txt", "two")
    client.pause_session(sid)
    api.wait(sid, ("PAUSED",))
    client.rollback(sid, cp["checkpoint_id"])
    client.wait_session(sid)
    assert read(agent(sid), "/workspace/p.txt") == "one"


def test_rollback_to_an_unknown_checkpoint_is_404(api, sandbox):
    resp = api.call("POST", "/sessions/%s/checkpoints/%s/rollback" % (sandbox["session_id"], uuid.uuid4()), json={})
    assert resp.status_code == 404


def test_checkpoint_of_an_unknown_session_is_404(api):
    assert api.call("POST", "/sessions/%s/checkpoints" % uuid.uuid4(), json={}).status_code == 404


@pytest.mark.parametrize("count", [0, 5, -1, "two"])
def test_fork_count_outside_1_to_4_is_400(api, sandbox, count):
    resp = api.call("POST", "/sessions/%s/fork" % sandbox["session_id"], json={"count": count})
    assert resp.status_code == 400


def test_fork_from_an_unknown_checkpoint_creates_nothing(api, sandbox):
    # Which sessions, not how many: another test's session may be deleted meanwhile on the same plane.
    def ids():
        return {s["session_id"] for s in api.call("GET", "/sessions", params={"page_size": 200}).json()["sessions"]}

    before = ids()
    body = {"from_checkpoint_id": str(uuid.uuid4()), "count": 2}
    resp = api.call("POST", "/sessions/%s/fork" % sandbox["session_id"], json=body)
    assert resp.status_code in (400, 404)
    assert ids() - before == set()


# A file outside /workspace: a change to the root filesystem, which a fork must carry too.
ROOT_FILE = "/var/lib/microvm-fork-test/marker"


def test_fork_copies_the_workspace_and_root_changes_with_lineage(plane, api, sandbox, agent):
    sid = sandbox["session_id"]
    client = plane.client()
    write(agent(sid), "/workspace/f.txt", "at checkpoint")
    write(agent(sid), ROOT_FILE, "root at checkpoint")
    cp = client.create_checkpoint(sid)
    write(agent(sid), "/workspace/f.txt", "later")
    children = client.fork_session(sid, count=2, from_checkpoint_id=cp["checkpoint_id"])
    try:
        assert len(children) == 2
        assert len(set(c["fork_id"] for c in children)) == 1 and children[0]["fork_id"]
        for child in children:
            assert child["parent_session_id"] == sid
            assert child["fork_from_checkpoint_id"] == cp["checkpoint_id"]
            assert child["session_id"] != sid
            client.wait_session(child["session_id"])
            assert read(agent(child["session_id"]), "/workspace/f.txt") == "at checkpoint"
            assert read(agent(child["session_id"]), ROOT_FILE) == "root at checkpoint"
        assert read(agent(sid), "/workspace/f.txt") == "later"
    finally:
        for child in children:
            client.delete_session(child["session_id"])


def test_fork_without_a_checkpoint_forks_from_now(plane, api, sandbox, agent):
    sid = sandbox["session_id"]
    client = plane.client()
    write(agent(sid), "/workspace/now.txt", "now")
    assert client.update_session(sid, True)["resume_on_topoff"] is True
    children = client.fork_session(sid)
    try:
        assert len(children) == 1
        child = client.wait_session(children[0]["session_id"])
        # resume_on_topoff is per session: "never inherited ... by a fork" (doctl config start-session).
        assert child["resume_on_topoff"] is False
        # An implicit checkpoint of the session "now" is captured first, and the child forks from it.
        assert child["fork_from_checkpoint_id"]
        assert read(agent(child["session_id"]), "/workspace/now.txt") == "now"
    finally:
        for c in children:
            client.delete_session(c["session_id"])


def test_fork_and_rollback_are_refused_with_a_persistent_workspace(api, make_session):
    # doctl harness-runtime workspace: "Fork and rollback are not available for a session that has a workspace."
    s = make_session(persistent_workspace=True)
    resp = api.call("POST", "/sessions/%s/fork" % s["session_id"], json={"count": 1})
    assert 400 <= resp.status_code < 500 and resp.status_code != 404, resp.text


@local_only
def test_checkpoint_while_a_command_is_in_flight_is_409(api, sandbox):
    # On the platform a "command turn" is the agent's; locally a REST exec in progress stands for it.
    sid = sandbox["session_id"]
    done = {}

    def slow_command():
        done["r"] = api.call("POST", "/sessions/%s/sandbox/exec" % sid, json={"argv": ["sleep", "3"]})
    t = threading.Thread(target=slow_command)
    t.start()
    time.sleep(1)
    resp = api.call("POST", "/sessions/%s/checkpoints" % sid, json={})
    t.join()
    assert resp.status_code == 409, resp.text
    assert done["r"].status_code == 200
    assert api.call("POST", "/sessions/%s/checkpoints" % sid, json={}).status_code == 200
