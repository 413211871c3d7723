"""The REST client against bursts of 429/502/503 from a proxy in front of the real plane."""
import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
from microvm_plane_testing import unique_name


def client(proxy, plane):
    return plane.client().__class__(proxy.url, plane.token, backoff=0.01, max_backoff=0.05)


@pytest.mark.parametrize("status,retry_after", [(503, None), (502, None), (429, "0")])
def test_get_rides_through_a_burst(plane, sandbox, proxy, status, retry_after):
    sid = sandbox["session_id"]
    proxy.fail_next(status, count=4, methods=("GET",), path="/sessions/", retry_after=retry_after)
    got = client(proxy, plane).get_session(sid)
    assert got["session_id"] == sid
    seen = proxy.requests("GET", "/sessions/" + sid)
    assert [entry[2] for entry in seen] == [status] * 4 + [200]


def test_get_gives_up_after_its_retries_with_a_clear_error(plane, sandbox, proxy):
    proxy.fail_next(503, count=50, methods=("GET",))
    c = client(proxy, plane)
    with pytest.raises(ApiError) as err:
        c.get_session(sandbox["session_id"])
    assert err.value.status == 503 and err.value.attempts == c.retries + 1
    assert len(proxy.requests("GET")) == c.retries + 1


def test_delete_rides_through_503_and_429(plane, proxy):
    direct = plane.client()
    sid = direct.create_session({"name": unique_name("del"), "agent": "custom"})["session_id"]
    direct.wait_session(sid, timeout=120)
    proxy.fail_next(503, count=2, methods=("DELETE",))
    proxy.fail_next(429, count=2, methods=("DELETE",), retry_after="0")
    client(proxy, plane).delete_session(sid)
    assert [entry[2] for entry in proxy.requests("DELETE")][:4] == [503, 503, 429, 429]
    gone = direct.wait_session(sid, until={"DESTROYED"}, timeout=60, gone_ok=True)
    assert gone is None or gone["status"].endswith("DESTROYED")


def _named(direct, name):
    return [s for s in direct.list_sessions(name=name) if s.get("name") == name]


def test_create_is_not_retried_on_503(plane, proxy):
    direct = plane.client()
    name = unique_name("post503")
    proxy.fail_next(503, count=1, methods=("POST",), path="/sessions$")
    with pytest.raises(ApiError) as err:
        client(proxy, plane).create_session({"name": name, "agent": "custom"})
    assert err.value.status == 503
    assert len(proxy.requests("POST", "/sessions$")) == 1, "a POST that starts work was sent again"
    assert _named(direct, name) == []


def test_create_on_429_is_retried_and_creates_exactly_one(plane, proxy):
    direct = plane.client()
    name = unique_name("post429")
    proxy.fail_next(429, count=2, methods=("POST",), path="/sessions$", retry_after="0")
    made = client(proxy, plane).create_session({"name": name, "agent": "custom"})
    try:
        assert [entry[2] for entry in proxy.requests("POST", "/sessions$")] == [429, 429, 201]
        assert [s["session_id"] for s in _named(direct, name)] == [made["session_id"]]
    finally:
        direct.delete_session(made["session_id"])


@pytest.mark.parametrize("status, headers, server_decides", [
    (503, {"ratelimit-limit": "250", "ratelimit-remaining": "249", "ratelimit-reset": "+3600"}, False),
    (503, {"ratelimit-limit": "250", "ratelimit-remaining": "0", "ratelimit-reset": "+3"}, True),
    (429, {"ratelimit-limit": "250", "ratelimit-remaining": "0", "ratelimit-reset": "+3"}, True),
])
def test_ratelimit_reset_drives_the_wait_only_when_the_quota_is_spent(plane, proxy, status, headers, server_decides):
    """Real HTTP through the proxy; only the sleep is recorded instead of slept, so nothing here is timed."""
    import time
    now = time.time()
    headers = dict(headers, **{"ratelimit-reset": str(int(now + float(headers["ratelimit-reset"])))})
    proxy.fail_next(status, count=1, methods=("GET",), path="/sessions$", headers=headers)
    c = plane.client().__class__(proxy.url, plane.token, backoff=0.01)
    slept = []
    c._sleep = slept.append
    c.list_sessions()
    assert [entry[2] for entry in proxy.requests("GET", "/sessions$")][:2] == [status, 200]
    assert len(slept) == 1
    if server_decides:
        assert 1.0 <= slept[0] <= 5.0, slept   # the reset, about 3 s away (whole seconds on the wire)
    else:
        assert slept[0] <= 0.01, slept          # the ordinary first backoff, not the reset an hour away
