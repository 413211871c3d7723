"""Helpers for the contract tests: raw HTTP, WebSocket port-forwards and a gRPC agent channel.

The tests talk to the plane from outside, as a client does, so they run
unchanged against the real platform (MICROVM_LIVE=1). Behaviour the platform
leaves open, and which only the local plane decides, is marked `local_only`.
"""
import json
import os
import time
import uuid

import pytest
import requests
import yaml

PREFIX = "/v2/agents"
LIVE = os.environ.get("MICROVM_LIVE") == "1"
local_only = pytest.mark.skipif(LIVE, reason="a local-plane decision; the platform's public record is silent")


class Api:
    """Raw HTTP against the plane, for the calls the REST client deliberately does not make."""

    def __init__(self, plane, prefix=PREFIX):
        self.plane = plane
        self.prefix = prefix
        self.http = requests.Session()

    def url(self, path):
        return self.plane.url.rstrip("/") + self.prefix + path

    def call(self, method, path, token=True, headers=None, **kwargs):
        h = dict(headers or {})
        if token is True:
            h["Authorization"] = "Bearer " + self.plane.token
        elif token:
            h["Authorization"] = token
        kwargs.setdefault("timeout", 120)
        return self.http.request(method, self.url(path), headers=h, **kwargs)

    def create(self, body, content_type="application/yaml", params=None):
        """POST /sessions. A mapping goes out in the form its content type selects: YAML, or JSON for application/json."""
        if isinstance(body, (bytes, str)):
            data = body
        elif content_type.split(";")[0].strip() == "application/json":
            data = json.dumps(body)
        else:
            data = yaml.safe_dump(body)
        return self.call("POST", "/sessions", data=data, headers={"Content-Type": content_type}, params=params)

    def session(self, sid):
        return self.call("GET", "/sessions/%s" % sid).json()["session"]

    def wait(self, sid, statuses, timeout=120):
        deadline = time.time() + timeout
        while True:
            s = self.session(sid)
            if s["status"].replace("SESSION_STATUS_", "") in statuses:
                return s
            assert time.time() < deadline, "session %s stuck in %s" % (sid, s["status"])
            time.sleep(0.05)


def error_message(resp):
    """The message of a documented error body {id, message, request_id} (and nothing else)."""
    body = resp.json()
    assert set(body) == {"id", "message", "request_id"}, body
    return body["message"]


def unique(prefix="ct"):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:10])


# -- port-forward ----------------------------------------------------------------
def ws_connect(plane, sid, port, token=True, **kwargs):
    from websockets.asyncio.client import connect
    headers = {"Authorization": "Bearer " + plane.token} if token is True else ({"Authorization": token} if token else {})
    return connect(plane.ws_url(sid, port), additional_headers=headers, max_size=None, **kwargs)


def port_bridge(plane, sid, port):
    """A loopback TCP port whose connections each ride their own port-forward WebSocket to `port` (.local_port)."""
    from microvm_wsbridge import TcpOverWebSocket
    return TcpOverWebSocket(plane.ws_url(sid, port), {"Authorization": "Bearer " + plane.token}, ping_interval=30)


def run_exec(stub, argv, stdin=b"", timeout=0, workdir=""):
    """Exec through the agent -> (exit_code, stdout, stderr)."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2 as pb

    def requests_():
        yield pb.ExecRequest(start=pb.ExecStart(argv=argv, workdir=workdir, timeout_seconds=timeout))
        if stdin:
            yield pb.ExecRequest(stdin=stdin)
    out, err, code = b"", b"", None
    for frame in stub.Exec(requests_(), timeout=120):
        kind = frame.WhichOneof("output")
        if kind == "stdout":
            out += frame.stdout
        elif kind == "stderr":
            err += frame.stderr
        elif kind == "exit":
            code = frame.exit.exit_code
    return code, out, err
