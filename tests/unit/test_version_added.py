"""No plugin, module or option claims to have been added in a release newer than the collection itself."""
import ast
import glob
import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in str(text).split("."))


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "plugins", "*", "*.py"))):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for node in tree.body:
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "DOCUMENTATION" for t in node.targets)
                    and isinstance(node.value, ast.Constant)):
                out.append((os.path.relpath(path, ROOT), yaml.safe_load(node.value.value)))
    for path in sorted(glob.glob(os.path.join(ROOT, "roles", "*", "meta", "argument_specs.yml"))):
        out.append((os.path.relpath(path, ROOT), yaml.safe_load(open(path, encoding="utf-8"))))
    return out


def _claims(doc: object, where: str):
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "version_added":
                yield where, str(value)
            else:
                yield from _claims(value, f"{where}.{key}")
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _claims(value, f"{where}[{i}]")


def test_version_added_matches_the_collection() -> None:
    galaxy = yaml.safe_load(open(os.path.join(ROOT, "galaxy.yml"), encoding="utf-8"))
    released = yaml.safe_load(open(os.path.join(ROOT, "changelogs", "changelog.yaml"), encoding="utf-8"))
    releases = sorted(_version(v) for v in (released.get("releases") or {}))
    current = _version(galaxy["version"])
    claims = [c for path, doc in _docs() for c in _claims(doc, path)]
    assert claims, "no version_added found: the scan is broken"
    for where, value in claims:
        assert _version(value) <= current, f"{where}: version_added {value} is newer than galaxy.yml's {galaxy['version']}"
        if not releases:
            # Nothing released yet: everything arrives in the first release.
            assert _version(value) == current, f"{where}: version_added {value}, but nothing before {galaxy['version']} was released"
        else:
            assert _version(value) in releases + [current], f"{where}: version_added {value} is not a release"
