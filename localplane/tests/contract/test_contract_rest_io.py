"""REST exec and REST workspace transfer: the slow path, with the platform's limits."""
import base64
import hashlib
import io
import tarfile
import uuid

import pytest

from contract_support import error_message, local_only

from microvm_localplane.contract import MAX_DOWNLOAD_BYTES

FOOTER = 73


def exec_(api, sid, body):
    return api.call("POST", "/sessions/%s/sandbox/exec" % sid, json=body)


def test_exec_returns_exit_code_and_output(api, sandbox):
    resp = exec_(api, sandbox["session_id"], {"argv": ["sh", "-c", "echo out; echo err >&2; exit 7"]})
    assert resp.status_code == 200, resp.text
    doc = resp.json()
    assert isinstance(doc.pop("duration_ms"), int)  # the documented answer (EXEC's response example)
    assert doc == {"exit_code": 7, "stdout": "out\n", "stderr": "err\n"}


def test_exec_workdir_and_stdin(api, sandbox):
    stdin = base64.b64encode(b"piped in").decode()
    resp = exec_(api, sandbox["session_id"], {"argv": ["sh", "-c", "pwd; cat"], "workdir": "/tmp", "stdin": stdin})
    assert resp.json()["stdout"] == "/tmp\npiped in"


def test_exec_refuses_env(api, sandbox):
    resp = exec_(api, sandbox["session_id"], {"argv": ["env"], "env": {"A": "1"}})
    assert resp.status_code == 400
    assert "env" in error_message(resp)


@pytest.mark.parametrize("body", [{}, {"argv": []}, {"argv": "echo hi"}, {"argv": ["true"], "stdin": "%%%"},
                                  {"argv": ["true"], "timeout_seconds": "5"}])
def test_exec_refuses_bad_bodies(api, sandbox, body):
    assert exec_(api, sandbox["session_id"], body).status_code == 400


def test_exec_output_is_capped_at_1_mib_per_stream(api, sandbox):
    resp = exec_(api, sandbox["session_id"], {"argv": ["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' a"]})
    assert resp.status_code == 200
    assert resp.json()["exit_code"] == 0
    assert len(resp.json()["stdout"]) == 1024 * 1024


def test_exec_timeout_stops_the_command(api, sandbox):
    resp = exec_(api, sandbox["session_id"], {"argv": ["sleep", "30"], "timeout_seconds": 1})
    assert resp.status_code == 200
    assert resp.json()["exit_code"] != 0


def upload(api, sid, path, data, archive=False, sha=None):
    headers = {"Content-Type": "application/octet-stream"}
    if sha:
        headers["X-Content-Sha256"] = sha
    return api.call("POST", "/sessions/%s/workspace/upload" % sid, data=data, headers=headers,
                    params={"path": path, "is_archive": "true" if archive else "false"})


def download(api, sid, path, archive=False):
    resp = api.call("GET", "/sessions/%s/workspace/download" % sid,
                    params={"path": path, "as_archive": "true" if archive else "false"})
    if resp.status_code != 200:
        return resp, None
    body = resp.content
    payload, footer = body[:-FOOTER], body[-FOOTER:]
    assert footer[:8] == b"DOWSSHA1" and footer[-1:] == b"\n"
    assert footer[8:72].decode() == hashlib.sha256(payload).hexdigest()
    return resp, payload


def test_upload_download_round_trip_with_footer(api, sandbox):
    sid = sandbox["session_id"]
    data = bytes(range(256)) * 4000 + b"tail"
    resp = upload(api, sid, "/workspace/up/data.bin", data, sha=hashlib.sha256(data).hexdigest())
    assert resp.status_code == 200, resp.text
    assert resp.json()["bytes_written"] == len(data)
    _resp, payload = download(api, sid, "/workspace/up/data.bin")
    assert payload == data


def test_upload_archive_and_download_archive(api, sandbox):
    sid = sandbox["session_id"]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("a/b.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    assert upload(api, sid, "/workspace/tree", buf.getvalue(), archive=True).status_code == 200
    _resp, payload = download(api, sid, "/workspace/tree/a/b.txt")
    assert payload == b"hello"
    _resp, tar_bytes = download(api, sid, "/workspace/tree", archive=True)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        assert any(m.name.endswith("b.txt") for m in tar.getmembers())


def test_upload_checksum_mismatch_is_400_and_writes_nothing(api, sandbox):
    sid = sandbox["session_id"]
    resp = upload(api, sid, "/workspace/bad.bin", b"payload", sha="0" * 64)
    assert resp.status_code == 400
    resp, _payload = download(api, sid, "/workspace/bad.bin")
    assert resp.status_code == 404


@pytest.mark.parametrize("path", ["/tmp/x", "/workspace/../tmp/x", "/etc/passwd", "/"])
def test_transfers_outside_workspace_are_403(api, sandbox, path):
    assert upload(api, sandbox["session_id"], path, b"x").status_code == 403
    resp, _payload = download(api, sandbox["session_id"], path)
    assert resp.status_code == 403
    assert "outside workspace" in error_message(resp)


def test_download_of_a_missing_file_is_404(api, sandbox):
    resp, _payload = download(api, sandbox["session_id"], "/workspace/missing-%s" % uuid.uuid4().hex)
    assert resp.status_code == 404


def test_symlink_out_of_workspace_is_refused(api, sandbox):
    sid = sandbox["session_id"]
    assert exec_(api, sid, {"argv": ["ln", "-sfn", "/etc", "/workspace/etc-link"]}).json()["exit_code"] == 0
    resp, _payload = download(api, sid, "/workspace/etc-link/hostname")
    assert resp.status_code == 403


def test_upload_over_500_mib_is_413(plane, sandbox):
    import http.client
    from urllib.parse import urlsplit
    u = urlsplit(plane.url)
    conn = (http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection)(u.hostname, u.port, timeout=60)
    conn.putrequest("POST", (u.path.rstrip("/") + "/v2/agents/sessions/%s/workspace/upload?path=/workspace/big.bin"
                             % sandbox["session_id"]))
    conn.putheader("Authorization", "Bearer " + plane.token)
    conn.putheader("Content-Type", "application/octet-stream")
    conn.putheader("Content-Length", str(501 * 1024 * 1024))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413
    conn.close()


@local_only
def test_a_sparse_file_over_the_download_bound_is_413_before_any_byte(api, sandbox):
    """A 3 GiB sparse file (no blocks on the guest's disk): the REST download answers 413 naming the bound."""
    sid = sandbox["session_id"]
    assert exec_(api, sid, {"argv": ["sh", "-c", "mkdir -p /workspace/sparse && truncate -s 3G /workspace/sparse/big"]}
                 ).json()["exit_code"] == 0
    resp = api.call("GET", "/sessions/%s/workspace/download" % sid,
                    params={"path": "/workspace/sparse/big", "as_archive": "false"}, stream=True)
    assert resp.status_code == 413, resp.status_code
    assert "MAX_DOWNLOAD_BYTES" in error_message(resp) and "3221225472" in error_message(resp)


@local_only
def test_an_archive_over_the_download_bound_is_cut_without_its_footer(api, sandbox):
    """The same file as a tar (as_archive): the stream stops at the bound, without the footer a client checks."""
    sid = sandbox["session_id"]
    exec_(api, sid, {"argv": ["sh", "-c", "mkdir -p /workspace/sparse && truncate -s 3G /workspace/sparse/big"]})
    resp = api.call("GET", "/sessions/%s/workspace/download" % sid,
                    params={"path": "/workspace/sparse", "as_archive": "true"}, stream=True)
    assert resp.status_code == 200
    received = 0
    tail = b""
    for chunk in resp.iter_content(1 << 20):
        received += len(chunk)
        tail = (tail + chunk)[-FOOTER:]
        assert received <= MAX_DOWNLOAD_BYTES + FOOTER, "streamed past the bound"
    assert received <= MAX_DOWNLOAD_BYTES
    assert not tail.startswith(b"DOWSSHA1"), "a cut archive must not carry a valid-looking footer"
    # the session still serves
    assert exec_(api, sid, {"argv": ["true"]}).json()["exit_code"] == 0
