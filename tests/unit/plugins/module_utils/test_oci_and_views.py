import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils.oci import parse_image_ref
from ansible_collections.microvm.sandbox.plugins.module_utils.views import expand_statuses, object_view, same_adapter


@pytest.mark.parametrize("ref,expected", [
    ("localhost:5000/agent:1.0", ("localhost:5000", "agent", "1.0", "")),
    ("reg.example.com/team/agent@sha256:abc", ("reg.example.com", "team/agent", "", "sha256:abc")),
    ("docker://localhost/x", ("localhost", "x", "latest", "")),
    ("oci:/srv/layout:v1", ("oci", "/srv/layout", "v1", "")),
])
def test_parse_image_ref(ref, expected):
    got = parse_image_ref(ref)
    assert (got["registry"], got["repository"], got["tag"], got["digest"]) == expected


@pytest.mark.parametrize("ref", ["", "a b", "oci:relative:tag", "reg.io/", "alpine", "library/alpine:3.19"])
def test_parse_image_ref_refuses(ref):
    with pytest.raises(ValueError):
        parse_image_ref(ref)


def test_same_adapter():
    assert same_adapter("AGENT_KIND_CLAUDE_CODE", "claude-code")
    assert same_adapter("AGENT_KIND_UNSPECIFIED", "codex") and same_adapter(None, "codex")
    assert not same_adapter("AGENT_KIND_CODEX", "custom")


def test_expand_statuses():
    assert expand_statuses(None) is None
    assert expand_statuses(["usable", "session_status_paused"]) == {"READY", "DETACHED", "PAUSED"}
    with pytest.raises(ValueError):
        expand_statuses(["sleepy"])


def test_object_view_drops_volatile_fields():
    assert object_view({"a": 1, "last_event_at": "now", "warnings": []}) == {"a": 1}
    assert object_view(None) == {}
