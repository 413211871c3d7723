"""Unit-test helpers (the fake plane used by one-layer tests) importable from every unit suite."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
