"""The guest agent's generated stubs, which live in the collection (plugins/plugin_utils/agent_pb)."""
import os
import sys


def _ensure_collection_path():
    # The repo is the collection root; `make collection` links it as
    # .local/collections/ansible_collections/microvm/sandbox.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    collections = os.path.join(repo, ".local", "collections")
    if os.path.isdir(collections) and collections not in sys.path:
        sys.path.append(collections)


__all__ = ["pb2", "pb2_grpc"]

try:
    from ansible_collections.microvm.sandbox.plugins.plugin_utils.agent_pb import (  # noqa: F401
        sandbox_agent_pb2 as pb2,
        sandbox_agent_pb2_grpc as pb2_grpc,
    )
except ImportError:
    _ensure_collection_path()
    from ansible_collections.microvm.sandbox.plugins.plugin_utils.agent_pb import (  # noqa: F401
        sandbox_agent_pb2 as pb2,
        sandbox_agent_pb2_grpc as pb2_grpc,
    )
