"""hack/cached_venv.py: a shared venv per content, reused while its inputs stay, rebuilt when they change, and the
clone's overlay reaching it (no network: pip's steps are recorded, not run; venvs are made without pip)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import TypedDict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("cached_venv", os.path.join(ROOT, "hack", "cached_venv.py"))
assert spec is not None and spec.loader is not None   # None for a path it cannot load
cv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cv)


class Calls(TypedDict):
    venv: list[str]         # each venv's path, in the order made
    pip: list[list[str]]    # each pip install's arguments (a -r file's text appended)


@pytest.fixture
def tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Calls:
    """cached_venv with a cache root of its own; records each venv made and each pip install."""
    monkeypatch.setenv("MICROVM_SANDBOX_CACHE", str(tmp_path / "cache"))
    calls: Calls = {"venv": [], "pip": []}
    real_create = cv.create_venv

    def create_venv(path: str, with_pip: bool = True) -> None:
        calls["venv"].append(path)
        real_create(path, with_pip=False)

    def pip_install(python: str, args: list[str]) -> None:
        assert os.path.exists(python)
        if args[0] == "-r":
            with open(args[1]) as f:
                args = args + ["<<" + f.read()]
        calls["pip"].append(args)

    monkeypatch.setattr(cv, "create_venv", create_venv)
    monkeypatch.setattr(cv, "pip_install", pip_install)
    return calls


def shared_builds(calls: Calls) -> list[str]:
    return [p for p in calls["venv"] if os.sep + "venvs" + os.sep in p]


def test_a_venv_is_built_once_then_reused_and_rebuilt_when_its_requirements_change(tmp_path: Path, tool: Calls) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("")
    dest = str(tmp_path / "clone" / ".venv")
    shared = cv.ensure(dest, [str(req)], log=lambda msg: None)[1]
    assert shared.startswith(str(tmp_path / "cache" / "venvs" / "venv-"))
    assert shared_builds(tool) == [shared] and tool["venv"] == [shared, dest]
    assert tool["pip"] == [["--upgrade", "pip"]]   # an empty file: nothing more to install
    key = open(os.path.join(shared, cv.COMPLETE)).read().strip()
    assert os.path.basename(shared) == "venv-" + key[:16]
    stamps = [os.stat(os.path.join(shared, cv.COMPLETE)).st_mtime_ns, os.stat(os.path.join(dest, cv.KEY_FILE)).st_mtime_ns]

    # Unchanged input: the same shared venv, nothing rebuilt, the overlay left as it is.
    assert cv.ensure(dest, [str(req)], log=lambda msg: None) == (dest, shared)
    assert len(tool["venv"]) == 2 and len(tool["pip"]) == 1
    assert [os.stat(os.path.join(shared, cv.COMPLETE)).st_mtime_ns,
            os.stat(os.path.join(dest, cv.KEY_FILE)).st_mtime_ns] == stamps

    # A second clone over the same content: only its overlay is made.
    dest2 = str(tmp_path / "clone2" / ".venv")
    assert cv.ensure(dest2, [str(req)], log=lambda msg: None) == (dest2, shared)
    assert shared_builds(tool) == [shared] and len(tool["pip"]) == 1

    # Changed bytes: a new key, a new shared venv, the overlay made anew over it.
    req.write_text("# one more line\n")
    shared2 = cv.ensure(dest, [str(req)], log=lambda msg: None)[1]
    assert shared2 != shared and shared_builds(tool) == [shared, shared2]
    assert open(os.path.join(dest, cv.KEY_FILE)).read().split()[1] == shared2
    assert os.path.isdir(shared)   # the old one stays for clones still on it


def test_an_incomplete_shared_venv_is_built_again(tmp_path: Path, tool: Calls) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("")
    shared = cv.ensure(str(tmp_path / ".venv"), [str(req)], log=lambda msg: None)[1]
    os.unlink(os.path.join(shared, cv.COMPLETE))   # as a build killed halfway leaves it
    cv.ensure(str(tmp_path / ".venv"), [str(req)], log=lambda msg: None)
    assert shared_builds(tool) == [shared, shared]
    assert os.path.isfile(os.path.join(shared, cv.COMPLETE))


def test_the_overlay_imports_the_shared_packages_and_runs_its_scripts(tmp_path: Path, tool: Calls) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("-e ./localplane\nsomething==1.0\n")
    lp = tmp_path / "clone" / "localplane"
    (lp / "microvm_localplane").mkdir(parents=True)
    (lp / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["dep-of-localplane>=1"]\n')
    (lp / "microvm_localplane" / "__init__.py").write_text("")
    (lp / "microvm_localplane" / "cli.py").write_text("def main():\n    print('localplane main')\n    return 0\n")
    dest = str(tmp_path / "clone" / ".venv")
    shared = cv.ensure(dest, [str(req)], localplane=str(lp), log=lambda msg: None)[1]
    installed = tool["pip"][1][-1]
    assert "something==1.0" in installed and "dep-of-localplane>=1" in installed and "-e" not in installed

    # What pip would have put there: a module, a nested .pth, a script, a long-shebang script, a binary.
    sp = cv.site_packages(shared)
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "probe_nested.py").write_text("WHERE = 'nested'\n")
    with open(os.path.join(sp, "probe_shared.py"), "w") as f:
        f.write("WHERE = 'shared'\n")
    with open(os.path.join(sp, "probe.pth"), "w") as f:
        f.write(str(tmp_path / "nested") + "\n")
    shared_python = os.path.join(shared, "bin", "python")
    scripts = {"probe-script": "#!%s\n" % shared_python,
               "probe-long": "#!/bin/sh\n'''exec' \"%s\" \"$0\" \"$@\"\n' '''\n" % shared_python}
    for name, header in scripts.items():
        path = os.path.join(shared, "bin", name)
        with open(path, "w") as f:
            f.write(header + "import sys, probe_shared\nprint(sys.prefix, probe_shared.WHERE)\n")
        os.chmod(path, 0o755)
    binary = os.path.join(shared, "bin", "probe-binary")
    with open(binary, "wb") as f:
        f.write(b"\x7fELF\x00")
    os.chmod(binary, 0o755)
    os.unlink(os.path.join(dest, cv.KEY_FILE))   # made again: the overlay picks the new scripts up
    cv.ensure(dest, [str(req)], localplane=str(lp), log=lambda msg: None)

    py = os.path.join(dest, "bin", "python")
    # Only the overlay's own paths: make exports a PYTHONPATH with this checkout's localplane.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([py, "-c", "import sys, probe_shared, probe_nested, microvm_localplane as m; "
                          "print(sys.prefix, probe_shared.WHERE, probe_nested.WHERE, m.__file__)"],
                         capture_output=True, text=True, check=True, env=clean).stdout.split()
    assert out == [dest, "shared", "nested", str(lp / "microvm_localplane" / "__init__.py")]
    for name in scripts:
        path = os.path.join(dest, "bin", name)
        assert not os.path.islink(path) and open(path).readline() == "#!%s\n" % py
        res = subprocess.run([path], capture_output=True, text=True, check=True, env=clean)
        assert res.stdout.split() == [dest, "shared"]
    assert os.readlink(os.path.join(dest, "bin", "probe-binary")) == binary
    res = subprocess.run([os.path.join(dest, "bin", "microvm-localplane")], capture_output=True, text=True, check=True,
                         env=clean)
    assert res.stdout == "localplane main\n"
    assert os.path.islink(py) and not os.path.exists(os.path.join(dest, "bin", "pip"))   # as venv made them


def test_a_shebang_too_long_for_the_kernel_takes_the_sh_form(tmp_path: Path) -> None:
    long_python = "/" + "d" * 150 + "/bin/python"
    assert cv.shebang("/v/bin/python") == "#!/v/bin/python\n"
    header = cv.shebang(long_python)
    assert header.startswith("#!/bin/sh\n'''exec' \"%s\" \"$0\" \"$@\"\n" % long_python)
    shared_bin = os.path.dirname(long_python)
    assert cv._shebang_python(header.splitlines() + [""], shared_bin) == (long_python, 3)


def test_the_key_covers_the_python_and_each_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("x==1\n")
    b.write_text("")
    key = cv.compute_key([str(a)], [str(b)])
    assert key == cv.compute_key([str(a)], [str(b)])
    b.write_text("dependencies = []\n")
    assert cv.compute_key([str(a)], [str(b)]) != key
    before = cv.compute_key([str(a)])
    monkeypatch.setattr(sys, "version", sys.version + " other build")
    assert cv.compute_key([str(a)]) != before


def test_venvs_are_made_with_the_base_python_even_from_inside_a_venv() -> None:
    """make puts .venv/bin first on PATH: the tool may run on the very overlay it replaces."""
    home = os.path.dirname(os.path.dirname(cv.BASE_PYTHON))
    assert not os.path.exists(os.path.join(home, "pyvenv.cfg")), cv.BASE_PYTHON


def test_another_cache_root_gets_its_own_shared_venv(tmp_path: Path, tool: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("")
    dest = str(tmp_path / ".venv")
    first = cv.ensure(dest, [str(req)], log=lambda msg: None)[1]
    monkeypatch.setenv("MICROVM_SANDBOX_CACHE", str(tmp_path / "other-cache"))
    second = cv.ensure(dest, [str(req)], log=lambda msg: None)[1]
    assert second.startswith(str(tmp_path / "other-cache")) and second != first
    assert open(os.path.join(dest, cv.KEY_FILE)).read().split()[1] == second
