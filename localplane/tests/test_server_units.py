"""Unit tests of the plane's pure pieces: contract rules, create validation, paging, OCI refs, the store."""
import json
import os

import pytest

from microvm_localplane import contract
from microvm_localplane.createspec import parse_create
from microvm_localplane.httputil import ApiFailure, decode_page_token, encode_page_token
from microvm_localplane.store import Store, write_json_atomic
from microvm_localplane.templates import is_local_registry, parse_oci_ref


@pytest.mark.parametrize("text,seconds", [("600s", 600), ("10m", 600), ("1h30m", 5400), ("1.5s", 1.5), ("250ms", 0.25)])
def test_durations(text, seconds):
    assert contract.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "ten", "5d", "s", "1h 30m", "-5s"])
def test_bad_durations(text):
    assert contract.parse_duration(text) is None


@pytest.mark.parametrize("name", ["a", "A1", "my.box_1-x", "x" * 64, "1"])
def test_good_names(name):
    assert contract.name_problem(name) is None


@pytest.mark.parametrize("name", ["", "-a", "a-", "a b", "x" * 65, "ä", "123e4567-e89b-12d3-a456-426614174000",
                                  "123e4567e89b12d3a456426614174000", None, 5])
def test_bad_names(name):
    assert contract.name_problem(name)


def test_status_filter_accepts_both_spellings():
    assert contract.parse_status_filter("READY") == "READY"
    assert contract.parse_status_filter("session_status_paused") == "PAUSED"
    assert contract.parse_status_filter("SLEEPING") is None


def test_create_defaults_and_normalization():
    spec = parse_create({"name": "box", "agent": "custom", "egress": ["Mirror.Example.com"], "env": {"A": "1"},
                         "secrets": {"TOKEN": "s3cret"}, "idle_timeout": "2m"})
    assert spec == {"name": "box", "agent": "custom", "template": "base", "size_slug": "mars-2vcpu-4gb",
                    "idle_timeout_seconds": 120, "persistent_workspace": False, "keep_warm": False,
                    "env": {"A": "1"},
                    "secrets": {"TOKEN": "s3cret"}, "egress": ["mirror.example.com"],
                    # an omitted permissions block resolves to ask (Permission Policies)
                    "permissions": {"default": "ask", "rules": []}}


@pytest.mark.parametrize("value, default", [
    ({"default": "allow"}, "allow"), ({}, "ask"), ({"rules": [{"action": "deny", "command": "rm -rf /"}]}, "ask"),
])
def test_permissions_are_kept_with_default_resolved(value, default):
    spec = parse_create({"name": "box", "agent": "custom", "permissions": value})
    assert spec["permissions"]["default"] == default


@pytest.mark.parametrize("value, word", [
    ({"default": "maybe"}, "permissions.default"), ("allow", "mapping"), ({"mode": "allow"}, "mode"),
    ({"rules": [{"command": "x"}]}, "rules[0]"), ({"rules": "x"}, "list"),
])
def test_bad_permissions_are_refused_naming_what(value, word):
    with pytest.raises(ApiFailure) as e:
        parse_create({"name": "box", "agent": "custom", "permissions": value})
    assert e.value.status == 400 and word in e.value.message


def test_status_filter_knows_all_and_unspecified():
    assert contract.parse_status_filter("SESSION_STATUS_ALL") == "ALL"
    assert contract.parse_status_filter("SESSION_STATUS_UNSPECIFIED") == "UNSPECIFIED"
    assert contract.parse_status_filter("SESSION_STATUS_EVERYTHING") is None
    assert parse_create({"name": "box", "agent": "custom", "egress": "unrestricted"})["egress"] is None


@pytest.mark.parametrize("doc", [{"name": "b", "agent": "none"}, {"name": "b"}, {"name": "b", "agent": "claude"},
                                 {"name": "b", "agent": "codex"},
                                 {"name": "b", "agent": "custom", "size": "small"},
                                 {"name": "b", "agent": "custom", "persistent_workspace": "yes"},
                                 {"name": "b", "agent": "custom", "keep_warm": "yes"},
                                 {"name": "b", "agent": "custom", "tools": []},
                                 {"name": "b", "agent": "custom", "env": {"A": "1"}, "secrets": {"A": "2"}},
                                 {"name": "b", "agent": "custom", "secrets": {"A": 1}},
                                 {"name": "b", "agent": "custom", "idle_timeout": "0s"},
                                 {"name": "b", "agent": "custom", "idle_timeout": "1.5s"},
                                 {"name": "b", "agent": "custom", "env": {"A": None}},
                                 {"name": "b", "agent": "custom", "egress": ["not a host"]},
                                 {"name": "b", "agent": "custom", "template": 3}])
def test_create_refusals(doc):
    with pytest.raises(ApiFailure) as e:
        parse_create(doc)
    assert e.value.status == 400


def test_page_tokens_are_scoped_and_checked():
    token = encode_page_token(50, "sessions||")
    assert decode_page_token(token, "sessions||") == 50
    for bad in ("garbage", encode_page_token(50, "templates"), encode_page_token(-1, "sessions||"), "e30"):
        with pytest.raises(ApiFailure) as e:
            decode_page_token(bad, "sessions||")
        assert e.value.status == 400


@pytest.mark.parametrize("ref,source,image", [
    ("localhost:5000/repo/img:tag", "docker://localhost:5000/repo/img:tag",
     {"registry": "localhost:5000", "repository": "repo/img", "tag": "tag", "digest": ""}),
    ("registry.example.com/img", "docker://registry.example.com/img:latest",
     {"registry": "registry.example.com", "repository": "img", "tag": "latest", "digest": ""}),
    ("oci:/srv/layout:v1", "oci:/srv/layout:v1", {"registry": "oci", "repository": "/srv/layout", "tag": "v1", "digest": ""}),
])
def test_oci_refs(ref, source, image):
    assert parse_oci_ref(ref) == (source, image)


@pytest.mark.parametrize("ref", ["", "has space:1", "oci:relative:v1", 7, "localhost:5000/", "library/debian:12"])
def test_bad_oci_refs(ref):
    with pytest.raises(ValueError):
        parse_oci_ref(ref)


def test_local_registries_skip_tls():
    assert is_local_registry("localhost:5000") and is_local_registry("127.0.0.1:5000")
    assert not is_local_registry("registry.example.com")


def test_store_round_trip_and_torn_files(tmp_path):
    store = Store(str(tmp_path))
    store.save_session({"session_id": "s1", "name": "a"})
    store.save_checkpoint({"session_id": "s1", "checkpoint_id": "c1"})
    store.save_template({"template_id": "t1", "name": "t"})
    # A crash mid-write leaves a temporary file, never a torn record.
    with open(os.path.join(store.sessions_dir, ".tmp-abc"), "w") as f:
        f.write("{not json")
    again = Store(str(tmp_path))
    assert again.sessions == {"s1": {"session_id": "s1", "name": "a"}}
    assert again.checkpoints["s1"]["c1"]["checkpoint_id"] == "c1"
    assert again.templates["t1"]["name"] == "t"
    assert not os.path.exists(os.path.join(store.sessions_dir, ".tmp-abc"))
    again.forget_session("s1")
    assert Store(str(tmp_path)).sessions == {} and Store(str(tmp_path)).checkpoints.get("s1", {}) == {}


def test_atomic_write_is_private(tmp_path):
    path = str(tmp_path / "x" / "r.json")
    write_json_atomic(path, {"a": 1})
    assert json.load(open(path)) == {"a": 1}
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_rest_exec_clamps_and_defaults():
    from microvm_localplane.agentrpc import parse_exec
    assert parse_exec({"argv": ["true"]}) == (["true"], "/workspace", 60, b"")
    assert parse_exec({"argv": ["true"], "timeout_seconds": 999})[2] == 240
    assert parse_exec({"argv": ["true"], "timeout_seconds": 0})[2] == 60
    assert parse_exec({"argv": ["true"], "timeout_seconds": -5})[2] == 60  # clamped, not refused
    assert parse_exec({"argv": ["true"], "timeout_seconds": 30}, max_timeout=8)[2] == 8  # the plane's lowered clamp
    assert parse_exec({"argv": ["cat"], "stdin": "aGk="})[3] == b"hi"
    for bad in ({"argv": ["x"], "timeout_seconds": 1.5}, {"argv": ["x"], "workdir": "rel"}, {"argv": [1]}):
        with pytest.raises(ApiFailure):
            parse_exec(bad)


@pytest.mark.parametrize("prefix", contract.PREFIXES)
def test_an_unknown_size_names_the_catalog_route_under_the_requests_prefix(prefix):
    with pytest.raises(ApiFailure) as e:
        parse_create({"name": "s1", "agent": "custom", "size": "small"}, prefix)
    assert e.value.status == 400
    assert "unknown size 'small': use a slug of GET %s/sessions/sandbox/sizes" % prefix in e.value.message
    assert [p for p in contract.PREFIXES if p in e.value.message] == [prefix]


def test_the_prefix_of_a_request_path():
    assert contract.prefix_of("/v2/agents/sessions") == "/v2/agents"
    assert contract.prefix_of("/v2/harness-runtime/configs") == "/v2/harness-runtime"
    assert contract.prefix_of("/v2/agentsx/sessions") == contract.DEFAULT_PREFIX == "/v2/harness-runtime"
