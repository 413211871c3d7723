"""What the REST client says about its API URL: a path that is part of the API's routes, a path at a 404, and
nothing listening (issue 42)."""
import errno
import io
import json
import socket

import pytest

from ansible.module_utils.six.moves.urllib.error import HTTPError, URLError

from ansible_collections.microvm.sandbox.plugins.module_utils import profile, rest
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import describe_error


# -- a path in the URL -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("url, bare", [
    ("https://api.example.com/v2", "https://api.example.com"),
    ("https://api.example.com/v2/", "https://api.example.com"),
    ("https://api.example.com/v2/harness-runtime", "https://api.example.com"),
    ("https://api.example.com/v2/agents", "https://api.example.com"),
    ("https://gw.example.com/do/v2/harness-runtime", "https://gw.example.com/do"),
])
def test_a_url_with_the_apis_own_path_is_refused_before_any_request(monkeypatch, url, bare):
    calls = []
    monkeypatch.setattr(rest, "ansible_open", lambda *a: calls.append(a))
    with pytest.raises(rest.ApiError) as e:
        rest.ApiClient(url, "tok-secret-1")
    assert calls == []
    msg = describe_error(e.value)[0]
    path = url.split("example.com", 1)[1].rstrip("/")
    assert "carries the path %s" % path in msg, msg
    assert "to %s (" % bare in msg and "DO_AGENTS_API_URL" in msg and "route_prefix" in msg, msg
    assert "DO_AGENTS_API_PREFIX" in msg and "404" not in msg and "deleted" not in msg, msg
    assert "tok-secret-1" not in msg
    assert msg[0].isupper() and not msg.startswith("- -")


def test_a_url_with_the_legacy_prefix_also_says_to_choose_those_routes():
    problem = profile.api_url_path_problem("https://api.example.com/v2/agents", profile.DEFAULT_PREFIX)
    assert "route_prefix or env DO_AGENTS_API_PREFIX to /v2/agents" in problem
    # with the legacy prefix chosen already, there is nothing more to choose
    problem = profile.api_url_path_problem("https://api.example.com/v2/agents", profile.LEGACY_PREFIX)
    assert problem and "to /v2/agents for those routes" not in problem


@pytest.mark.parametrize("url, prefix", [
    ("https://api.example.com", None), ("http://127.0.0.1:8080/", None),
    ("https://gw.example.com/base", None),        # a gateway's mount point is kept, as documented
    ("https://gw.example.com/v2", "/custom"),      # a prefix outside /v2: the /v2 may be meant
])
def test_other_urls_are_taken_as_given(url, prefix):
    assert profile.api_url_path_problem(url, prefix) is None
    rest.ApiClient(url, "tok", prefix=prefix)


def _json_404():
    body = json.dumps({"id": "not_found", "message": "The resource you were accessing could not be found."})
    return HTTPError("http://x", 404, "Not Found", {"Content-Type": "application/json"}, io.BytesIO(body.encode()))


def test_a_404_under_a_url_with_a_path_names_the_path_and_the_bare_origin(monkeypatch):
    def fake_open(*_a):
        raise _json_404()
    monkeypatch.setattr(rest, "ansible_open", fake_open)
    c = rest.ApiClient("https://gw.example.com/base/", "tok")
    with pytest.raises(rest.ApiError) as e:
        c.get_session("s1")
    msg = describe_error(e.value, c)[0]
    assert "carries the path /base" in msg and "bare origin https://gw.example.com" in msg, msg
    assert "route_prefix" in msg and "DO_AGENTS_API_URL" in msg, msg


def test_a_404_under_a_bare_origin_keeps_the_plain_advice(monkeypatch):
    def fake_open(*_a):
        raise _json_404()
    monkeypatch.setattr(rest, "ansible_open", fake_open)
    c = rest.ApiClient("https://api.example.com", "tok")
    with pytest.raises(rest.ApiError) as e:
        c.get_session("s1")
    msg = describe_error(e.value, c)[0]
    assert "No session 's1'" in msg and "carries the path" not in msg, msg


# -- nothing listening ---------------------------------------------------------------------------------------

@pytest.fixture
def closed_port():
    """A loopback port nothing listens on: bound, then closed (a connect to it is refused)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def counted(monkeypatch):
    """Count the client's real requests and record its sleeps instead of sleeping."""
    attempts, sleeps = [], []
    real = rest.ansible_open

    def counting_open(*args):
        attempts.append(args[0])
        return real(*args)
    monkeypatch.setattr(rest, "ansible_open", counting_open)
    return attempts, sleeps


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_refused_connect_gets_one_quick_retry_then_says_what_to_do(closed_port, counted, method):
    attempts, sleeps = counted
    url = "http://127.0.0.1:%d" % closed_port
    c = rest.ApiClient(url, "tok-secret-2")
    c._sleep = sleeps.append
    with pytest.raises(rest.ApiError) as e:
        c.request(method, "/sessions", body={} if method == "POST" else None)
    assert len(attempts) == 2 and e.value.attempts == 2      # one retry, not six
    assert sleeps == [rest.REFUSED_RETRY_DELAY] and sleeps[0] <= 1.0
    assert e.value.refused and e.value.status == 0
    msg = describe_error(e.value, c)[0]
    assert url in msg and "connection refused" in msg and "after 2 attempts" in msg, msg
    assert "local control plane" in msg and "DO_AGENTS_API_URL" in msg, msg
    assert "tok-secret-2" not in msg and "Traceback" not in msg


def test_other_connection_errors_keep_the_backoff_and_its_retries(monkeypatch):
    calls, sleeps = [], []

    def reset(*args):
        calls.append(args)
        raise URLError(ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
    monkeypatch.setattr(rest, "ansible_open", reset)
    c = rest.ApiClient("http://plane.example.com", "tok")
    c._sleep = sleeps.append
    with pytest.raises(rest.ApiError) as e:
        c.list_sessions()
    assert len(calls) == c.retries + 1 and len(sleeps) == c.retries
    assert not e.value.refused and "connection refused" not in str(e.value)


def test_a_refused_connect_is_known_in_every_shape():
    assert rest._refused(URLError(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")))
    assert rest._refused(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"))
    assert rest._refused(OSError(errno.ECONNREFUSED, "Connection refused"))
    assert not rest._refused(URLError("refused"))          # a text says nothing certain
    assert not rest._refused(URLError(socket.timeout("timed out")))
