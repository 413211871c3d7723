"""Fixtures of the contract tests (helpers live in contract_support.py)."""
import pytest

from contract_support import Api, port_bridge, unique


def pytest_collection_modifyitems(items):
    for item in items:
        if "contract" in str(item.fspath):
            item.add_marker(pytest.mark.live)


@pytest.fixture(scope="session")
def api(plane):
    return Api(plane)


@pytest.fixture
def make_session(plane, api):
    """Create READY sessions on demand; every one is deleted after the test."""
    created = []

    def make(**spec):
        spec.setdefault("name", unique())
        spec.setdefault("agent", "custom")
        resp = api.create(spec)
        assert resp.status_code in (200, 201), resp.text
        sid = resp.json()["session"]["session_id"]
        created.append(sid)
        return api.wait(sid, ("READY", "DETACHED"))

    yield make
    for sid in created:
        api.call("DELETE", "/sessions/%s" % sid)


@pytest.fixture
def agent(plane):
    """agent(session_id) -> a SandboxAgentService stub reached through the port-forward to 8443."""
    import grpc

    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_pb import sandbox_agent_pb2_grpc
    opened = []

    def connect(sid):
        bridge = port_bridge(plane, sid, 8443)
        channel = grpc.insecure_channel("127.0.0.1:%d" % bridge.local_port)
        opened.append((bridge, channel))
        return sandbox_agent_pb2_grpc.SandboxAgentServiceStub(channel)

    yield connect
    for bridge, channel in opened:
        channel.close()
        bridge.close()
