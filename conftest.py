"""Shared pytest set-up: the collection resolvable as Ansible resolves it, and a real local control plane."""
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
COLLECTIONS = os.path.join(ROOT, ".local", "collections")
# tests/support: the test helpers (plane fixture, WebSocket bridge, threaded loop),
# kept out of the local plane's package.
for p in (COLLECTIONS, os.path.join(ROOT, "localplane"), os.path.join(ROOT, "tests", "support")):
    if p not in sys.path:
        sys.path.insert(0, p)

# Install Ansible's collection finder before anything imports the collection,
# so every test imports it the one way ansible-core does.
from ansible.plugins.loader import init_plugin_loader  # noqa: E402

init_plugin_loader([COLLECTIONS])

pytest_plugins = ["microvm_plane_testing"]
