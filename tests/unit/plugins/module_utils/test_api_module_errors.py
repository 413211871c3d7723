"""describe_error: one message per failure kind, with the server's words and what to do."""
import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils import api_module
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import describe_error, parse_duration
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError, NotFound, WaitTimeout
from microvm_fake_plane import FakeClient, FakePlane


def err(status, message="server says no", path="/sessions/abc", method="GET", what="session", ident="abc", attempts=1):
    return ApiError(method, path, status, message, what=what, ident=ident, attempts=attempts)


def test_401_points_at_the_token():
    msg, details = describe_error(err(401))
    assert "refused the API token" in msg and "DO_AGENTS_API_TOKEN" in msg and "server says no" in msg
    assert details["http_status"] == 401 and details["api_call"] == "GET /sessions/abc"


def test_403_points_at_the_scopes():
    msg = describe_error(err(403))[0]
    assert "not allowed" in msg and "server says no" in msg


def test_404_names_the_id():
    msg = describe_error(err(404, "session 'abc' not found"))[0]
    assert "No session 'abc'" in msg and "session 'abc' not found" in msg


def test_not_found_lookup():
    msg = describe_error(NotFound("session", "web-1", "(looked everywhere)"))[0]
    assert msg.startswith("No session with id or name 'web-1' (looked everywhere)")


def test_409_adds_the_current_state():
    plane = FakePlane()
    FakeClient.plane = plane
    s = plane.add_session("web-1", status="PROVISIONING")
    plane.sessions[s["session_id"]]["status"] = "SESSION_STATUS_PROVISIONING"
    e = err(409, "only a READY or DETACHED session can be paused", path="/sessions/%s/pause" % s["session_id"],
            method="POST")
    msg = describe_error(e, FakeClient("http://x", "t"))[0]
    assert "HTTP 409" in msg and "only a READY" in msg and "'web-1' was in state" in msg


def test_409_without_a_client_still_has_the_server_message():
    msg = describe_error(err(409, "a live session named 'x' already exists", path="/sessions", method="POST"))[0]
    assert "already exists" in msg


@pytest.mark.parametrize("status", [429, 503])
def test_rate_limits_and_server_errors_say_retries(status):
    msg = describe_error(err(status, attempts=6))[0]
    assert "6 attempts" in msg and "retry later" in msg.lower() and "server says no" in msg


def test_no_token_and_no_connection():
    msg = describe_error(ApiError("-", "-", 0, "no API token"))[0]
    assert "No API token" in msg and "DO_AGENTS_API_TOKEN" in msg
    msg = describe_error(ApiError("GET", "/sessions", 0, "cannot reach http://x: refused", attempts=6))[0]
    assert "DO_AGENTS_API_URL" in msg and "refused" in msg and "6 attempts" in msg


def test_400_passes_the_server_message():
    msg = describe_error(err(400, "idle_timeout must be a duration", method="POST", path="/sessions"))[0]
    assert "HTTP 400" in msg and "idle_timeout must be a duration" in msg


def test_wait_timeout_says_which_state_was_reached():
    e = WaitTimeout("timed out after 5s waiting for session s to be DETACHED/READY; it is PROVISIONING",
                    {"session_id": "s"}, status="PROVISIONING", wanted="DETACHED/READY", timeout=5, what="session")
    msg, details = describe_error(e)
    assert "last status reached was PROVISIONING" in msg and "wait_timeout" in msg
    assert details["reached_status"] == "PROVISIONING" and details["session"] == {"session_id": "s"}


def test_template_build_failure_keeps_the_build_error():
    e = WaitTimeout("the build of template t failed: skopeo said no", {}, status="FAILED", what="template")
    msg = describe_error(e)[0]
    assert "skopeo said no" in msg and "force_rebuild" in msg


@pytest.mark.parametrize("value,seconds", [(600, 600), ("600", 600), ("600s", 600), ("10m", 600),
                                           ("1h30m", 5400), ("1d", 86400)])
def test_parse_duration(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "10x", "", "5m soon", True])
def test_parse_duration_refuses(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_argument_spec_is_shared_and_extensible():
    spec = api_module.api_argument_spec(name=dict(type="str"))
    assert spec["api_token"]["no_log"] is True
    assert set(spec) == {"api_url", "api_token", "route_prefix", "request_timeout", "blocking_timeout", "wait_timeout",
                         "validate_certs", "name"}
