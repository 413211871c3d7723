"""Every refusal of the create call, with the platform's status and a clear message."""
import uuid

import pytest

from contract_support import Api, error_message, local_only, unique

BAD_NAMES = ["", "-leading", "trailing-", "has space", "slash/name", "x" * 65, "ünïcode",
             str(uuid.uuid5(uuid.NAMESPACE_URL, "microvm-sandbox-test-name")), "a_b!", ".dot", 123, True, None, ["list"]]


def test_unknown_key_is_400(api):
    resp = api.create("name: %s\nagent: custom\nflavour: vanilla\n" % unique())
    assert resp.status_code == 400
    assert "flavour" in error_message(resp)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_names_are_400(api, name):
    resp = api.create({"name": name, "agent": "custom"})
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


# harness-create-session: two mutually exclusive forms chosen by Content-Type. The environment spec is YAML, in
# any of these four media types; JSON is only {name, config_id}.
@pytest.mark.parametrize("ctype", ["application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml",
                                   "application/yaml; charset=utf-8"])
def test_the_environment_spec_is_accepted_as_yaml(api, ctype):
    name = unique()
    resp = api.create("name: %s\nagent: custom\n" % name, content_type=ctype)
    assert resp.status_code in (200, 201), resp.text
    assert resp.json()["session"]["name"] == name
    api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])


@pytest.mark.parametrize("extra", [{}, {"size": "mars-2vcpu-4gb"}, {"env": {"A": "1"}}])
def test_a_flat_spec_sent_as_json_is_refused_naming_the_key(api, extra):
    """JSON selects the {name, config_id} form, decoded strictly: a spec field in it is an unknown key."""
    name = unique()
    resp = api.create(dict({"name": name, "agent": "custom"}, **extra), content_type="application/json")
    assert resp.status_code == 400, resp.text
    assert "agent" in error_message(resp)
    assert not api.call("GET", "/sessions", params={"name": name}).json()["sessions"]


def test_the_json_form_starts_a_session_from_a_config(api, make_session):
    """A YAML create persists an Environment Config first and reports its config_id; {name, config_id} reuses it."""
    first = make_session(idle_timeout="15m", env={"FROM_CONFIG": "yes"})
    assert first["config_id"]
    name = unique("cfg")
    resp = api.create({"name": name, "config_id": first["config_id"]}, content_type="application/json")
    assert resp.status_code in (200, 201), resp.text
    again = resp.json()["session"]
    try:
        assert again["name"] == name and again["config_id"] == first["config_id"]
        assert again["session_id"] != first["session_id"]
        ready = api.wait(again["session_id"], ("READY", "DETACHED"))
        assert ready["idle_timeout_seconds"] == 900 and ready["agent_kind"] == first["agent_kind"]
    finally:
        api.call("DELETE", "/sessions/%s" % again["session_id"])


@pytest.mark.parametrize("body", [{"name": "x-%s" % uuid.uuid4().hex[:6]}, {"config_id": str(uuid.uuid4())},
                                  {"name": "x-%s" % uuid.uuid4().hex[:6], "config_id": str(uuid.uuid4())}])
def test_the_json_form_needs_a_name_and_a_known_config(api, body):
    resp = api.create(body, content_type="application/json")
    assert resp.status_code in (400, 404), resp.text
    assert error_message(resp)


@local_only
def test_an_unknown_config_id_is_404_naming_it(api):
    cid = str(uuid.uuid4())
    resp = api.create({"name": unique(), "config_id": cid}, content_type="application/json")
    assert resp.status_code == 404 and cid in error_message(resp)


@pytest.mark.parametrize("body", ["{\"name\": ", "[1, 2]", "name: yaml-is-not-json\n", "{\"name\": NaN}"])
def test_malformed_json_is_400(api, body):
    resp = api.create(body, content_type="application/json")
    assert resp.status_code == 400, resp.text
    assert error_message(resp)


@local_only
def test_the_legacy_envelope_is_refused_clearly(api):
    resp = api.create("apiVersion: agents.digitalocean.com/v1alpha1\nkind: Agent\nspec:\n  runtime:\n    adapter: opencode\n")
    assert resp.status_code == 400 and "apiVersion" in error_message(resp)


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
@pytest.mark.parametrize("key", ["tools", "skills"])
def test_documented_adapter_settings_are_refused_by_name_not_ignored(api, key):
    resp = api.create({"name": unique(), "agent": "custom", key: []})
    assert resp.status_code == 400 and key in error_message(resp)


def test_the_permission_policy_is_a_spec_field(api):
    """permissions (Permission Policies) is accepted; a decision outside allow, ask and deny is refused naming it."""
    resp = api.create({"name": unique(), "agent": "custom", "permissions": {"default": "maybe"}})
    assert resp.status_code == 400 and "permissions.default" in error_message(resp)
    resp = api.create({"name": unique(), "agent": "custom", "permissions": {"default": "allow"}})
    assert resp.status_code in (200, 201), resp.text
    api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])


@local_only
def test_repos_are_refused_by_name_since_the_local_plane_cannot_clone(api):
    """repos (Refactor a Repository) is a documented key: checked, then refused clearly, never silently skipped."""
    name = unique()
    resp = api.create({"name": name, "agent": "custom", "repos": ["your-org/your-service"]})
    assert resp.status_code == 400, resp.text
    message = error_message(resp)
    assert "repos" in message and "your-org/your-service" in message and "no network" in message
    assert not api.call("GET", "/sessions", params={"name": name}).json()["sessions"]
    assert api.create({"name": name, "agent": "custom", "repos": []}).status_code in (200, 201)
    sid = api.call("GET", "/sessions", params={"name": name}).json()["sessions"][0]["session_id"]
    api.call("DELETE", "/sessions/%s" % sid)


def test_size_is_a_slug_of_the_sizes_endpoint(api):
    sizes = api.call("GET", "/sessions/sandbox/sizes").json()["sizes"]
    assert sizes and all({"slug", "vcpus", "memory_mb"} <= set(s) for s in sizes)
    assert [s["vcpus"] for s in sizes] == sorted(s["vcpus"] for s in sizes)  # smallest first
    resp = api.create({"name": unique(), "agent": "custom", "size": sizes[0]["slug"]})
    assert resp.status_code in (200, 201), resp.text
    api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])
    resp = api.create({"name": unique(), "agent": "custom", "size": "small"})
    assert resp.status_code == 400 and "small" in error_message(resp)


@local_only
@pytest.mark.parametrize("prefix", ["/v2/agents", "/v2/harness-runtime"])
def test_a_bad_size_names_the_sizes_route_under_the_prefix_it_came_in_on(plane, prefix):
    resp = Api(plane, prefix).create({"name": unique(), "agent": "custom", "size": "small"})
    assert resp.status_code == 400, resp.text
    message = error_message(resp)
    assert "GET %s/sessions/sandbox/sizes" % prefix in message, message
    assert message.count("/v2/") == 1, message   # the other prefix is not named


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
    ("repos", "your-org/your-service"),
    pytest.param("repos", ["not a repository"], marks=local_only),
    pytest.param("repos", [{"url": "https://git.example.com/a.git"}], marks=local_only),
])
def test_bad_field_values_are_400(api, field, value):
    resp = api.create({"name": unique(), "agent": "custom", field: value})
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
    # localhost: a name every host resolves (the local plane refuses one that does not, below)
    for egress in ("unrestricted", ["localhost"]):
        resp = api.create({"name": unique(), "agent": "custom", "egress": egress})
        assert resp.status_code in (200, 201), resp.text
        api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])


@local_only
def test_an_egress_host_that_does_not_resolve_is_400_naming_it(api):
    # .invalid never resolves (RFC 2606); the resolvable entry is not named, nothing is created
    name = unique()
    resp = api.create({"name": name, "agent": "custom",
                       "egress": ["localhost", "nope-%s.invalid" % name.lower(), "*.example.com"]})
    assert resp.status_code == 400, resp.text
    message = error_message(resp)
    assert "nope-%s.invalid" % name.lower() in message and "does not resolve" in message
    assert "localhost" not in message and "*.example.com" not in message
    assert not api.call("GET", "/sessions", params={"name": name}).json()["sessions"]


@local_only
def test_egress_wildcards_draw_a_warning(api):
    resp = api.create({"name": unique(), "agent": "custom", "egress": ["*.example.com"]})
    assert resp.status_code in (200, 201), resp.text
    session = resp.json()["session"]
    assert any("*.example.com" in w for w in session["warnings"])
    # The warnings are part of the session object: every later GET shows them too.
    again = api.call("GET", "/sessions/%s" % session["session_id"]).json()["session"]
    assert again["warnings"] == session["warnings"]
    api.call("DELETE", "/sessions/%s" % session["session_id"])


@local_only
@pytest.mark.parametrize("field", ["secrets", "env"])
@pytest.mark.parametrize("value", ["two\nlines", "carriage\rreturn", ""])
def test_a_guest_password_that_is_not_one_line_is_400_naming_the_variable_not_the_value(api, field, value):
    resp = api.create({"name": unique(), "agent": "custom", field: {"SANDBOX_ROOT_PASSWORD": value}})
    assert resp.status_code == 400, resp.text
    message = error_message(resp)
    assert "SANDBOX_ROOT_PASSWORD" in message and "root" in message
    assert not value or value not in message


def _alias_bomb(levels=9, width=9):
    """Nested anchors: each level a list of `width` aliases of the one before, so width**levels leaves."""
    names = "abcdefghijklmnop"
    parts = ["&a [%s]" % ",".join(["lol"] * width)]
    for i in range(1, levels):
        parts.append("&%s [%s]" % (names[i], ",".join(["*" + names[i - 1]] * width)))
    return "name: [%s]\nagent: custom\n" % ", ".join(parts)


@local_only
def test_a_yaml_alias_bomb_is_a_small_400_naming_the_bound(api):
    """A few hundred bytes expanding to 387 million nodes: refused before anything walks or echoes the value."""
    body = _alias_bomb()
    assert len(body) <= 361
    resp = api.create(body)
    assert resp.status_code == 400, resp.text[:300]
    assert len(resp.content) < 2048
    message = error_message(resp)
    assert "aliases" in message and "20000 nodes" in message, message
    # and the plane still answers
    assert api.create("name: %s\nagent: [unknown]\n" % unique()).status_code == 400


@local_only
def test_a_recursive_yaml_alias_is_a_400(api):
    resp = api.create("name: &a [x, *a]\nagent: custom\n")
    assert resp.status_code == 400 and "recursive alias" in error_message(resp), resp.text[:300]


def test_a_benign_yaml_alias_is_still_accepted(api):
    name = unique()
    resp = api.create("name: &n %s\nagent: custom\nenv: {SESSION_NAME: *n}\n" % name)
    assert resp.status_code in (200, 201), resp.text
    api.call("DELETE", "/sessions/%s" % resp.json()["session"]["session_id"])


@local_only
@pytest.mark.parametrize("field", ["name", "template", "size", "idle_timeout", "egress", "repos", "agent"])
def test_an_echoed_value_is_bounded(api, field):
    """A 100 KB value (or a large list) in a field whose error names the value: the message quotes a bounded part."""
    doc = {"name": unique(), "agent": "custom"}
    doc[field] = ["x" * 1000] * 100 if field in ("egress", "repos") else "x" * 100_000
    resp = api.create(doc)
    assert resp.status_code == 400, resp.text[:300]
    assert len(error_message(resp)) < 600, error_message(resp)[:300]
