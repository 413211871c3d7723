"""Staged, object-storage-backed workspace transfers (pydo create_session_workspace_transfer and its siblings).

docs/platform-contract.md, "Data plane (exec and files)", "Staged transfers": the documented calls, and the
local decisions (part size, URL lifetime, the refusals the pages leave open) marked `local_only`.
"""
import hashlib
import http.client
import json
import os
import time
import urllib.parse

import pytest
import requests
from contract_support import Api, error_message, local_only

from microvm_localplane import transfers

T = "/sessions/%s/workspace/transfers"


def create(api, sid, **body):
    return api.call("POST", T % sid, json=body)


def wait_done(api, sid, tid, timeout=120):
    deadline = time.time() + timeout
    while True:
        doc = api.call("GET", (T % sid) + "/" + tid).json()
        if doc["status"] in ("completed", "failed"):
            return doc
        assert time.time() < deadline, doc
        time.sleep(0.1)


def put_parts(api, sid, tid, payload, part_size):
    count = max(1, -(-len(payload) // part_size))
    resp = api.call("POST", (T % sid) + "/%s/part-upload-urls" % tid, json={"part_numbers": list(range(1, count + 1))})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert set(doc) == {"transfer_id", "part_urls", "expires_at"} and doc["expires_at"].endswith("Z")
    for part in doc["part_urls"]:
        n = part["part_number"]
        # presigned: no bearer token goes to object storage
        r = requests.put(part["upload_url"], data=payload[(n - 1) * part_size:n * part_size], timeout=120)
        assert r.status_code == 200, r.text
    return doc


def test_staged_upload_then_staged_download_round_trip(api, sandbox):
    sid = sandbox["session_id"]
    payload = os.urandom(3 * 1024 * 1024 + 17)
    sha = hashlib.sha256(payload).hexdigest()
    resp = create(api, sid, direction="upload", path="staged/a.bin", size_bytes=len(payload), sha256=sha)
    assert resp.status_code == 201, resp.text
    created = resp.json()
    assert set(created) == {"transfer_id", "part_size"} and created["part_size"] > 0
    tid = created["transfer_id"]
    put_parts(api, sid, tid, payload, created["part_size"])
    resp = api.call("POST", (T % sid) + "/%s/commit" % tid, json={"sha256": sha})
    assert resp.status_code == 202, resp.text
    assert resp.json()["size_bytes"] == len(payload)
    done = wait_done(api, sid, tid)
    assert done["status"] == "completed" and done["bytes_written"] == len(payload), done
    assert set(done) == {"transfer_id", "direction", "status", "bytes_written", "sha256", "download_url",
                         "expires_at", "error_message"}
    # a second commit is refused ("Call once")
    assert api.call("POST", (T % sid) + "/%s/commit" % tid, json={}).status_code == 409

    resp = create(api, sid, direction="download", path="staged/a.bin")
    assert resp.status_code == 202, resp.text
    tid = resp.json()["transfer_id"]
    done = wait_done(api, sid, tid)
    assert done["status"] == "completed" and done["sha256"] == sha and done["bytes_written"] == len(payload), done
    got = requests.get(done["download_url"], timeout=120)
    assert got.status_code == 200 and got.content == payload  # no footer: the sha256 comes with the status
    again = api.call("GET", (T % sid) + "/" + tid).json()
    assert again["download_url"] and again["expires_at"]  # minted afresh at each poll
    # cancel of a finished transfer: idempotent, aborted false
    resp = api.call("POST", (T % sid) + "/%s/cancel" % tid, json={"reason": "done"})
    assert resp.status_code == 200 and resp.json() == {"transfer_id": tid, "aborted": False, "status": "completed"}


def test_a_checksum_mismatch_fails_and_writes_nothing(api, sandbox):
    sid = sandbox["session_id"]
    payload = os.urandom(100_000)
    bad = hashlib.sha256(b"something else").hexdigest()
    tid = create(api, sid, direction="upload", path="mismatch.bin", sha256=bad).json()["transfer_id"]
    put_parts(api, sid, tid, payload, transfers.PART_SIZE)
    other = hashlib.sha256(b"x").hexdigest()
    resp = api.call("POST", (T % sid) + "/%s/commit" % tid, json={"sha256": other})
    assert resp.status_code == 400 and "does not match" in error_message(resp)  # commit's differs from create's
    assert api.call("POST", (T % sid) + "/%s/commit" % tid, json={}).status_code == 202
    done = wait_done(api, sid, tid)
    assert done["status"] == "failed" and "sha256" in done["error_message"], done
    resp = api.call("GET", "/sessions/%s/workspace/download" % sid, params={"path": "/workspace/mismatch.bin"})
    assert resp.status_code == 404, "nothing may land on a mismatch"


@local_only
def test_parts_are_refused_past_part_size_and_without_a_valid_signature(api, sandbox):
    sid = sandbox["session_id"]
    tid = create(api, sid, direction="upload", path="parts.bin").json()["transfer_id"]
    doc = api.call("POST", (T % sid) + "/%s/part-upload-urls" % tid, json={"part_numbers": [1, 2]}).json()
    url = doc["part_urls"][0]["upload_url"]
    # an oversize part is refused from its Content-Length, before its bytes are read
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.putrequest("PUT", parts.path + "?" + parts.query)
    conn.putheader("Content-Length", str(transfers.PART_SIZE + 1))
    conn.endheaders()
    big = conn.getresponse()
    assert big.status == 413 and "part_size" in json.loads(big.read())["message"]
    conn.close()
    # the bearer token never goes to object storage: a second credential is refused
    r = requests.put(url, data=b"abc", headers={"Authorization": "Bearer " + api.plane.token}, timeout=60)
    assert r.status_code == 400 and "one auth mechanism" in error_message(r)
    assert requests.put(url.replace("signature=", "signature=0"), data=b"abc", timeout=60).status_code == 403
    assert requests.put(url.replace("/parts/1", "/parts/2"), data=b"abc", timeout=60).status_code == 403
    assert requests.get(url, timeout=60).status_code in (401, 403, 405)  # a PUT URL is no GET URL
    # gaps and short middle parts are refused at commit
    assert requests.put(doc["part_urls"][1]["upload_url"], data=b"tail", timeout=60).status_code == 200
    resp = api.call("POST", (T % sid) + "/%s/commit" % tid, json={})
    assert resp.status_code == 400 and "missing" in error_message(resp)
    assert requests.put(url, data=b"short", timeout=60).status_code == 200
    resp = api.call("POST", (T % sid) + "/%s/commit" % tid, json={})
    assert resp.status_code == 400 and "every part but the last" in error_message(resp)
    resp = api.call("POST", (T % sid) + "/%s/cancel" % tid, json={"reason": "test"})
    assert resp.json() == {"transfer_id": tid, "aborted": True, "status": "failed"}
    assert requests.put(url, data=b"late", timeout=60).status_code == 409


@pytest.mark.parametrize("body, status", [
    ({"direction": "sideways", "path": "a"}, 400),
    ({"direction": "upload"}, 400),
    ({"direction": "upload", "path": "/workspace/a"}, 400),          # workspace-relative only
    ({"direction": "upload", "path": "../etc/passwd"}, 403),         # "Paths that escape the workspace root"
    ({"direction": "download", "path": "a", "is_archive": True}, 400),
    ({"direction": "upload", "path": "a", "as_archive": True}, 400),
    ({"direction": "upload", "path": "a", "sha256": "ABC"}, 400),
    ({"direction": "upload", "path": "a", "size_bytes": 50 * 1024 ** 3 + 1}, 413),  # doctl: "Maximum size 50 GiB"
    ({"direction": "upload", "path": "a", "colour": "red"}, 400),
])
def test_create_refusals(api, sandbox, body, status):
    resp = create(api, sandbox["session_id"], **body)
    assert resp.status_code == status, resp.text
    error_message(resp)


def test_download_of_a_missing_file_is_404_at_create(api, sandbox):
    resp = create(api, sandbox["session_id"], direction="download", path="no/such/file")
    assert resp.status_code == 404, resp.text


def test_unknown_transfer_is_404_and_another_sessions_transfer_too(api, sandbox, make_session):
    sid = sandbox["session_id"]
    assert api.call("GET", (T % sid) + "/tr_nope").status_code == 404
    tid = create(api, sid, direction="upload", path="mine.bin").json()["transfer_id"]
    other = make_session()["session_id"]
    assert api.call("GET", (T % other) + "/" + tid).status_code == 404


def test_both_prefixes(plane, sandbox):
    for prefix in ("/v2/agents", "/v2/harness-runtime"):
        resp = Api(plane, prefix).call("POST", T % sandbox["session_id"], json={"direction": "upload", "path": "p"})
        assert resp.status_code == 201, resp.text


@local_only
@pytest.mark.parametrize("path", ["/_spaces/x/../../v2/agents/sessions", "/_spaces/%2e%2e/v2/agents/sessions",
                                  "/_spaces/", "/_spaces/tr_x/object/../../../v2/agents/sessions"])
def test_only_the_object_routes_go_without_a_token(plane, path):
    """The object store's routes are the only ones without a bearer token: nothing else is reached through them."""
    resp = requests.get(plane.url.rstrip("/") + path, timeout=60)
    assert resp.status_code in (401, 403, 404), (path, resp.status_code, resp.text[:200])
    assert "sessions" not in resp.text
