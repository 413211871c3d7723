"""The guest agent's generated stubs: the plane's own copy (agent_pb/, `make proto`)."""
from .agent_pb import sandbox_agent_pb2 as pb2, sandbox_agent_pb2_grpc as pb2_grpc  # noqa: F401

__all__ = ["pb2", "pb2_grpc"]
