"""Every refusal of the create call, with the platform's status and a clear message."""
import json
import uuid

import pytest

from contract_support import error_message, local_only, unique

BAD_NAMES = ["", "-leading", "trailing-", "has space", "slash/name", "x" * 65, "ünïcode",
             str(uuid.uuid4()), "a_b!", ".dot", 123, True, None, ["list"]]


def test_unknown_key_is_400(api):
    resp = api.create("name: %s\nagent: custom\nflavour: vanilla\n" % unique())
    assert resp.status_code == 400
    assert "flavour" in error_message(resp)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_400(api, name):
    resp = api.create(json.dumps({"name": name, "agent": "custom"}))
    assert resp.status_code == 400, resp.text
    assert error_message(resp)


def test_missing_name_is_400(api):
    resp = api.create("agent: custom\n")
    assert resp.status_code == 400


def test_live_name_taken_is_409_case_insensitive(api, make_session):
    s = make_session(name=unique("Dup"))
    resp = api.create("name: %s\nagent: custom\n" % s["name"].lower())
    assert resp.status_code == 409, resp.text
    assert error_message(resp)


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "application/octet-stream"])
def test_unsupported_content_type_is_415(api, ctype):
    resp = api.create("name: %s\nagent: custom\n" % unique(), content_type=ctype)
    assert resp.status_code == 415


@pytest.mark.parametrize("ctype", ["application/yaml", "application/x-yaml", "text/yaml", "application/json"])
def test_accepted_content_types(api, ctype):
    name = unique()
    resp = api.create(json.dumps({"name": name, "agent": "custom"}), content_type=ctype)
    assert resp.status_code in (200, 201), resp.text
    api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])


def test_oversized_body_is_413(api):
    body = "name: %s\nagent: custom\nenv:\n  BIG: '%s'\n" % (unique(), "x" * (1024 * 1024 + 10))
    assert api.create(body).status_code == 413


@pytest.mark.parametrize("body", ["name: [unclosed\n", "{\"name\": ", "- a\n- list\n", ": :\n  - x: {", "just a string",
                                  "[" * 100000, "name: !!python/object:os.system x\n", "\xff\xfe binary"])
def test_malformed_yaml_or_json_is_400(api, body):
    resp = api.create(body)
    assert resp.status_code == 400, resp.text
    assert error_message(resp)


@pytest.mark.parametrize("agent", ["none", "claude", "bare"])
def test_an_agent_that_is_no_documented_adapter_is_400_naming_it(api, agent):
    # Agent Adapters: codex, claude-code, opencode, hermes, langgraph, codex-agentapi, custom.
    resp = api.create("name: %s\nagent: %s\n" % (unique(), agent))
    assert resp.status_code == 400, resp.text
    assert agent in error_message(resp)


def test_the_custom_adapter_is_a_bare_sandbox(make_session):
    s = make_session(agent="custom")
    assert s["agent_kind"] == "AGENT_KIND_CUSTOM"


@local_only
def test_platform_adapters_the_local_plane_cannot_run_are_refused(api):
    resp = api.create("name: %s\nagent: codex\n" % unique())
    assert resp.status_code == 400 and "custom" in error_message(resp)


@local_only
@pytest.mark.parametrize("key", ["tools", "skills", "permissions"])
def test_documented_adapter_settings_are_refused_by_name_not_ignored(api, key):
    resp = api.create(json.dumps({"name": unique(), "agent": "custom", key: []}))
    assert resp.status_code == 400 and key in error_message(resp)


def test_size_is_a_slug_of_the_sizes_endpoint(api):
    sizes = api.call("GET", "/sessions/sandbox/sizes").json()["sizes"]
    assert sizes and all({"slug", "vcpus", "memory_mb"} <= set(s) for s in sizes)
    assert [s["vcpus"] for s in sizes] == sorted(s["vcpus"] for s in sizes)  # smallest first
    resp = api.create(json.dumps({"name": unique(), "agent": "custom", "size": sizes[0]["slug"]}))
    assert resp.status_code in (200, 201), resp.text
    api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])
    resp = api.create(json.dumps({"name": unique(), "agent": "custom", "size": "small"}))
    assert resp.status_code == 400 and "small" in error_message(resp)


def test_secrets_are_readable_inside_and_never_returned(api, make_session):
    s = make_session(secrets={"SECRET_TOKEN": "s3cr3t-value"}, env={"PLAIN": "shown"})
    out = api.call("POST", "/sessions/%s/sandbox/exec" % s["session_id"],
                   json={"argv": ["sh", "-c", "echo $SECRET_TOKEN $PLAIN"]}).json()
    assert out["stdout"] == "s3cr3t-value shown\n"
    for body in (api.call("GET", "/sessions/%s" % s["session_id"]).text, api.call("GET", "/sessions").text):
        assert "s3cr3t-value" not in body


def test_persistent_workspace_sets_a_workspace_id(make_session):
    s = make_session(persistent_workspace=True)
    assert s["workspace_id"]


@pytest.mark.parametrize("field,value", [
    ("idle_timeout", "ten minutes"),
    # The platform's YAML decoder may turn a bare number into a string; the local plane refuses it.
    pytest.param("idle_timeout", 600, marks=local_only),
    ("env", ["A=1"]),
    pytest.param("env", {"A": 1}, marks=local_only),
    ("env", {"BAD KEY": "x"}),
    ("egress", "everything"),
    pytest.param("egress", [42], marks=local_only),
    ("size", {"cpu": 2}),
    ("persistent_workspace", "yes"),
    ("secrets", ["A=1"]),
])
def test_bad_field_values_are_400(api, field, value):
    resp = api.create(json.dumps({"name": unique(), "agent": "custom", field: value}))
    assert resp.status_code == 400, resp.text
    assert field in error_message(resp)


def test_unknown_template_fails(api):
    resp = api.create("name: %s\nagent: custom\ntemplate: no-such-template-%s\n" % (unique(), uuid.uuid4().hex[:6]))
    if resp.status_code in (200, 201):
        # The platform may accept and fail the session instead; either way it never becomes usable.
        sid = resp.json()["session"]["session_id"]
        api.wait(sid, ("FAILED",))
        api.call("DELETE", "/sessions/%s" % sid)
    else:
        assert resp.status_code in (400, 404)
        assert "no-such-template" in error_message(resp)


def test_egress_list_and_unrestricted_are_accepted(api):
    for egress in ("unrestricted", ["mirror.example.com", "files.example.org"]):
        resp = api.create(json.dumps({"name": unique(), "agent": "custom", "egress": egress}))
        assert resp.status_code in (200, 201), resp.text
        api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])


@local_only
def test_egress_wildcards_draw_a_warning(api):
    resp = api.create(json.dumps({"name": unique(), "agent": "custom", "egress": ["*.example.com"]}))
    assert resp.status_code in (200, 201), resp.text
    session = resp.json()["session"]
    assert any("*.example.com" in w for w in session["warnings"])
    api.call("DELETE", "/sessions/%s" % session["session_id"])


@local_only
@pytest.mark.parametrize("field", ["secrets", "env"])
@pytest.mark.parametrize("value", ["two\nlines", "carriage\rreturn", ""])
def test_a_guest_password_that_is_not_one_line_is_400_naming_the_variable_not_the_value(api, field, value):
    resp = api.create(json.dumps({"name": unique(), "agent": "custom", field: {"SANDBOX_ROOT_PASSWORD": value}}))
    assert resp.status_code == 400, resp.text
    message = error_message(resp)
    assert "SANDBOX_ROOT_PASSWORD" in message and "root" in message
    assert not value or value not in message
