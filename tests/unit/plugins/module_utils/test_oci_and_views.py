import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils.oci import image_matches, parse_image_ref
from ansible_collections.microvm.sandbox.plugins.module_utils.views import expand_statuses, object_view


@pytest.mark.parametrize("ref,expected", [
    ("alpine", ("docker.io", "alpine", "latest", "")),
    ("library/alpine:3.19", ("docker.io", "library/alpine", "3.19", "")),
    ("localhost:5000/agent:1.0", ("localhost:5000", "agent", "1.0", "")),
    ("reg.example.com/team/agent@sha256:abc", ("reg.example.com", "team/agent", "", "sha256:abc")),
    ("docker://localhost/x", ("localhost", "x", "latest", "")),
    ("oci:/srv/layout:v1", ("oci", "/srv/layout", "v1", "")),
])
def test_parse_image_ref(ref, expected):
    got = parse_image_ref(ref)
    assert (got["registry"], got["repository"], got["tag"], got["digest"]) == expected


@pytest.mark.parametrize("ref", ["", "a b", "oci:relative:tag", "reg.io/"])
def test_parse_image_ref_refuses(ref):
    with pytest.raises(ValueError):
        parse_image_ref(ref)


def test_image_matches():
    have = {"registry": "docker.io", "repository": "alpine", "tag": "3.19", "digest": "sha256:1"}
    assert image_matches(parse_image_ref("library/alpine:3.19"), have)
    assert image_matches(parse_image_ref("index.docker.io/library/alpine:3.19"), have)
    assert not image_matches(parse_image_ref("alpine:3.20"), have)
    assert image_matches(parse_image_ref("alpine@sha256:1"), have)
    assert not image_matches(parse_image_ref("alpine@sha256:2"), have)
    assert not image_matches(parse_image_ref("alpine:3.19"), {"registry": "", "repository": ""})


def test_expand_statuses():
    assert expand_statuses(None) is None
    assert expand_statuses(["usable", "session_status_paused"]) == {"READY", "DETACHED", "PAUSED"}
    with pytest.raises(ValueError):
        expand_statuses(["sleepy"])


def test_object_view_drops_volatile_fields():
    assert object_view({"a": 1, "last_event_at": "now", "warnings": []}) == {"a": 1}
    assert object_view(None) == {}
