"""Every route, and the WebSocket upgrade, wants the bearer token."""
import asyncio
import uuid

import pytest
from websockets.exceptions import InvalidStatus

from contract_support import error_message, ws_connect


def absent_id(n):
    """A well-formed session id no plane has made; fixed, so that every pytest worker collects the same tests."""
    return uuid.uuid5(uuid.NAMESPACE_URL, "microvm-sandbox-test-absent-%d" % n)


ROUTES = [
    ("GET", "/sessions"),
    ("POST", "/sessions"),
    ("GET", "/sessions/%s" % absent_id(1)),
    ("DELETE", "/sessions/%s" % absent_id(2)),
    ("POST", "/sessions/%s/pause" % absent_id(3)),
    ("GET", "/sessions/%s/checkpoints" % absent_id(4)),
    ("GET", "/templates"),
]


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("token", [None, "Bearer wrong-token", "bearer wrong-token", "Basic Zm9vOmJhcg==", "Bearer"])
def test_missing_or_wrong_token_is_401(api, method, path, token):
    resp = api.call(method, path, token=token or False, data="{}", headers={"Content-Type": "application/json"})
    assert resp.status_code == 401
    assert error_message(resp)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_auth_scheme_is_case_insensitive(plane, scheme):
    # RFC 7235 2.1: the scheme is a case-insensitive token
    import requests
    resp = requests.get(plane.url + "/v2/agents/sessions", headers={"Authorization": "%s %s" % (scheme, plane.token)},
                        timeout=30)
    assert resp.status_code == 200, resp.text


def test_token_is_not_echoed(api):
    resp = api.call("GET", "/sessions", token="Bearer secret-looking-value-123")
    assert resp.status_code == 401
    assert "secret-looking-value-123" not in resp.text


@pytest.mark.parametrize("token", [None, "Bearer wrong-token"])
def test_websocket_upgrade_needs_the_token(plane, sandbox, token):
    async def dial():
        async with ws_connect(plane, sandbox["session_id"], 8443, token=token):
            pass
    with pytest.raises(InvalidStatus) as e:
        asyncio.run(dial())
    assert e.value.response.status_code == 401


def test_both_prefixes_answer(plane, api):
    for prefix in ("/v2/agents", "/v2/harness-runtime"):
        resp = api.http.get(plane.url + prefix + "/sessions", headers=plane.auth_headers, timeout=30)
        assert resp.status_code == 200, (prefix, resp.text)
        assert "sessions" in resp.json()
