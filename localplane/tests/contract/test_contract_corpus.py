"""The plane's answers, key for key, against the documented examples (tests/platform_corpus/).

One test per corpus file: the same call is made against the plane, and its response must carry exactly the
documented keys (none the docs do not show, none they show missing), recursively, with the documented status
class and the ratelimit-* headers. New files are picked up by themselves; an operation that changes state needs a
recipe in RECIPES (how to make the call without spoiling the shared objects), and the test says so.
"""
import os
import sys
import time

import pytest

from contract_support import unique

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "support"))

from platform_corpus import key_differences, load  # noqa: E402

EXAMPLES = load()
RATE_HEADERS = ("ratelimit-limit", "ratelimit-remaining", "ratelimit-reset")


@pytest.fixture(scope="module")
def world(plane, api):
    """The objects the examples' path parameters name: a session, a checkpoint, a template with a build, an
    Environment Config and a persistent workspace."""
    client = plane.client()
    made = []

    def make_session():
        resp = api.create({"name": unique("corpus"), "agent": "custom"})
        assert resp.status_code in (200, 201), resp.text
        sid = resp.json()["session"]["session_id"]
        made.append(sid)
        return api.wait(sid, ("READY", "DETACHED"))

    session = make_session()
    cp = client.create_checkpoint(session["session_id"], label="corpus")
    template = client.create_template(unique("tpc"), "localhost:1/nothing/here:v1", base_template="sandbox")
    builds = []
    deadline = time.time() + 120
    while time.time() < deadline:
        builds = client.list_builds(template["template_id"])
        if builds and builds[0]["status"] in ("FAILED", "SUCCEEDED"):
            break
        time.sleep(0.1)
    config = _make_config(api)
    yield {"session_id": session["session_id"], "checkpoint_id": cp["checkpoint_id"],
           "template_id": template["template_id"], "build_id": builds[0]["build_id"], "make_session": make_session,
           "config_id": config, "make_config": lambda: _make_config(api),
           "make_workspace": lambda: _make_workspace(api)}
    for sid in made:
        api.call("DELETE", "/sessions/%s" % sid)
    api.call("DELETE", "/configs/%s" % config)
    client.delete_template(template["template_id"])


def _make_config(api):
    resp = api.call("POST", "/configs", json={"name": unique("corpuscfg"),
                                              "manifest_yaml": "name: from-config\nagent: custom\n"})
    assert resp.status_code == 201, resp.text
    return resp.json()["config"]["id"]


def _make_workspace(api):
    resp = api.call("POST", "/workspaces", json={"size_limit_gib": 1, "name": unique("corpusws")})
    assert resp.status_code in (200, 201), resp.text
    return resp.json()["workspace"]["workspace_id"]


def _fill(path, ids):
    for key, value in ids.items():
        if isinstance(value, str):
            path = path.replace("{%s}" % key, value)
    return path


def _throwaway_session(world):
    return {"session_id": world["make_session"]()["session_id"]}


# How to make a state-changing call without spoiling the shared objects: -> (ids, body, content type, query).
RECIPES = {
    "sessions.create": lambda w, ex: ({}, dict(ex.request["body"], name=unique("corpus")), "application/yaml", None),
    "sessions.delete": lambda w, ex: (_throwaway_session(w), None, None, None),
    "sessions.pause": lambda w, ex: (_throwaway_session(w), {}, "application/json", None),
    "sessions.resume": None,  # needs a paused session: made in _call
    "sessions.fork": lambda w, ex: (w, {"from_checkpoint_id": w["checkpoint_id"], "count": 1}, "application/json",
                                    None),
    "sessions.update": lambda w, ex: (w, ex.request["body"], "application/json", None),
    "sessions.exec": lambda w, ex: (w, ex.request["body"], "application/json", None),
    "checkpoints.create": lambda w, ex: (w, {"label": "corpus-" + unique()[-6:]}, "application/json", None),
    "checkpoints.delete": None,  # needs a checkpoint of its own: made in _call
    "checkpoints.rollback": lambda w, ex: (_throwaway_with_checkpoint(w), {}, "application/json", None),
    "templates.create": None,  # a build needs a registry: covered by the template module tests
    "templates.update": None,
    "templates.delete": None,
    "configs.delete": lambda w, ex: ({"config_id": w["make_config"]()}, None, None, None),
    "workspaces.delete": lambda w, ex: ({"workspace_id": w["make_workspace"]()}, None, None, None),
    "errors.not_found": lambda w, ex: ({"session_id": "sess_doesnotexist"}, None, None, None),
    "errors.bad_request": lambda w, ex: ({}, None, None, {"page_token": "not-a-token"}),
}
# Operations whose documented reply is checked elsewhere, with why.
ELSEWHERE = {
    "templates.create": "needs an image registry; test_contract_templates checks the object on create",
    "templates.update": "needs an image registry; test_contract_templates checks the object on update",
    "templates.delete": "deleting the shared template would spoil the other examples; the fixture deletes it",
}


def _throwaway_with_checkpoint(world):
    sid = world["make_session"]()["session_id"]
    return {"session_id": sid, "checkpoint_id": world["client"].create_checkpoint(sid)["checkpoint_id"]}


def _call(plane, api, world, ex):
    world = dict(world, client=plane.client())
    body, ctype, query = None, None, dict(ex.request.get("query") or {})
    ids = world
    if ex.operation in RECIPES and RECIPES[ex.operation] is None:
        if ex.operation == "sessions.resume":
            ids = _throwaway_session(world)
            world["client"].pause_session(ids["session_id"])
            api.wait(ids["session_id"], ("PAUSED",))
            body, ctype = {}, "application/json"
        elif ex.operation == "checkpoints.delete":
            ids = dict(world, checkpoint_id=world["client"].create_checkpoint(world["session_id"])["checkpoint_id"])
        else:
            pytest.skip(ELSEWHERE[ex.operation])
    elif ex.operation in RECIPES:
        ids, body, ctype, q = RECIPES[ex.operation](world, ex)
        query = q if q is not None else query
    elif ex.method != "GET":
        pytest.fail("%s changes state: add a recipe to RECIPES in %s" % (ex.operation, __file__))
    path = _fill(ex.route, ids)
    assert "{" not in path, "no object for %s in this test's world: add one to the fixture" % path
    if ctype == "application/yaml":
        return api.create(body)
    kwargs = {"params": query}
    if body is not None:
        kwargs["json"] = body
    return api.call(ex.method, path, **kwargs)


@pytest.mark.parametrize("ex", EXAMPLES, ids=[ex.file for ex in EXAMPLES])
def test_the_plane_answers_in_the_documented_shape(plane, api, world, ex):
    resp = _call(plane, api, world, ex)
    if ex.status == 204 or ex.status >= 400:
        assert resp.status_code == ex.status, (ex.file, resp.status_code, resp.text[:500])
    else:
        assert 200 <= resp.status_code < 300, (ex.file, resp.status_code, resp.text[:500])
    for header in RATE_HEADERS:
        assert header in resp.headers, "%s: no %s header" % (ex.file, header)
    if ex.body is None:
        assert not resp.content, (ex.file, resp.text[:200])
        return
    problems = key_differences(ex.body, resp.json())
    assert not problems, "%s (%s %s):\n  %s" % (ex.file, ex.source["page"], ex.source["version"],
                                                "\n  ".join(problems))


def test_both_documented_prefixes_answer(plane, api, world):
    for prefix in ("/v2/harness-runtime", "/v2/agents"):
        resp = api.http.get(plane.url.rstrip("/") + prefix + "/sessions/" + world["session_id"],
                            headers={"Authorization": "Bearer " + plane.token}, timeout=60)
        assert resp.status_code == 200, (prefix, resp.text[:300])


def test_ids_are_opaque_and_never_paths(plane, api, world):
    # Any string is looked up as an id (404 when unknown); one that looks like a path names nothing and removes
    # nothing. The plane's own checkpoint ids look like the documented ones (cp_...), not like UUIDs.
    sid, cid = world["session_id"], world["checkpoint_id"]
    assert cid.startswith("cp_")
    for bad in ("sess_abc123", "cp_9f2c1a4b", "..%2F..%2Fsessions", "%2E%2E"):
        assert api.call("GET", "/sessions/%s" % bad).status_code == 404, bad
        assert api.call("GET", "/sessions/%s/checkpoints/%s" % (sid, bad)).status_code == 404, bad
        assert api.call("DELETE", "/sessions/%s/checkpoints/%s" % (sid, bad)).status_code == 204, bad
    assert api.call("GET", "/sessions/%s/checkpoints/%s" % (sid, cid)).status_code == 200
    assert api.call("GET", "/sessions/%s/checkpoints/%s" % (sid, cid.upper())).status_code == 200
