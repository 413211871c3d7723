"""make typecheck: the annotated-share rule of hack/typed_share.py, and that both gates fail when they should."""
import ast
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("typed_share", os.path.join(ROOT, "hack", "typed_share.py"))
typed_share = importlib.util.module_from_spec(spec)
spec.loader.exec_module(typed_share)

SOURCE = '''
def full(a: int, *args: str, b: bool = False, **kw: int) -> None: ...
def no_return(a: int): ...
def one_param_bare(a, b: int) -> int: ...
def none() -> None: ...
def commented(a, b):
    # type: (int, str) -> bool
    return True
class C:
    def method(self, x: int) -> int: ...
    def bare_method(self): ...
    @staticmethod
    def static(x) -> int: ...
    @classmethod
    def klass(cls) -> "C": ...
    def outer(self) -> None:
        def inner(y: int) -> int: ...
'''


def test_a_function_counts_when_every_parameter_but_self_and_its_return_are_annotated():
    tree = ast.parse(SOURCE, type_comments=True)
    got = {fn.name: typed_share.is_annotated(fn, method) for fn, method in typed_share.functions(tree)}
    assert got == {"full": True, "no_return": False, "one_param_bare": False, "none": True, "commented": True,
                   "method": True, "bare_method": False, "static": False, "klass": True, "outer": True, "inner": True}


def test_the_share_fails_under_its_floor_and_names_each_file():
    script = os.path.join(ROOT, "hack", "typed_share.py")
    ok = subprocess.run([sys.executable, script, "--floor", "0"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "plugins/module_utils/rest.py" in ok.stdout and "functions in plugins/ annotated" in ok.stdout
    assert "agent_pb" not in ok.stdout  # generated code is not counted
    failed = subprocess.run([sys.executable, script, "--floor", "100.1"], capture_output=True, text=True, check=False)
    assert failed.returncode == 1 and "FAILED" in failed.stderr


@pytest.mark.skipif(shutil.which("mypy", path=os.path.dirname(sys.executable)) is None, reason="mypy not installed")
def test_mypy_fails_on_a_type_error_in_plugins(tmp_path):
    """The config checks plugins/ as its package: a wrong type in a plugin file is an error, not skipped."""
    tree = tmp_path / "collections" / "ansible_collections" / "microvm" / "sandbox"
    tree.parent.mkdir(parents=True)
    shutil.copytree(os.path.join(ROOT, "plugins"), tree / "plugins")
    (tree / "plugins" / "module_utils" / "profile.py").open("a").write(
        "\n\ndef _typecheck_probe() -> int:\n    return short_status(None) + 1\n")
    config = tmp_path / "pyproject.toml"
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    config.write_text(text.replace('mypy_path = ".local/collections"', 'mypy_path = "%s"' % (tmp_path / "collections"))
                      .replace('cache_dir = ".local/mypy_cache"', 'cache_dir = "%s"' % (tmp_path / "cache")))
    mypy = os.path.join(os.path.dirname(sys.executable), "mypy")
    run = subprocess.run([mypy, "--config-file", str(config), "-p", "ansible_collections.microvm.sandbox.plugins"],
                         capture_output=True, text=True, cwd=str(tmp_path), check=False)
    assert run.returncode == 1, run.stdout
    assert 'profile.py' in run.stdout and 'Unsupported operand types for + ("str" and "int")' in run.stdout
