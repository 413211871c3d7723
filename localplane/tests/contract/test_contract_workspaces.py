"""Persistent workspaces (How to Use Persistent Workspaces; doctl harness-runtime workspace; pydo delete_workspace).

A workspace is created with a size limit and an idempotency key, listed, got and deleted; it is attached
to a session created from a saved config with its workspace_id, one session at a time, and removing
that session saves the files, which a later session started with the workspace finds in /workspace.
"""
import time
import uuid

import pytest

from contract_support import error_message, local_only, run_exec, unique

FIELDS = {"workspace_id", "name", "state", "size_limit_gib", "bytes_used", "attached_session_id", "last_saved_at",
          "created_at"}


def make_workspace(api, size=1, name="", key=None):
    body = {"size_limit_gib": size}
    if name:
        body["name"] = name
    if key:
        body["idempotency_key"] = key
    return api.call("POST", "/workspaces", json=body)


def wait_state(api, wid, state, timeout=120):
    deadline = time.time() + timeout
    while True:
        ws = api.call("GET", "/workspaces/%s" % wid).json()["workspace"]
        if ws["state"] == state:
            return ws
        assert time.time() < deadline, "workspace %s stuck in %s" % (wid, ws["state"])
        time.sleep(0.1)


@pytest.fixture
def workspaces(api):
    made = []

    def make(**kw):
        resp = make_workspace(api, **kw)
        assert resp.status_code in (200, 201), resp.text
        made.append(resp.json()["workspace"]["workspace_id"])
        return resp.json()["workspace"]

    yield make
    for wid in made:
        api.call("DELETE", "/workspaces/%s" % wid)


def test_create_reports_every_field_and_is_available(workspaces):
    ws = workspaces(size=2, name="notes")
    assert set(ws) == FIELDS
    assert ws["state"] == "AVAILABLE" and ws["size_limit_gib"] == 2 and ws["name"] == "notes"
    assert ws["bytes_used"] == 0 and ws["attached_session_id"] == ""


@pytest.mark.parametrize("body,needle", [({}, "size_limit_gib is required"), ({"size_limit_gib": 0}, "1 to 100"),
                                         ({"size_limit_gib": 101}, "1 to 100"), ({"size_limit_gib": "10"}, "1 to 100"),
                                         ({"size_limit_gib": 1, "sizeLimitGib": 1}, "sizeLimitGib")])
def test_create_refuses_a_bad_body_naming_what_is_wrong(api, body, needle):
    resp = api.call("POST", "/workspaces", json=body)
    assert resp.status_code == 400
    assert needle in error_message(resp)


def test_the_same_idempotency_key_returns_the_first_workspace(api, workspaces):
    key = uuid.uuid4().hex
    first = workspaces(size=3, name="k", key=key)
    again = make_workspace(api, size=3, name="k", key=key)
    assert again.status_code == 200 and again.json()["workspace"]["workspace_id"] == first["workspace_id"]
    other = make_workspace(api, size=4, name="k", key=key)
    assert other.status_code == 409 and "other values" in error_message(other)
    # Without a key every create is a new workspace; names are labels, not unique.
    a, b = workspaces(size=1, name="same"), workspaces(size=1, name="same")
    assert a["workspace_id"] != b["workspace_id"]


def test_list_is_newest_first_filtered_by_state_and_paginated(api, workspaces):
    made = [workspaces(size=1, name="page-%d" % i)["workspace_id"] for i in range(3)]
    listed, token = [], ""
    while True:
        page = api.call("GET", "/workspaces", params={"page_size": 2, "page_token": token, "state": "AVAILABLE"})
        assert page.status_code == 200
        body = page.json()
        assert set(body) == {"workspaces", "next_page_token"}
        listed += [w["workspace_id"] for w in body["workspaces"]]
        token = body["next_page_token"]
        if not token:
            break
    assert [w for w in listed if w in made] == list(reversed(made))
    bad = api.call("GET", "/workspaces", params={"state": "READY"})
    assert bad.status_code == 400 and "AVAILABLE" in error_message(bad)


def test_get_and_delete_of_an_unknown_workspace_are_404(api):
    assert api.call("GET", "/workspaces/%s" % uuid.uuid4()).status_code == 404
    assert api.call("DELETE", "/workspaces/%s" % uuid.uuid4()).status_code == 404
    assert api.call("GET", "/workspaces/notes").status_code == 404  # names are not accepted


def config_of(api, make_session):
    """A saved config: the one a YAML create persists for its session (harness-create-session)."""
    return make_session()["config_id"]


def start_with_workspace(api, config_id, wid, name=None):
    resp = api.create({"name": name or unique(), "config_id": config_id, "workspace_id": wid},
                      content_type="application/json")
    return resp


@local_only
def test_files_persist_across_sessions_and_the_workspace_is_held_by_one(api, make_session, agent, workspaces):
    ws = workspaces(size=1, name="persist")
    wid = ws["workspace_id"]
    config_id = config_of(api, make_session)
    resp = start_with_workspace(api, config_id, wid)
    assert resp.status_code == 201, resp.text
    first = resp.json()["session"]
    assert first["workspace_id"] == wid
    first = api.wait(first["session_id"], ("READY",))
    held = api.call("GET", "/workspaces/%s" % wid).json()["workspace"]
    assert held["state"] == "ATTACHED" and held["attached_session_id"] == first["session_id"]
    # One session holds a workspace at a time; a held one cannot be deleted.
    second = start_with_workspace(api, config_id, wid)
    assert second.status_code == 409 and "one session holds a workspace at a time" in error_message(second)
    refused = api.call("DELETE", "/workspaces/%s" % wid)
    assert refused.status_code == 409 and "AVAILABLE" in error_message(refused)
    # Fork and rollback are not available for a session that has a workspace.
    assert api.call("POST", "/sessions/%s/fork" % first["session_id"], json={}).status_code in (400, 409)

    stub = agent(first["session_id"])
    code, _out, err = run_exec(stub, ["sh", "-c", "mkdir -p /workspace/notes && echo kept > /workspace/notes/a.txt"
                                      " && echo scratch > /tmp/not-kept"])
    assert code == 0, err
    assert api.call("DELETE", "/sessions/%s" % first["session_id"]).status_code == 204
    saved = wait_state(api, wid, "AVAILABLE")
    assert saved["attached_session_id"] == "" and saved["last_saved_at"] and saved["bytes_used"] >= 5

    resp = start_with_workspace(api, config_id, wid)
    assert resp.status_code == 201, resp.text
    later = api.wait(resp.json()["session"]["session_id"], ("READY",))
    try:
        code, out, _err = run_exec(agent(later["session_id"]), ["sh", "-c", "cat /workspace/notes/a.txt; "
                                                                "ls /tmp/not-kept 2>/dev/null; stat -c %U "
                                                                "/workspace/notes/a.txt"])
        assert out.decode().split() == ["kept", "root"]
    finally:
        api.call("DELETE", "/sessions/%s" % later["session_id"])
    wait_state(api, wid, "AVAILABLE")
    assert api.call("DELETE", "/workspaces/%s" % wid).status_code == 204
    deadline = time.time() + 60
    while api.call("GET", "/workspaces/%s" % wid).status_code != 404:
        assert time.time() < deadline
        time.sleep(0.1)


def test_a_workspace_is_attached_only_through_a_config(api):
    """workspace_id is no key of the YAML environment spec: a workspace attaches through a saved config."""
    resp = api.create({"name": unique(), "agent": "custom", "workspace_id": str(uuid.uuid4())})
    assert resp.status_code == 400 and "workspace_id" in error_message(resp)


def test_an_unknown_workspace_id_is_404(api, make_session):
    config_id = config_of(api, make_session)
    resp = start_with_workspace(api, config_id, str(uuid.uuid4()))
    assert resp.status_code == 404 and "workspace" in error_message(resp)
