"""The layout says which process runs which file, and these tests keep it true.

plugins/plugin_utils/_worker runs in every task's freshly forked worker, _shared in the worker and the mux,
_guest inside the guest (sent as one argv string), _mux in the shared multiplexer. Heavy imports (grpc,
websockets, h2) belong to the mux alone; a guest program imports nothing but the standard library.
"""
import ast
import importlib
import pathlib
import pkgutil
import sys

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils import _guest

PLUGINS = pathlib.Path(_guest.__file__).resolve().parent.parent.parent
PREFIX = "ansible_collections.microvm.sandbox.plugins."
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
# A task's worker has ansible-core (and its yaml) loaded already: importing them there costs nothing.
IN_THE_WORKER = STDLIB | {"ansible", "yaml"}


def imports_of(path):
    """(top-level third-party names, this collection's dotted modules) a file imports, at any depth."""
    names, ours = set(), set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                (ours.add(alias.name[len(PREFIX):]) if alias.name.startswith(PREFIX) else names.add(alias.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith(PREFIX):
                # `from ...plugin_utils._shared import frames` imports plugin_utils._shared.frames
                ours.update(node.module[len(PREFIX):] + "." + alias.name for alias in node.names)
            else:
                names.add(node.module.split(".")[0])
    return names, ours


def files(*parts):
    return sorted(p for p in PLUGINS.joinpath(*parts).rglob("*.py") if "agent_pb" not in p.parts)


# package -> (the third-party packages it may import, the packages of this collection it may import)
ALLOWED = {
    "_guest": (STDLIB, set()),
    "_shared": (IN_THE_WORKER, {"module_utils.profile"}),
    # module_utils.rest and .progress (the session and template actions' progress watcher): stdlib and ansible-core only
    "_worker": (IN_THE_WORKER, {"module_utils.profile", "module_utils.rest", "module_utils.progress", "plugin_utils._shared",
                                "plugin_utils._guest"}),
}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_worker_shared_and_guest_code_imports_nothing_heavy(package):
    libraries, packages = ALLOWED[package]
    for path in files("plugin_utils", package):
        names, ours = imports_of(path)
        assert names <= libraries, "%s imports %s: %s code must import only the standard library%s" % (
            path, sorted(names - libraries), package, "" if package == "_guest" else " and ansible-core")
        stray = {m for m in ours if not any(m == a or m.startswith(a + ".") for a in packages | {"plugin_utils." + package})}
        assert not stray, "%s imports %s, outside what %s may use" % (path, sorted(stray), package)


@pytest.mark.parametrize("plugin", ["connection", "action", "callback", "inventory"])
def test_plugins_run_in_the_worker_never_import_the_mux(plugin):
    for path in files(plugin):
        names, ours = imports_of(path)
        assert not {"grpc", "websockets", "google", "h2", "hyperframe", "hpack"} & names, path
        assert not any(m.startswith("plugin_utils._mux") for m in ours), "%s imports the mux's code" % path


def test_the_mux_never_imports_worker_code():
    for path in files("plugin_utils", "_mux"):
        assert not any(m.startswith("plugin_utils._worker") for m in imports_of(path)[1]), path


def test_nothing_is_left_flat_in_plugin_utils():
    flat = sorted(p.name for p in PLUGINS.joinpath("plugin_utils").glob("*.py") if p.name != "__init__.py")
    assert not flat, "put %s in the package of the process that runs it" % flat


def test_every_guest_program_fits_one_argument():
    programs = [importlib.import_module(_guest.__name__ + "." + m.name) for m in pkgutil.iter_modules(_guest.__path__)]
    assert len(programs) >= 2
    for program in programs:
        size = len(_guest.source_of(program).encode())
        # Headroom for the rest of the argv string (the JSON argument travels separately).
        assert size < _guest.MAX_ARG_STRLEN - 4096, "%s is %d bytes: Linux refuses one argument over %d" % (
            program.__name__, size, _guest.MAX_ARG_STRLEN)
