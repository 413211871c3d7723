"""A fake guest agent (in-process gRPC server on a unix socket) for unit tests of the client stack.

Its /workspace is a temporary directory; a test steers misbehaviour through `agent.mode`.
"""
import hashlib
import os
from concurrent import futures

import grpc
import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2 as pb
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2_grpc as pb_grpc


class FakeAgent(pb_grpc.SandboxAgentServiceServicer):
    def __init__(self, root):
        self.root = root
        self.mode = None
        self.calls = []

    def host(self, path):
        return os.path.join(self.root, os.path.relpath(path, "/workspace"))

    def Exec(self, request_iterator, context):
        start = next(iter(request_iterator), None).start
        self.calls.append(("exec", list(start.argv)))
        if self.mode == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "guest gone")
        # like sudo's prompt: some output before stdin is read
        yield pb.ExecOutput(stdout=b"argv=" + " ".join(start.argv).encode() + b"\n")
        if self.mode == "chatter":  # a become that prints much and never asks; then waits for stdin till stopped
            context.add_callback(lambda: self.calls.append(("chatter stopped", list(start.argv))))
            for _dummy in range(2000):
                yield pb.ExecOutput(stdout=b".")
        stdin = b"".join(r.stdin for r in request_iterator if r.WhichOneof("request") == "stdin")
        yield pb.ExecOutput(stdout=stdin)
        yield pb.ExecOutput(stderr=("TMPDIR=%s" % start.env.get("TMPDIR", "")).encode())
        if self.mode == "no-exit":
            return
        yield pb.ExecOutput(exit=pb.ExecExit(exit_code=int(start.env.get("RC", "0")), duration_ms=5,
                                             timed_out=start.timeout_seconds == 1))

    def Upload(self, request_iterator, context):
        header = next(iter(request_iterator), None).header
        self.calls.append(("upload", header.path))
        if not header.path.startswith("/workspace/"):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, 'path outside workspace: "%s"' % header.path)
        digest, data = hashlib.sha256(), bytearray()
        for r in request_iterator:
            if r.WhichOneof("request") == "chunk":
                digest.update(r.chunk)
                data += r.chunk
            elif r.WhichOneof("request") == "end":
                if r.end.sha256 and r.end.sha256 != digest.hexdigest():
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch")
        with open(self.host(header.path), "wb") as f:
            f.write(data)
        return pb.UploadResponse(path=header.path, bytes_written=len(data))

    def Download(self, request, context):
        self.calls.append(("download", request.path))
        if self.mode == "denied":
            context.abort(grpc.StatusCode.PERMISSION_DENIED, 'path outside workspace: "%s"' % request.path)
        try:
            data = open(self.host(request.path), "rb").read()
        except FileNotFoundError:
            context.abort(grpc.StatusCode.INTERNAL,
                          'download status 404: {"code":404,"message":"path \'%s\' does not exist"}' % request.path)
        size = request.chunk_size_bytes or 262144
        yield pb.DownloadChunk(header=pb.DownloadHeader(size_bytes=len(data)))
        for i in range(0, len(data), size):
            yield pb.DownloadChunk(chunk=data[i:i + size])
            if self.mode == "cut" and i >= size:
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        sha = hashlib.sha256(data).hexdigest()
        if self.mode == "bad-sha":
            sha = "0" * 64
        if self.mode != "no-end":
            yield pb.DownloadChunk(end=pb.DownloadEnd(sha256=sha))


@pytest.fixture
def fake_agent(tmp_path):
    """(agent, channel): a FakeAgent served on a unix socket, and a channel to it."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
    root = tmp_path / "workspace"
    root.mkdir()
    agent = FakeAgent(str(root))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_SandboxAgentServiceServicer_to_server(agent, server)
    sock = str(tmp_path / "agent.sock")
    server.add_insecure_port("unix:" + sock)
    server.start()
    channel = ac.open_channel("unix:" + sock)
    yield agent, channel
    channel.close()
    server.stop(0)
