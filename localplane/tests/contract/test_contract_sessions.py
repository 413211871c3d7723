"""Session create, get, list, delete, pause and resume through the REST API."""
import uuid

import pytest

from contract_support import LIVE, error_message, local_only, unique

# The documented session object (pydo get_session): it has no template, size or error text.
FIELDS = {"session_id", "name", "status", "created_at", "last_event_at", "idle_timeout_seconds",
          "parent_session_id", "fork_id", "fork_from_checkpoint_id", "agent_kind", "keep_warm", "region",
          "workspace_id", "config_id"}
UNDOCUMENTED = {"template", "size_slug", "error_message", "env", "secrets", "egress"}


def test_create_returns_provisioning_then_ready(plane, api):
    client = plane.client()
    name = unique()
    created = client.create_session({"name": name, "idle_timeout": "600s", "env": {"GREETING": "hi"}})
    try:
        assert created["name"] == name
        assert created["status"] in ("SESSION_STATUS_PROVISIONING", "SESSION_STATUS_READY")
        assert "warnings" in created
        ready = client.wait_session(created["session_id"], timeout=120)
        assert ready["status"] == "SESSION_STATUS_READY"
        assert FIELDS <= set(ready), sorted(FIELDS - set(ready))
        assert not UNDOCUMENTED & set(ready), sorted(UNDOCUMENTED & set(ready))
        assert ready["sandbox_id"]
        assert ready["idle_timeout_seconds"] == 600
        assert "pause_reason" not in ready
        assert "warnings" not in ready
        assert ready["created_at"].endswith("Z") and "T" in ready["created_at"]
    finally:
        client.delete_session(created["session_id"])


def test_get_unknown_session_is_404(api):
    resp = api.call("GET", "/sessions/%s" % uuid.uuid4())
    assert resp.status_code == 404
    assert error_message(resp)


def test_list_pages_and_filters(plane, api, make_session):
    a = make_session(name=unique("lst"))
    b = make_session(name=unique("lst"))
    seen, token = [], ""
    while True:
        page = api.call("GET", "/sessions", params={"page_size": 1, "page_token": token}).json()
        assert len(page["sessions"]) <= 1
        seen += [s["session_id"] for s in page["sessions"]]
        token = page["next_page_token"]
        if not token:
            break
    assert {a["session_id"], b["session_id"]} <= set(seen)
    for status in ("READY", "SESSION_STATUS_READY"):
        got = api.call("GET", "/sessions", params={"status": status}).json()["sessions"]
        assert a["session_id"] in {s["session_id"] for s in got}
        assert all(s["status"] == "SESSION_STATUS_READY" for s in got)
    by_name = api.call("GET", "/sessions", params={"name": a["name"].upper()}).json()["sessions"]
    assert [s["session_id"] for s in by_name] == [a["session_id"]]


def test_list_refuses_a_forged_page_token(api):
    resp = api.call("GET", "/sessions", params={"page_token": "not-a-token"})
    assert resp.status_code == 400
    assert "page_token" in error_message(resp)


@local_only
def test_list_refuses_an_unknown_status(api):
    resp = api.call("GET", "/sessions", params={"status": "SLEEPY"})
    assert resp.status_code == 400


def test_delete_goes_destroying_then_destroyed_and_stays_queryable(plane, api):
    client = plane.client()
    s = client.create_session({"name": unique()})
    client.wait_session(s["session_id"])
    resp = api.call("DELETE", "/sessions/%s" % s["session_id"])
    assert resp.status_code == 204
    gone = client.wait_session(s["session_id"], until=frozenset(["DESTROYED"]), gone_ok=True, timeout=120)
    if gone is not None:
        assert gone["status"] == "SESSION_STATUS_DESTROYED"
    # The name is free again once the session is gone.
    again = client.create_session({"name": s["name"]})
    client.delete_session(again["session_id"])
    by_name = api.call("GET", "/sessions", params={"name": s["name"]}).json()["sessions"]
    assert s["session_id"] not in {x["session_id"] for x in by_name}


def test_delete_unknown_session_is_404(api):
    assert api.call("DELETE", "/sessions/%s" % uuid.uuid4()).status_code == 404


def test_pause_and_resume(plane, api, sandbox):
    sid = sandbox["session_id"]
    assert api.call("POST", "/sessions/%s/resume" % sid, json={}).status_code == 409
    assert api.call("POST", "/sessions/%s/pause" % sid, json={}).status_code == 204
    paused = api.wait(sid, ("PAUSED",))
    assert paused["pause_reason"] == "manual"
    resp = api.call("POST", "/sessions/%s/pause" % sid, json={})
    assert resp.status_code == 409
    assert error_message(resp)
    assert api.call("POST", "/sessions/%s/resume" % sid, json={}).status_code == 204
    ready = api.wait(sid, ("READY",))
    assert "pause_reason" not in ready


def test_pause_a_deleted_session_is_refused(plane, api):
    client = plane.client()
    s = client.create_session({"name": unique()})
    client.wait_session(s["session_id"])
    client.delete_session(s["session_id"])
    resp = api.call("POST", "/sessions/%s/pause" % s["session_id"], json={})
    assert resp.status_code in (404, 409, 410)


@local_only
def test_idle_session_is_paused_with_reason_idle(plane, make_session, api):
    s = make_session(idle_timeout="1s")
    paused = api.wait(s["session_id"], ("PAUSED",), timeout=30)
    assert paused["pause_reason"] == "idle"


@pytest.mark.skipif(LIVE, reason="creates and deletes quickly")
def test_the_harness_runtime_prefix_has_the_same_sessions(plane, api, sandbox):
    resp = api.http.get(plane.url + "/v2/harness-runtime/sessions/" + sandbox["session_id"], headers=plane.auth_headers)
    assert resp.status_code == 200
    assert resp.json()["session"]["session_id"] == sandbox["session_id"]
