"""The REST client's transport: retry policy, error shapes, lookups, waits (its opener mocked)."""
import io
import json

import pytest

from ansible.module_utils.six.moves.urllib.error import HTTPError, URLError

from ansible_collections.microvm.sandbox.plugins.module_utils import rest
from microvm_fake_plane import FakeClient, FakePlane


class Resp(object):
    def __init__(self, status, body):
        self.status = status
        self.body = json.dumps(body).encode() if body is not None else b""

    def read(self):
        return self.body

    def getcode(self):
        return self.status


def http_error(status, body, retry_after=None, headers=None):
    headers = dict(headers or {})
    if retry_after:
        headers["Retry-After"] = retry_after
    return HTTPError("http://x", status, "err", headers, io.BytesIO(json.dumps(body).encode()))


@pytest.fixture
def transport(monkeypatch):
    """Queue answers for the client's opener; records the calls."""
    answers, calls = [], []

    def fake_open(url, data, headers, method, timeout, validate_certs):
        kw = {"data": data, "headers": headers, "method": method, "timeout": timeout, "validate_certs": validate_certs}
        calls.append((method, url, kw))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(rest, "ansible_open", fake_open)
    return answers, calls


def client():
    c = rest.ApiClient("http://plane:1/base/", "tok", prefix="v2/agents/")
    c._sleep = lambda s: None
    return c


def test_url_keeps_the_base_path_and_quotes_ids(transport):
    answers, calls = transport
    answers.append(Resp(200, {"session": {"session_id": "a/b"}}))
    client().get_session("a/b")
    assert calls[0][1] == "http://plane:1/base/v2/agents/sessions/a%2Fb"
    assert calls[0][2]["headers"]["Authorization"] == "Bearer tok"


def test_get_is_retried_on_5xx_and_429(transport):
    answers, calls = transport
    answers.extend([http_error(503, {"error": {"code": 503, "message": "busy"}}),
                    http_error(429, {"message": "slow down"}, retry_after="1"),
                    Resp(200, {"session": {"session_id": "s"}})])
    assert client().get_session("s") == {"session_id": "s"}
    assert len(calls) == 3


def test_post_is_not_retried_on_5xx(transport):
    answers, calls = transport
    answers.append(http_error(500, {"error": {"code": 500, "message": "boom"}}))
    with pytest.raises(rest.ApiError) as e:
        client().create_session({"name": "x"})
    assert len(calls) == 1
    assert e.value.status == 500 and e.value.server_message == "boom" and e.value.attempts == 1


def test_post_is_retried_on_429_and_counts_attempts(transport):
    answers, calls = transport
    c = client()
    answers.extend([http_error(429, {"id": "too_many_requests", "message": "rate limit"}) for _attempt in range(c.retries + 1)])
    with pytest.raises(rest.ApiError) as e:
        c.create_session({"name": "x"})
    assert len(calls) == c.retries + 1
    assert e.value.attempts == c.retries + 1
    assert e.value.server_message == "rate limit"  # the edge's error shape
    assert "after %d attempts" % (c.retries + 1) in e.value.hint


def test_connection_error_names_the_url(transport):
    answers, calls = transport
    answers.extend([URLError("refused")] * 10)
    with pytest.raises(rest.ApiError) as e:
        client().list_sessions()
    assert e.value.status == 0 and "cannot reach http://plane:1/base" in str(e.value)


def test_token_never_in_messages_or_repr(transport):
    answers, calls = transport
    answers.append(http_error(401, {"error": {"code": 401, "message": "bad token"}}))
    c = client()
    assert "tok" not in repr(c).replace("token", "")
    with pytest.raises(rest.ApiError) as e:
        c.list_sessions()
    assert "Bearer" not in str(e.value)


def test_create_sends_the_flat_spec_as_yaml_and_the_custom_adapter_by_default(transport):
    """CREATE-SESSION: YAML is the spec; JSON is only {name, config_id}. The body must be YAML, not JSON."""
    import yaml
    answers, calls = transport
    answers.append(Resp(201, {"session": {"session_id": "s"}}))
    client().create_session({"name": "x", "env": {"A": "1"}, "egress": ["h.example.com"]})
    url, kw = calls[0][1], calls[0][2]
    assert kw["headers"]["Content-Type"] == "application/yaml"
    text = kw["data"].decode("utf-8")
    with pytest.raises(ValueError):
        json.loads(text)  # block-style YAML, not JSON labelled as YAML
    assert yaml.safe_load(text) == {"name": "x", "agent": "custom", "env": {"A": "1"}, "egress": ["h.example.com"]}
    assert "?" not in url  # no query unless asked


@pytest.mark.parametrize("value, query", [(True, "resume_on_topoff=true"), (False, "resume_on_topoff=false")])
def test_resume_on_topoff_is_a_query_parameter_of_the_create(transport, value, query):
    answers, calls = transport
    answers.append(Resp(201, {"session": {"session_id": "s"}}))
    client().create_session({"name": "x"}, resume_on_topoff=value)
    assert calls[0][1].endswith("/sessions?" + query)
    assert b"resume_on_topoff" not in calls[0][2]["data"]


def test_update_session_patches_resume_on_topoff_as_json(transport):
    answers, calls = transport
    answers.append(Resp(200, {"session": {"session_id": "s", "resume_on_topoff": True}}))
    assert client().update_session("s", True)["resume_on_topoff"] is True
    method, url, kw = calls[0]
    assert method == "PATCH" and url.endswith("/sessions/s") and kw["headers"]["Content-Type"] == "application/json"
    assert json.loads(kw["data"]) == {"resume_on_topoff": True}


# -- waits asked for by the server -------------------------------------------

def sleeps_of(c):
    slept = []
    c._sleep = slept.append
    return slept


def test_retry_after_seconds_is_honoured_with_bounded_jitter(transport):
    answers, calls = transport
    c = client()
    slept = sleeps_of(c)
    answers.extend([http_error(429, {"message": "slow"}, retry_after="7"), Resp(200, {"sessions": []})])
    c.list_sessions()
    assert len(slept) == 1 and 7.0 <= slept[0] <= 8.0


def test_retry_after_http_date_is_honoured(transport):
    answers, calls = transport
    c = client()
    c._now = lambda: 1700000000.0
    slept = sleeps_of(c)
    # 12 seconds after c._now()
    answers.extend([http_error(503, {"message": "busy"}, retry_after="Tue, 14 Nov 2023 22:13:32 GMT"),
                    Resp(200, {"sessions": []})])
    c.list_sessions()
    assert len(slept) == 1 and 12.0 <= slept[0] <= 13.3


def test_ratelimit_reset_epoch_is_honoured_when_there_is_no_retry_after(transport):
    answers, calls = transport
    c = client()
    c._now = lambda: 1700000000.0
    slept = sleeps_of(c)
    limits = {"ratelimit-limit": "250", "ratelimit-remaining": "0", "ratelimit-reset": "1700000004"}
    answers.extend([http_error(429, {"message": "slow"}, headers=limits),
                    Resp(201, {"session": {"session_id": "s"}})])
    c.create_session({"name": "x"})  # a POST is retried on 429: nothing was done
    assert len(slept) == 1 and 4.0 <= slept[0] <= 5.0


def test_server_waits_are_capped_and_retries_bounded(transport):
    answers, calls = transport
    c = client()
    c._now = lambda: 1700000000.0
    slept = sleeps_of(c)
    answers.extend([http_error(429, {"message": "slow"}, headers={"ratelimit-reset": "1700003600"})
                    for _attempt in range(c.retries + 1)])
    with pytest.raises(rest.ApiError) as e:
        c.list_sessions()
    assert e.value.status == 429 and len(calls) == c.retries + 1
    assert len(slept) == c.retries and all(c.max_backoff <= s <= c.max_backoff + 1.0 for s in slept)


NOW = 1700000000.0


def one_retry_sleep(transport, status, headers):
    """The one sleep before the retry of a GET answered `status` with `headers`, then 200."""
    answers, calls = transport
    c = client()
    c._now = lambda: NOW
    slept = sleeps_of(c)
    answers.extend([http_error(status, {"message": "x"}, headers=headers), Resp(200, {"sessions": []})])
    c.list_sessions()
    assert len(calls) == 2 and len(slept) == 1
    return c, slept[0]


def backoff_range(c, attempt=0):
    base = min(c.backoff * (2 ** attempt), c.max_backoff)
    return base / 2, base


@pytest.mark.parametrize("status, headers, wait", [
    # A 429 is a spent quota whatever ratelimit-remaining says: ratelimit-reset is when to come back.
    (429, {"ratelimit-reset": str(int(NOW) + 6)}, 6.0),
    (429, {"ratelimit-remaining": "3", "ratelimit-reset": str(int(NOW) + 6)}, 6.0),
    # A 5xx with the quota spent (remaining 0) also waits for the reset.
    (503, {"ratelimit-limit": "250", "ratelimit-remaining": "0", "ratelimit-reset": str(int(NOW) + 9)}, 9.0),
    (500, {"RateLimit-Remaining": "0", "RateLimit-Reset": "4"}, 4.0),  # any case; a small value is seconds
    # Retry-After is an explicit wish on any status, quota left or not.
    (503, {"Retry-After": "5", "ratelimit-remaining": "100", "ratelimit-reset": str(int(NOW) + 3600)}, 5.0),
])
def test_the_server_decides_the_wait_when_it_asks_or_the_quota_is_spent(transport, status, headers, wait):
    c, slept = one_retry_sleep(transport, status, headers)
    assert wait <= slept <= wait + 1.0


@pytest.mark.parametrize("status, headers", [
    # Quota left: the 5xx is an ordinary error; the reset an hour away must not make the client sleep 30 s.
    (503, {"ratelimit-limit": "250", "ratelimit-remaining": "249", "ratelimit-reset": str(int(NOW) + 3600)}),
    (502, {"ratelimit-remaining": "1", "ratelimit-reset": "20"}),
    # No ratelimit-remaining at all says nothing about the quota.
    (503, {"ratelimit-reset": str(int(NOW) + 3600)}),
    # Unreadable values are ignored, not guessed at.
    (503, {"ratelimit-remaining": "zero", "ratelimit-reset": str(int(NOW) + 3600)}),
    (429, {"ratelimit-reset": "soon"}),
    (503, {}),
])
def test_otherwise_it_backs_off_exponentially_with_jitter(transport, status, headers):
    c, slept = one_retry_sleep(transport, status, headers)
    low, high = backoff_range(c)
    assert low <= slept <= high


def test_backoff_without_server_wishes_has_jitter(transport):
    c = client()
    delays = set(round(c._delay(3), 6) for _i in range(20))
    assert len(delays) > 1 and all(0 < d <= c.max_backoff for d in delays)


# -- blocking calls that get no answer ----------------------------------------

def test_blocking_calls_use_the_blocking_timeout(transport):
    answers, calls = transport
    c = rest.ApiClient("http://plane:1", "tok", timeout=30, blocking_timeout=1200)
    answers.extend([Resp(200, {"checkpoints": []}), Resp(200, {"checkpoint": {"checkpoint_id": "c"}})])
    c.create_checkpoint("s", "lbl")
    assert [kw["timeout"] for _m, _u, kw in calls] == [30, 1200]


def test_404_error_names_the_object(transport):
    answers, calls = transport
    answers.append(http_error(404, {"error": {"code": 404, "message": "session 'zz' not found"}}))
    with pytest.raises(rest.ApiError) as e:
        client().get_session("zz")
    assert e.value.gone and e.value.what == "session" and e.value.ident == "zz"


# -- lookups and waits through the fake plane --------------------------------

@pytest.fixture
def fake():
    plane = FakePlane()
    FakeClient.plane = plane
    return plane, FakeClient("http://x", "t")


def test_find_session_by_name_id_and_gone(fake):
    plane, c = fake
    live = plane.add_session("web")
    gone = plane.add_session("old", status="DESTROYED")
    assert c.find_session("WEB")["session_id"] == live["session_id"]
    assert c.find_session(live["session_id"])["name"] == "web"
    assert c.find_session("old") is None  # names match live sessions only
    assert c.find_session(gone["session_id"])["status"] == "SESSION_STATUS_DESTROYED"
    with pytest.raises(rest.NotFound) as e:
        c.require_session(gone["session_id"], live=True)
    assert "DESTROYED" in e.value.server_message
    with pytest.raises(rest.NotFound):
        c.require_session("ghost")


def test_ids_are_opaque_whatever_their_shape(fake):
    # The docs show UUIDs, cp_9f2c1a4b and sess_abc123: no shape decides "id or name"; a name is tried, then an id.
    plane, c = fake
    assert c.find_session("2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1") is None
    assert [m for m, p in plane.calls] == ["GET", "GET"]
    assert plane.calls[0][1] == "/sessions" and plane.calls[1][1].startswith("/sessions/2f0c")
    # and an id in doctl's shape is found as an id
    rec = plane.add_session("demo")
    plane.sessions["sess_abc123"] = dict(plane.sessions.pop(rec["session_id"]), session_id="sess_abc123")
    assert c.find_session("sess_abc123")["name"] == "demo"


def test_wait_session_reports_the_state_reached(fake, monkeypatch):
    plane, c = fake
    s = plane.add_session("web", status="PAUSED")
    with pytest.raises(rest.WaitTimeout) as e:
        c.wait_session(s["session_id"], timeout=0)
    assert e.value.status == "PAUSED" and "it is PAUSED" in str(e.value)
    f = plane.add_session("bad", status="FAILED", warnings=["the sandbox failed to boot: disk full"])
    with pytest.raises(rest.WaitTimeout) as e:
        c.wait_session(f["session_id"], timeout=5)
    assert "became FAILED" in str(e.value) and e.value.status == "FAILED"
    assert "the sandbox failed to boot: disk full" in str(e.value)  # the documented warnings, the only words


def test_pagination_follows_tokens(fake):
    plane, c = fake
    for i in range(7):
        plane.add_session("s%d" % i)
    assert [s["name"] for s in c.list_sessions()] == ["s%d" % i for i in range(7)]


def test_newest_build_excludes_known(fake):
    plane, c = fake
    t = c.create_template("t", "registry.example.com/a:1", "sandbox")
    first = c.newest_build(t["template_id"])
    c.update_template(t["template_id"])
    second = c.newest_build(t["template_id"], exclude=[first["build_id"]])
    assert second["build_id"] != first["build_id"]
    assert c.newest_build(t["template_id"])["build_id"] == second["build_id"]


def test_an_unanswered_checkpoint_is_found_not_sent_again(fake):
    plane, c = fake
    s = plane.add_session("web")
    plane.unanswered.append(("POST", "/checkpoints"))
    cp = c.create_checkpoint(s["session_id"], "before-upgrade")
    assert cp["label"] == "before-upgrade" and cp["status"] == "READY"
    assert [m for m, p in plane.mutating_calls()] == ["POST"]  # never re-sent
    assert len(plane.checkpoints[s["session_id"]]) == 1


def test_an_unanswered_call_whose_effect_never_shows_is_reported_unknown(fake):
    plane, c = fake
    s = plane.add_session("web", status="PAUSED")
    c.reconcile_timeout = 0
    plane.fail_next.append(("POST", "/sessions/%s/resume" % s["session_id"], 0, "timed out"))
    with pytest.raises(rest.OutcomeUnknown) as e:
        c.resume_session(s["session_id"])
    assert "not sent again" in str(e.value) and e.value.no_response


def test_an_unanswered_resume_that_happened_is_a_success(fake):
    plane, c = fake
    s = plane.add_session("web", status="PAUSED")
    plane.unanswered.append(("POST", "/resume"))
    assert c.resume_session(s["session_id"])["status"] == "SESSION_STATUS_READY"
    assert [p for m, p in plane.mutating_calls()].count("/sessions/%s/resume" % s["session_id"]) == 1


def test_an_unanswered_rollback_is_confirmed_by_the_new_sandbox(fake):
    plane, c = fake
    s = plane.add_session("web")
    before = s["sandbox_id"]
    cp = c.create_checkpoint(s["session_id"])
    plane.unanswered.append(("POST", "/rollback"))
    after = c.rollback(s["session_id"], cp["checkpoint_id"])
    assert after["sandbox_id"] != before


def test_an_unanswered_fork_returns_the_children_by_lineage(fake):
    plane, c = fake
    s = plane.add_session("web")
    plane.unanswered.append(("POST", "/fork"))
    children = c.fork_session(s["session_id"], count=3)
    assert sorted(ch["name"] for ch in children) == ["web-fork-1", "web-fork-2", "web-fork-3"]
    assert [p for m, p in plane.mutating_calls() if p.endswith("/fork")] == ["/sessions/%s/fork" % s["session_id"]]


@pytest.mark.parametrize("status", [502, 504])
def test_an_edge_timeout_on_a_blocking_call_is_reconciled_like_no_answer(fake, status):
    """The gateway gave up, the work went on: look it up, never re-send, never report a failure that did not happen."""
    plane, c = fake
    s = plane.add_session("web")
    plane.unanswered.append(("POST", "/checkpoints", status))
    cp = c.create_checkpoint(s["session_id"], "edge")
    assert cp["label"] == "edge" and [m for m, p in plane.mutating_calls()] == ["POST"]
    plane.unanswered.append(("POST", "/fork", status))
    children = c.fork_session(s["session_id"], count=2)
    assert len(children) == 2 and [p for m, p in plane.mutating_calls()].count("/sessions/%s/fork" % s["session_id"]) == 1
    before = plane.sessions[s["session_id"]]["sandbox_id"]
    plane.unanswered.append(("POST", "/rollback", status))
    assert c.rollback(s["session_id"], cp["checkpoint_id"])["sandbox_id"] != before
    paused = plane.add_session("sleepy", status="PAUSED")
    plane.unanswered.append(("POST", "/resume", status))
    assert c.resume_session(paused["session_id"])["status"] == "SESSION_STATUS_READY"


def test_an_edge_timeout_whose_effect_never_shows_is_unknown_not_failed(fake):
    plane, c = fake
    s = plane.add_session("web", status="PAUSED")
    c.reconcile_timeout = 0
    plane.fail_next.append(("POST", "/sessions/%s/resume" % s["session_id"], 504, "upstream request timeout"))
    with pytest.raises(rest.OutcomeUnknown) as e:
        c.resume_session(s["session_id"])
    assert "HTTP 504" in str(e.value) and "not sent again" in str(e.value)
    assert [p for m, p in plane.mutating_calls()].count("/sessions/%s/resume" % s["session_id"]) == 1


def test_a_refusal_of_a_blocking_call_is_reported_at_once(fake):
    """A 409 or a 503 is the service's own answer (nothing was done): no lookup, the error itself."""
    plane, c = fake
    s = plane.add_session("web", status="PAUSED")
    for status in (409, 503):
        plane.fail_next.append(("POST", "/sessions/%s/resume" % s["session_id"], status, "no"))
        with pytest.raises(rest.ApiError) as e:
            c.resume_session(s["session_id"])
        assert e.value.status == status and not isinstance(e.value, rest.OutcomeUnknown)


def test_sizes_are_listed(fake):
    plane, c = fake
    assert c.list_sizes()[0]["slug"] == "mars-2vcpu-4gb"


# -- waits for a boot ----------------------------------------------------------

def test_a_young_wait_polls_every_quarter_second_then_backs_off():
    from ansible_collections.microvm.sandbox.plugins.module_utils import rest
    delays, waited, delay = [], 0.0, rest.POLL_FIRST
    while waited < 60:
        delays.append(delay)
        waited += delay
        delay = rest.poll_delay(delay, waited)
    young = [d for d, at in zip(delays, [sum(delays[:i]) for i in range(len(delays))]) if at < rest.POLL_FAST_FOR]
    # a boot that ends is seen within a quarter second while the wait is young ...
    assert max(young) == rest.POLL_FAST and young[0] == rest.POLL_FIRST
    # ... and a long wait does not keep hammering the API: it reaches the slow pace, never beyond
    assert delays[-1] == rest.POLL_SLOW and max(delays) == rest.POLL_SLOW
    assert len(delays) < 120


def test_wait_session_sees_ready_within_a_fast_poll(transport):
    answers, _calls = transport
    c = client()
    slept = sleeps_of(c)
    for _n in range(12):
        answers.append(Resp(200, {"session": {"session_id": "s", "status": "SESSION_STATUS_CREATING"}}))
    answers.append(Resp(200, {"session": {"session_id": "s", "status": "SESSION_STATUS_READY"}}))
    assert c.wait_session("s", timeout=60)["status"] == "SESSION_STATUS_READY"
    assert len(slept) == 12 and max(slept) <= 0.25
