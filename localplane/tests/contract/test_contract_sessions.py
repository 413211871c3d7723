"""Session create, get, list, delete, pause and resume through the REST API."""
import uuid

import pytest

from contract_support import LIVE, error_message, local_only, unique

# The documented session object (pydo get_session): it has no template, size or error text. The example shows
# every field, empty ones included ("warnings": [], "keep_warm": false).
DOCUMENTED = {"session_id", "name", "parent_session_id", "fork_id", "fork_from_checkpoint_id", "agent_kind", "status",
              "sandbox_id", "created_at", "last_event_at", "keep_warm", "resume_on_topoff", "pause_reason",
              "idle_timeout_seconds", "repo_hint", "warnings", "config_id", "openai_session_id",
              "openai_environment_id", "region", "workspace_id"}
FIELDS = {"session_id", "name", "status", "created_at", "last_event_at", "idle_timeout_seconds",
          "parent_session_id", "fork_id", "fork_from_checkpoint_id", "agent_kind", "keep_warm", "region",
          "workspace_id", "config_id", "warnings", "resume_on_topoff"}
UNDOCUMENTED = {"template", "size_slug", "size", "error_message", "env", "secrets", "egress", "repos"}


def test_create_returns_provisioning_then_ready(plane, api):
    client = plane.client()
    name = unique()
    created = client.create_session({"name": name, "idle_timeout": "600s", "env": {"GREETING": "hi"}})
    try:
        assert created["name"] == name
        assert created["status"] in ("SESSION_STATUS_PROVISIONING", "SESSION_STATUS_READY")
        assert isinstance(created["warnings"], list)
        ready = client.wait_session(created["session_id"], timeout=120)
        assert ready["status"] == "SESSION_STATUS_READY"
        assert FIELDS <= set(ready), sorted(FIELDS - set(ready))
        assert not UNDOCUMENTED & set(ready), sorted(UNDOCUMENTED & set(ready))
        assert ready["sandbox_id"]
        assert ready["idle_timeout_seconds"] == 600
        assert ready.get("pause_reason", "") == ""  # only a paused session has a reason
        assert ready["warnings"] == [] and ready["resume_on_topoff"] is False
        assert ready["created_at"].endswith("Z") and "T" in ready["created_at"]
    finally:
        client.delete_session(created["session_id"])


@local_only
def test_every_documented_field_is_present_even_when_empty(plane, sandbox):
    got = plane.client().get_session(sandbox["session_id"])
    assert set(got) == DOCUMENTED, sorted(set(got) ^ DOCUMENTED)
    listed = [s for s in plane.client().list_sessions() if s["session_id"] == sandbox["session_id"]]
    assert set(listed[0]) == DOCUMENTED


def test_resume_on_topoff_is_set_at_create_and_patched_in_place(plane, api):
    """A query parameter of the create (harness-create-session), then PATCH (update_session), per session."""
    client = plane.client()
    created = client.create_session({"name": unique("topoff")}, resume_on_topoff=True)
    sid = created["session_id"]
    try:
        assert created["resume_on_topoff"] is True
        client.wait_session(sid, timeout=120)
        patched = client.update_session(sid, False)
        assert patched["resume_on_topoff"] is False and patched["session_id"] == sid
        assert client.get_session(sid)["resume_on_topoff"] is False
        for body in ({}, {"resume_on_topoff": False, "keep_warm": True}, {"resume_on_topoff": "yes"}):
            resp = api.call("PATCH", "/sessions/%s" % sid, json=body)
            assert resp.status_code == 400, (body, resp.text)
            assert error_message(resp)
        assert client.get_session(sid)["resume_on_topoff"] is False
        resp = api.create("name: %s\nagent: custom\n" % unique(), params={"resume_on_topoff": "maybe"})
        assert resp.status_code == 400 and "resume_on_topoff" in error_message(resp)
    finally:
        client.delete_session(sid)
    client.wait_session(sid, until=frozenset(["DESTROYED"]), gone_ok=True, timeout=120)
    resp = api.call("PATCH", "/sessions/%s" % sid, json={"resume_on_topoff": True})
    assert resp.status_code in (400, 404, 409, 410), resp.text  # a terminal session cannot be patched


def test_resume_on_topoff_is_off_by_default(plane, sandbox):
    assert plane.client().get_session(sandbox["session_id"])["resume_on_topoff"] is False


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
    assert ready.get("pause_reason", "") == ""


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
