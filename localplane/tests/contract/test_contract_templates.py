"""Templates: the built-in base, builds from an OCI image (layout or a real local registry), failures."""
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest
import requests

from contract_support import error_message, local_only, unique

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import oci_fixture  # noqa: E402


def wait_template(client, tid, timeout=300):
    deadline = time.time() + timeout
    while True:
        t = client.get_template(tid)
        if t["status"] in ("TEMPLATE_STATUS_READY", "TEMPLATE_STATUS_FAILED"):
            return t
        assert time.time() < deadline, t
        time.sleep(0.2)


@pytest.fixture(scope="module")
def oci_layout(tmp_path_factory):
    if not shutil.which("umoci") or not shutil.which("skopeo"):
        pytest.skip("umoci and skopeo are needed (apt-get install -y umoci skopeo)")
    return oci_fixture.build_layout(str(tmp_path_factory.mktemp("oci")))


@pytest.fixture(scope="module")
def registry(tmp_path_factory, oci_layout):
    """Debian's docker-registry on a free loopback port, holding the test image."""
    if not shutil.which("docker-registry"):
        pytest.skip("docker-registry is needed (apt-get install -y docker-registry)")
    d = tmp_path_factory.mktemp("registry")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = d / "config.yml"
    config.write_text("version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: %s\n"
                      "http:\n  addr: 127.0.0.1:%d\n" % (d / "data", port))
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                if requests.get("http://127.0.0.1:%d/v2/" % port, timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.time() < deadline, "docker-registry did not start"
            time.sleep(0.1)
        ref = "localhost:%d/microvm-test/mini:v1" % port
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", oci_layout, "docker://" + ref], check=True)
        yield ref
    finally:
        proc.terminate()
        proc.wait(10)


def test_list_is_paginated_and_get_unknown_is_404(api):
    page = api.call("GET", "/templates", params={"page_size": 1}).json()
    assert "templates" in page and "next_page_token" in page
    assert api.call("GET", "/templates/%s" % uuid.uuid4()).status_code == 404


@local_only
def test_builtin_base_template_always_exists(plane, make_session):
    names = [t["name"] for t in plane.client().list_templates()]
    assert "base" in names
    s = make_session(template="base")
    assert s["status"] == "SESSION_STATUS_READY"


def test_create_refuses_unknown_keys_and_bad_names(api):
    ref = "registry.example.com/x/y:z"
    resp = api.call("POST", "/templates", json={"name": unique("tp"), "base_template": "sandbox", "source_oci_ref": ref,
                                                "dockerfile": "FROM x"})
    assert resp.status_code == 400 and "dockerfile" in error_message(resp)
    resp = api.call("POST", "/templates", json={"name": "bad name", "base_template": "sandbox", "source_oci_ref": ref})
    assert resp.status_code == 400


def test_base_template_is_required_and_must_be_a_documented_base(api):
    ref = "registry.example.com/x/y:z"
    resp = api.call("POST", "/templates", json={"name": unique("tp"), "source_oci_ref": ref})
    assert resp.status_code == 400 and "base_template" in error_message(resp)
    resp = api.call("POST", "/templates", json={"name": unique("tp"), "base_template": "ubuntu", "source_oci_ref": ref})
    assert resp.status_code == 400 and "ubuntu" in error_message(resp)


def test_the_template_object_reports_its_base(plane):
    # pydo get_template: {template_id, name, spec: {base_template}, status, created_at, updated_at};
    # pydo list_templates: the same without spec.
    client = plane.client()
    for item in client.list_templates():
        assert set(item) == {"template_id", "name", "status", "created_at", "updated_at"}
        t = client.get_template(item["template_id"])
        assert set(t) == {"template_id", "name", "spec", "status", "created_at", "updated_at"}
        assert "base_template" in t["spec"]


@local_only
def test_unreachable_registry_fails_the_build_with_the_tools_reason(plane, api):
    client = plane.client()
    t = client.create_template(unique("tpbad"), "localhost:1/nothing/here:v1", base_template="sandbox")
    try:
        t = wait_template(client, t["template_id"])
        assert t["status"] == "TEMPLATE_STATUS_FAILED"
        builds = client.list_builds(t["template_id"])
        assert builds[0]["status"] == "FAILED"
        assert "localhost:1" in builds[0]["error"]
        build = client.get_build(t["template_id"], builds[0]["build_id"])
        assert build["build_id"] == builds[0]["build_id"] and build["error"]
        resp = api.create("name: %s\nagent: custom\ntemplate: %s\n" % (unique(), t["name"]))
        assert resp.status_code == 400
    finally:
        client.delete_template(t["template_id"])


@local_only
def test_template_from_an_oci_layout_boots_sessions(plane, api, make_session, oci_layout):
    client = plane.client()
    t = client.create_template(unique("tplay"), oci_layout, base_template="sandbox")
    try:
        assert t["status"] in ("TEMPLATE_STATUS_PENDING", "TEMPLATE_STATUS_BUILDING")
        t = wait_template(client, t["template_id"])
        assert t["status"] == "TEMPLATE_STATUS_READY", client.list_builds(t["template_id"])
        assert t["spec"] == {"base_template": "sandbox"}
        s = make_session(template=t["name"])
        out = api.call("POST", "/sessions/%s/sandbox/exec" % s["session_id"], json={"argv": ["cat", "/marker"]}).json()
        assert out["stdout"] == "from-oci-image\n"
        # A template in use cannot be deleted from under its sessions.
        assert api.call("DELETE", "/templates/%s" % t["template_id"]).status_code == 409
        api.call("DELETE", "/sessions/%s" % s["session_id"])
        api.wait(s["session_id"], ("DESTROYED",))
    finally:
        resp = api.call("DELETE", "/templates/%s" % t["template_id"])
        assert resp.status_code == 200 and resp.json() == {"template_id": t["template_id"], "deleted": True}


@local_only
def test_template_from_a_local_registry_and_rebuild(plane, api, registry):
    client = plane.client()
    t = client.create_template(unique("tpreg"), registry, base_template="sandbox")
    try:
        t = wait_template(client, t["template_id"])
        assert t["status"] == "TEMPLATE_STATUS_READY", client.list_builds(t["template_id"])
        assert client.list_builds(t["template_id"])[0]["status"] == "SUCCEEDED"
        resp = api.call("PUT", "/templates/%s" % t["template_id"], json={"source_oci_ref": registry.replace(":v1", ":nope")})
        assert resp.status_code == 200
        deadline = time.time() + 120
        while True:
            builds = client.list_builds(t["template_id"])
            if len(builds) == 2 and builds[0]["status"] in ("SUCCEEDED", "FAILED"):
                break
            assert time.time() < deadline
            time.sleep(0.2)
        assert builds[0]["status"] == "FAILED" and "nope" in builds[0]["error"]
    finally:
        client.delete_template(t["template_id"])
