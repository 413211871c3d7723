"""The guest agent's wire: committed stubs match the proto, and the proto matches the platform."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pb2 = pytest.importorskip("ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb.sandbox_agent_pb2")

# Platform contract, section 3: (message, field) -> (number, type, label)
F = pb2.DESCRIPTOR.message_types_by_name
T = {1: "double", 3: "int64", 5: "int32", 8: "bool", 9: "string", 11: "message", 12: "bytes", 13: "uint32"}
WIRE = {
    ("ExecRequest", "start"): (1, "message"), ("ExecRequest", "stdin"): (2, "bytes"),
    ("ExecRequest", "signal"): (3, "message"),
    ("ExecStart", "argv"): (1, "string"), ("ExecStart", "workdir"): (2, "string"),
    ("ExecStart", "env"): (3, "message"), ("ExecStart", "timeout_seconds"): (4, "int64"),
    ("ExecSignal", "signal"): (1, "int32"),
    ("ExecOutput", "stdout"): (1, "bytes"), ("ExecOutput", "stderr"): (2, "bytes"), ("ExecOutput", "exit"): (3, "message"),
    ("ExecExit", "exit_code"): (1, "int32"), ("ExecExit", "duration_ms"): (2, "int64"),
    ("ExecExit", "hitl_rejected"): (3, "bool"), ("ExecExit", "timed_out"): (4, "bool"),
    ("UploadRequest", "header"): (1, "message"), ("UploadRequest", "chunk"): (2, "bytes"), ("UploadRequest", "end"): (3, "message"),
    ("UploadHeader", "path"): (1, "string"), ("UploadHeader", "mode"): (2, "uint32"), ("UploadHeader", "is_archive"): (3, "bool"),
    ("UploadEnd", "sha256"): (1, "string"),
    ("UploadResponse", "path"): (1, "string"), ("UploadResponse", "bytes_written"): (2, "int64"),
    ("DownloadRequest", "path"): (1, "string"), ("DownloadRequest", "as_archive"): (2, "bool"),
    ("DownloadRequest", "chunk_size_bytes"): (3, "uint32"),
    ("DownloadChunk", "header"): (1, "message"), ("DownloadChunk", "chunk"): (2, "bytes"), ("DownloadChunk", "end"): (3, "message"),
    ("DownloadHeader", "size_bytes"): (1, "int64"), ("DownloadHeader", "is_archive"): (2, "bool"),
    ("DownloadEnd", "sha256"): (1, "string"),
}
ONEOFS = {"ExecRequest": "request", "ExecOutput": "output", "UploadRequest": "request", "DownloadChunk": "output"}


def test_package_and_service_are_the_platforms():
    assert pb2.DESCRIPTOR.package == "do.teams.hosted_agents.runtime.sandbox_agent.v1"
    svc = pb2.DESCRIPTOR.services_by_name["SandboxAgentService"]
    shapes = {m.name: (m.input_type.name, m.output_type.name) for m in svc.methods}
    assert shapes == {"Exec": ("ExecRequest", "ExecOutput"), "Upload": ("UploadRequest", "UploadResponse"),
                      "Download": ("DownloadRequest", "DownloadChunk")}
    streaming = {m.name: (m.client_streaming, m.server_streaming) for m in svc.methods}
    assert streaming == {"Exec": (True, True), "Upload": (True, False), "Download": (False, True)}


def test_every_field_has_the_platforms_number_and_type():
    seen = {}
    for msg in {m for m, _fields in WIRE}:
        for field in F[msg].fields:
            seen[(msg, field.name)] = (field.number, T[field.type])
    assert seen == WIRE


def test_oneofs_and_env_map():
    for msg, oneof in ONEOFS.items():
        assert [f.name for f in F[msg].oneofs_by_name[oneof].fields] == [n for (m, n) in WIRE if m == msg]
    env = F["ExecStart"].fields_by_name["env"].message_type
    assert env.GetOptions().map_entry
    assert [(f.name, T[f.type]) for f in env.fields] == [("key", "string"), ("value", "string")]


def test_committed_stubs_match_the_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", os.path.join(ROOT, "hack", "gen_proto.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    fresh = gen.generate()
    assert sorted(fresh) == ["sandbox_agent_pb2.py", "sandbox_agent_pb2_grpc.py"]
    for out in gen.OUTS:  # the collection's stubs and the local plane's own copy
        for name, text in fresh.items():
            with open(os.path.join(out, name)) as f:
                assert f.read() == text, "%s in %s drifted from protos/: run `make proto`" % (name, out)
