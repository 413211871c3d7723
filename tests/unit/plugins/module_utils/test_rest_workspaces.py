"""The REST client's workspace and config calls (its opener mocked): retries, bodies, lookups."""
import io
import json

import pytest

from ansible.module_utils.six.moves.urllib.error import HTTPError

from ansible_collections.microvm.sandbox.plugins.module_utils import rest


class Resp(object):
    def __init__(self, status, body):
        self.body = json.dumps(body).encode() if body is not None else b""
        self.status = status

    def read(self):
        return self.body

    def getcode(self):
        return self.status


def http_error(status, body):
    return HTTPError("http://x", status, "err", {}, io.BytesIO(json.dumps(body).encode()))


@pytest.fixture
def transport(monkeypatch):
    answers, calls = [], []

    def fake_open(url, data, headers, method, timeout, validate_certs):
        calls.append((method, url, data, headers))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(rest, "ansible_open", fake_open)
    return answers, calls


def client():
    c = rest.ApiClient("http://plane:1", "tok", prefix="/v2/harness-runtime")
    c._sleep = lambda s: None
    return c


WS = {"workspace_id": "w-1", "name": "notes", "state": "AVAILABLE", "size_limit_gib": 10}


def test_a_keyed_workspace_create_is_retried_on_5xx(transport):
    answers, calls = transport
    answers += [http_error(503, {"message": "busy"}), Resp(201, {"workspace": WS})]
    assert client().create_workspace(10, name="notes", idempotency_key="k-1") == WS
    assert len(calls) == 2 and calls[0][0] == "POST" and calls[0][1].endswith("/v2/harness-runtime/workspaces")
    assert json.loads(calls[1][2]) == {"size_limit_gib": 10, "name": "notes", "idempotency_key": "k-1"}


def test_an_unkeyed_workspace_create_is_not_retried_on_5xx(transport):
    answers, calls = transport
    answers += [http_error(503, {"message": "busy"}), Resp(201, {"workspace": WS})]
    with pytest.raises(rest.ApiError) as e:
        client().create_workspace(10)
    assert e.value.status == 503 and len(calls) == 1


def test_the_config_create_form_is_json_with_the_workspace(transport):
    answers, calls = transport
    answers.append(Resp(201, {"session": {"session_id": "s-1"}}))
    client().create_session_from_config("run-1", "c-1", workspace_id="w-1", resume_on_topoff=False)
    method, url, data, headers = calls[0]
    assert method == "POST" and url.endswith("/sessions?resume_on_topoff=false")
    assert headers["Content-Type"] == "application/json"
    assert json.loads(data) == {"name": "run-1", "config_id": "c-1", "workspace_id": "w-1"}


def test_find_config_by_name_returns_the_full_object_and_never_guesses_an_id(transport):
    answers, calls = transport
    item = {"id": "cfg_9f2c", "name": "Reviewer"}
    answers += [Resp(200, {"configs": [item], "next_page_token": ""}), Resp(200, {"config": dict(item, credentials=[])})]
    assert client().find_config("reviewer")["credentials"] == []
    assert "search=reviewer" in calls[0][1] and calls[1][1].endswith("/configs/cfg_9f2c")
    # Not a name: looked up as an id, whatever its shape; gone is None.
    answers += [Resp(200, {"configs": [], "next_page_token": ""}), http_error(404, {"message": "not found"})]
    assert client().find_config("cfg_1") is None
    assert calls[-1][1].endswith("/configs/cfg_1")
