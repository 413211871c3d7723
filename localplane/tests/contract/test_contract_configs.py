"""Environment Configs (How to Use Environment Configs; pydo create_config; doctl harness-runtime config).

Created from {name, manifest_yaml, insights?} with a unique name, immutable, listed (with `search`), got, and
deleted only once no session started from it is active; sessions start from one with {name, config_id}.
"""
import uuid

import pytest

from contract_support import error_message, local_only, unique

# pydo get_config's response example; list items carry region instead of credentials (pydo list_configs).
FIELDS = {"id", "name", "agentspec_schema_version", "content_hash", "created_by", "created_at", "updated_at",
          "credentials"}
LIST_FIELDS = FIELDS - {"credentials"} | {"region"}


@pytest.fixture
def configs(api):
    made = []

    def make(name=None, manifest="name: from-config\nagent: custom\n", **extra):
        body = dict(name=name or unique("cfg"), manifest_yaml=manifest, **extra)
        resp = api.call("POST", "/configs", json=body)
        if resp.status_code == 201:
            made.append(resp.json()["config"]["id"])
        return resp

    yield make
    for cid in made:
        api.call("DELETE", "/configs/%s" % cid)


def test_create_get_list_and_search(api, configs):
    name = unique("Reviewer")
    resp = configs(name=name, insights={"logs": True, "traces": None},
                   manifest="name: a\nagent: custom\nsecrets: {API_KEY: never-shown}\n")
    assert resp.status_code == 201, resp.text
    assert "never-shown" not in resp.text
    cfg = resp.json()["config"]
    assert set(cfg) == FIELDS and cfg["name"] == name and cfg["content_hash"]
    assert [c["name"] for c in cfg["credentials"]] == ["API_KEY"]
    assert api.call("GET", "/configs/%s" % cfg["id"]).json()["config"] == cfg
    found = api.call("GET", "/configs", params={"search": name[3:].upper()}).json()
    assert set(found) == {"configs", "next_page_token"}
    assert [c["id"] for c in found["configs"]] == [cfg["id"]]
    assert set(found["configs"][0]) == LIST_FIELDS
    assert api.call("GET", "/configs", params={"page_size": 201}).status_code == 400


@local_only
def test_names_are_unique_case_insensitively(configs):
    name = unique("dup")
    assert configs(name=name).status_code == 201
    again = configs(name=name.upper())
    assert again.status_code == 409 and "already exists" in error_message(again)


@pytest.mark.parametrize("body,needle", [
    ({"name": "x"}, "manifest_yaml is required"),
    ({"manifest_yaml": "name: a\nagent: custom\n"}, "name is required"),
    ({"name": "x", "manifest_yaml": "name: a\nagent: custom\nkeep_cold: true\n"}, "keep_cold"),
    ({"name": "x", "manifest_yaml": "name: a\nagent: custom\n", "manifestYaml": "x"}, "manifestYaml"),
    ({"name": "x", "manifest_yaml": "name: a\nagent: custom\n", "insights": {"logs": "yes"}}, "insights.logs"),
])
def test_create_refuses_a_bad_body_naming_what_is_wrong(api, body, needle):
    resp = api.call("POST", "/configs", json=body)
    assert resp.status_code == 400 and needle in error_message(resp)


def test_a_session_starts_from_a_config_and_blocks_its_delete(api, configs):
    cfg = configs(manifest="name: from-config\nagent: custom\nidle_timeout: 5m\n").json()["config"]
    resp = api.create({"name": unique(), "config_id": cfg["id"]}, content_type="application/json")
    assert resp.status_code == 201, resp.text
    s = api.wait(resp.json()["session"]["session_id"], ("READY",))
    assert s["config_id"] == cfg["id"] and s["idle_timeout_seconds"] == 300
    blocked = api.call("DELETE", "/configs/%s" % cfg["id"])
    assert blocked.status_code == 409 and s["session_id"] in error_message(blocked)
    api.call("DELETE", "/sessions/%s" % s["session_id"])
    api.wait(s["session_id"], ("DESTROYED",))
    assert api.call("DELETE", "/configs/%s" % cfg["id"]).status_code == 204
    # A soft delete: out of the list, the name free again, the id still resolvable; no new session from it.
    assert cfg["id"] not in [c["id"] for c in api.call("GET", "/configs").json()["configs"]]
    assert api.call("GET", "/configs/%s" % cfg["id"]).status_code == 200
    again = api.create({"name": unique(), "config_id": cfg["id"]}, content_type="application/json")
    assert again.status_code == 404


def test_unknown_config_is_404(api):
    assert api.call("GET", "/configs/%s" % uuid.uuid4()).status_code == 404


def test_the_documented_examples_have_exactly_these_keys():
    """The plane's keys are the ones in the documented examples (tests/platform_corpus), no more, no fewer."""
    import json
    import os
    corpus = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "platform_corpus")
    with open(os.path.join(corpus, "configs.get.1.json")) as f:
        assert set(json.load(f)["response"]["body"]["config"]) == FIELDS
    with open(os.path.join(corpus, "configs.list.1.json")) as f:
        body = json.load(f)["response"]["body"]
    assert set(body) == {"configs", "next_page_token"} and set(body["configs"][0]) == LIST_FIELDS
