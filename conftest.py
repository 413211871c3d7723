"""Shared pytest fixtures: a real local control plane for the suites that need one."""
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))
for p in (os.path.join(ROOT, ".local", "collections"), os.path.join(ROOT, "localplane")):
    if p not in sys.path:
        sys.path.insert(0, p)

pytest_plugins = ["microvm_localplane.testing"]
