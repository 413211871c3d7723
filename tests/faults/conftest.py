"""Fixtures for the fault suite: a fault proxy in front of the shared plane, and agent clients through it."""
import contextlib
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faultproxy import FaultProxy  # noqa: E402


def _integration_helpers():
    """tests/integration/conftest.py (run_playbook, ansible_env), loaded by path: reused, not copied."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration", "conftest.py")
    spec = importlib.util.spec_from_file_location("microvm_integration_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


integration = _integration_helpers()


@pytest.fixture
def run_playbook():
    return integration.run_playbook


@pytest.fixture
def mux_dir(tmp_path):
    """A private MICROVM_MUX_DIR; the multiplexers started in it are stopped after the test."""
    from microvm_plane_testing import stop_muxes
    d = str(tmp_path / "mux")
    yield d
    stop_muxes(d)


@pytest.fixture
def proxy(plane):
    if plane.live:
        pytest.skip("the fault proxy sits in front of the local control plane only")
    p = FaultProxy(plane.url).start()
    try:
        yield p
    finally:
        p.stop()


class Agent:
    """An AgentClient over its own Tunnel (the mux's stack, without the mux process)."""

    def __init__(self, url, token, session_id, bulk=False):
        from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
        from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import bulk_line
        from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.tunnel import Tunnel
        self.tunnel = Tunnel(url, "/v2/agents", session_id, token, connect_timeout=30)
        target = "unix:" + self.tunnel.start()
        lines = None
        if bulk:  # transfers on bulk lines dialled through the same port-forward (the mux's default for big ones)
            where = bulk_line.Target(self.tunnel.url, token, None, 30, session_id, self.tunnel.port)
            lines = bulk_line.Pool(lambda: bulk_line.Line.dial(where))
        self.client = ac.AgentClient(ac.open_channel(target), session_id, redial=lambda: ac.open_channel(target),
                                     bulk=lines)

    def close(self, drain=10):
        with contextlib.suppress(Exception):
            self.client.close()
        # Let the tunnel finish the connections the channel just closed (their WebSocket close handshake)
        # before stopping its loop: Tunnel.stop() cancels without waiting, and a connection still closing
        # would be left pending ("Task was destroyed but it is pending").
        deadline = time.monotonic() + drain
        while getattr(self.tunnel, "active", 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        with contextlib.suppress(Exception):
            self.tunnel.stop()


@pytest.fixture
def agents():
    """agents(url, token, session_id) -> AgentClient; all closed after the test."""
    made = []

    def make(url, token, session_id, bulk=False):
        a = Agent(url, token, session_id, bulk=bulk)
        made.append(a)
        return a.client

    yield make
    for a in made:
        a.close()
