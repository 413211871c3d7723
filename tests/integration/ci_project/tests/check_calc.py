"""Run by the pipeline inside the sandbox (named check_*.py so the repo's own pytest run skips it)."""
import calc


def test_add():
    assert calc.add(2, 3) == 5


def test_mul():
    assert calc.mul(4, 5) == 20


def test_version():
    assert calc.VERSION == "1"


def test_runs_in_a_venv():
    import sys
    assert sys.prefix != sys.base_prefix
