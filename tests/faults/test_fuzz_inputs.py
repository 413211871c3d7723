"""Hypothesis against bad input: the client's path guard, the agent's transfer paths in a real guest,
and REST create bodies and names against the real plane."""
import posixpath
import uuid

import hypothesis
import pytest
from hypothesis import strategies as st

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

SETTINGS = dict(deadline=None, suppress_health_check=list(hypothesis.HealthCheck), derandomize=True)

# ---------------------------------------------------------------- the local guard (no network)

SEGMENT = st.one_of(st.sampled_from(["workspace", "..", ".", "", "tmp", "etc", ".scratch", "~", "workspace2"]),
                    st.text(max_size=12))


@hypothesis.settings(max_examples=400, **SETTINGS)
@hypothesis.given(parts=st.lists(SEGMENT, max_size=8), lead=st.sampled_from(["/", "//", "", "./", "/workspace/"]))
def test_check_transfer_path_never_accepts_a_path_outside_the_workspace(parts, lead):
    path = lead + "/".join(parts)
    try:
        got = profile.check_transfer_path(path)
    except profile.TransferPathError as e:
        assert str(e) and (repr(path) in str(e) or "empty" in str(e)), e
        return
    assert got == posixpath.normpath(got) and "\x00" not in got
    assert got == "/workspace" or got.startswith("/workspace/"), (path, got)
    assert ".." not in got.split("/")


# ---------------------------------------------------------------- the agent in a real guest

# names planted in the guest: links out, a link back in, a loop, and a dangling link out
PLANT = ("mkdir -p /workspace/real /workspace/fz && echo outside-secret > /tmp/outside.txt && cd /workspace/fz && "
         "ln -sfn /tmp out && ln -sfn /workspace/real in && ln -sfn .. up && ln -sfn loop loop && "
         "ln -sfn /nonexistent/x dangling && ln -sfn /tmp/outside.txt outfile")
AGENT_SEGMENT = st.one_of(st.sampled_from(["out", "in", "up", "loop", "dangling", "outfile", "..", ".", "real", "x.txt"]),
                          st.text(alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=8),
                          st.just("L" * 300), st.just("a\x00b"))


def test_agent_transfer_paths_never_escape_the_workspace(plane, sandbox, agents, tmp_path):
    sid = sandbox["session_id"]
    agent = agents(plane.url, plane.token, sid)
    assert agent.exec(["sh", "-c", PLANT]).exit_code == 0
    mark = "fuzz-" + uuid.uuid4().hex
    src = tmp_path / "src"
    src.write_text(mark + "\n")
    outcomes = {"ok": 0, "refused": 0}

    @hypothesis.settings(max_examples=40, **SETTINGS)
    @hypothesis.given(parts=st.lists(AGENT_SEGMENT, min_size=1, max_size=5),
                      root=st.sampled_from(["/workspace/fz/", "/workspace/", "fz/", "/tmp/", "/workspace/fz/up/up/"]))
    def one(parts, root):
        path = root + "/".join(parts)
        for op in ("upload", "download"):
            try:
                if op == "upload":
                    agent.upload(str(src), path)
                else:
                    dest = tmp_path / "dl"
                    agent.download(path, str(dest))
                    assert dest.read_bytes() != b"outside-secret\n", "downloaded a file from outside /workspace: %r" % path
                outcomes["ok"] += 1
            except (errors.SandboxError, profile.TransferPathError) as e:
                assert str(e).strip(), "an empty error for %r" % path
                outcomes["refused"] += 1
            except ValueError as e:   # protobuf refuses a str it cannot encode, before any network call
                assert "\x00" not in path or "NUL" in str(e) or str(e), (path, e)
                outcomes["refused"] += 1

    one()
    assert outcomes["ok"] and outcomes["refused"], outcomes
    # nothing written outside /workspace, the outside file intact, the agent still serving
    r = agent.exec(["sh", "-c", "grep -rl %s / --exclude-dir=workspace --exclude-dir=proc --exclude-dir=sys "
                                "--exclude-dir=dev 2>/dev/null; cat /tmp/outside.txt" % mark])
    assert r.stdout == b"outside-secret\n", r.stdout[-2000:]


# ---------------------------------------------------------------- REST bodies and names

JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                       lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
                       max_leaves=12)
FIELDS = ["name", "agent", "template", "env", "egress", "idle_timeout", "ttl", "resources", "labels", "from_checkpoint"]
BODY = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), JSONISH, max_size=5),
    st.fixed_dictionaries({"name": st.text(max_size=80), "agent": st.sampled_from(["none", "custom", "", "x", 1])}),
    JSONISH,
)


@pytest.fixture
def strict(plane):
    if plane.live:
        pytest.skip("fuzzing creates sessions: local plane only")
    return plane.client(retries=0)


def _health(plane):
    return plane.client(retries=0).list_sessions(page_size=1) is not None


def test_create_bodies_are_4xx_with_a_message_never_5xx(plane, strict):
    made = []

    @hypothesis.settings(max_examples=30, **SETTINGS)
    @hypothesis.given(body=BODY, as_yaml=st.booleans(), raw=st.one_of(st.none(), st.binary(max_size=64)))
    def one(body, as_yaml, raw):
        import json
        data = raw if raw is not None else json.dumps(body).encode()
        try:
            got = strict.request("POST", "/sessions", raw=data,
                                 content_type="application/yaml" if as_yaml else "application/json")
        except ApiError as e:
            assert 400 <= e.status < 500, (body, raw, e.status, str(e))
            assert str(e).strip()
            return
        made.append(got["session"]["session_id"])
        strict.delete_session(made[-1])   # at once: a valid body boots a guest

    one()
    print("valid bodies among the examples: %d" % len(made))
    assert _health(plane)


@hypothesis.settings(max_examples=30, **SETTINGS)
@hypothesis.given(name=st.text(max_size=100) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
def test_names_in_routes_and_queries_are_never_5xx(plane, strict, name):
    for call in (lambda: strict.get_session(name), lambda: strict.list_sessions(name=name),
                 lambda: strict.delete_session(name)):
        try:
            call()
        except ApiError as e:
            assert 400 <= e.status < 500, (name, e.status, str(e))
            assert str(e).strip()
    assert _health(plane)
