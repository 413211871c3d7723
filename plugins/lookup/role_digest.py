# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
name: role_digest
short_description: A digest of a role's inputs, its files and its variables, to tell whether its result may differ
version_added: 0.1.0
description:
  - Returns one SHA-256 hex digest per role named in the terms, over everything that decides what the role does
    when it runs again, as far as the controller can know it. It changes when the role changes, so a prepared
    sandbox (and its checkpoint) can be redone when, and only when, its inputs changed.
  - B(The role's files), found as C(include_role) finds them (a collection role by its FQCN, else the playbook's
    C(roles/) dir, the configured roles path, the playbook dir); every file's path relative to the role, its
    executable bit and its content (C(__pycache__), C(.git) and C(*.pyc) left out), and the files of the roles
    listed as C(dependencies) in its C(meta/main.yml), recursively.
  - B(Its variables), as the play would pass them; each variable named in the role's C(defaults/main.yml) or in the
    options of its C(meta/argument_specs.yml), with its value in this task's variables (templated), or its absence.
  - O(extra) adds any other value that matters (a commit id, a package index snapshot).
  - What the role fetches when it runs (the newest package of a repository, say) is not an input the controller can
    know; the playbook C(microvm.sandbox.provision) also retakes its checkpoint when the role reported a change.
author:
  - microvm.sandbox maintainers (@microvm)
options:
  _terms:
    description: Role names (C(namespace.collection.role), a role in a roles path, or a path to a role).
    required: true
    type: list
    elements: str
  extra:
    description: Any value (it is serialised as JSON) that goes into every digest.
    type: raw
"""

EXAMPLES = r"""
- name: Tell whether the provisioning role changed since the session was prepared
  ansible.builtin.set_fact:
    provision_digest: "{{ lookup('microvm.sandbox.role_digest', 'microvm.sandbox.credentials', extra=git_commit | default('')) }}"
"""

RETURN = r"""
_raw:
  description: One SHA-256 hex digest per role.
  type: list
  elements: str
"""

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from typing import Any, Callable, Iterable  # noqa: E402

from ansible.errors import AnsibleError  # noqa: E402
from ansible.module_utils.common.text.converters import to_bytes, to_text  # noqa: E402
from ansible.plugins.lookup import LookupBase  # noqa: E402

SKIPPED_DIRS = frozenset(["__pycache__", ".git"])
SKIPPED_SUFFIXES = (".pyc",)
MAX_DEPTH = 16  # role dependencies nested deeper than this are a cycle or a mistake


def role_files(path: str) -> Iterable[tuple[str, str]]:
    """(relative path, absolute path) of every file of a role, sorted, in a stable walk."""
    found = []
    for top, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in files:
            if name.endswith(SKIPPED_SUFFIXES):
                continue
            full = os.path.join(top, name)
            found.append((os.path.relpath(full, path), full))
    return sorted(found)


def files_digest(path: str) -> str:
    """Every file's relative path, executable bit and content, in one SHA-256."""
    h = hashlib.sha256()
    for rel, full in role_files(path):
        st = os.stat(full)
        h.update(b"F\0" + to_bytes(rel) + b"\0" + (b"x" if st.st_mode & 0o111 else b"-") + b"\0"
                 + str(st.st_size).encode() + b"\0")
        with open(full, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def load_yaml(path: str) -> Any:
    from ansible.parsing.utils.yaml import from_yaml
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return from_yaml(to_text(f.read()), file_name=path)


def variable_names(path: str) -> list[str]:
    """The role's own variables: its defaults' keys and its argument specs' options (every entry point)."""
    names: set[str] = set()
    for ext in ("yml", "yaml"):
        defaults = load_yaml(os.path.join(path, "defaults", "main." + ext))
        if isinstance(defaults, dict):
            names.update(str(k) for k in defaults)
        specs = load_yaml(os.path.join(path, "meta", "argument_specs." + ext))
        if isinstance(specs, dict):
            for entry in (specs.get("argument_specs") or {}).values():
                if isinstance(entry, dict):
                    names.update(str(k) for k in (entry.get("options") or {}))
    return sorted(names)


def dependencies(path: str) -> list[str]:
    """The role names of meta/main.yml's dependencies."""
    found: list[str] = []
    for ext in ("yml", "yaml"):
        meta = load_yaml(os.path.join(path, "meta", "main." + ext))
        deps = meta.get("dependencies") if isinstance(meta, dict) else None
        for dep in deps or []:
            name = (dep.get("role") or dep.get("name")) if isinstance(dep, dict) else dep
            if isinstance(name, str) and name:
                found.append(name)
    return found


class LookupModule(LookupBase):

    def run(self, terms: list[Any], variables: dict[str, Any] | None = None, **kwargs: Any) -> list[str]:
        self.set_options(var_options=variables, direct=kwargs)
        variables = variables or {}
        extra = self.get_option("extra")
        digests = []
        for term in terms:
            name = to_text(term).strip()
            if not name:
                raise AnsibleError("microvm.sandbox.role_digest: an empty role name; give the role as include_role does")
            h = hashlib.sha256(b"microvm.sandbox.role_digest v1\0")
            self._add_role(h, name, variables, seen=set(), depth=0)
            h.update(b"E\0" + to_bytes(json.dumps(extra, sort_keys=True, default=str)))
            digests.append(h.hexdigest())
        return digests

    def _add_role(self, h: Any, name: str, variables: dict[str, Any], seen: set[str], depth: int) -> None:
        path = self._find_role(name)
        if path in seen or depth > MAX_DEPTH:
            return
        seen.add(path)
        h.update(b"R\0" + to_bytes(name) + b"\0" + to_bytes(files_digest(path)) + b"\0")
        for var in variable_names(path):
            if var in variables:
                value = self._templar.template(variables[var]) if self._templar is not None else variables[var]
                h.update(b"V\0" + to_bytes(var) + b"\0" + to_bytes(json.dumps(value, sort_keys=True, default=str)))
            else:
                h.update(b"U\0" + to_bytes(var) + b"\0")
        for dep in dependencies(path):
            self._add_role(h, dep, variables, seen, depth + 1)

    def _find_role(self, name: str) -> str:
        """The role's directory, searched as include_role searches it."""
        from ansible import constants as C
        from ansible.utils.path import unfrackpath

        collection_role = _collection_role_path(name)
        if collection_role:
            return collection_role
        basedir = self._loader.get_basedir() if self._loader is not None else os.getcwd()
        searches = [os.path.join(basedir, "roles")] + list(C.DEFAULT_ROLES_PATH or []) + [basedir]
        for base in searches:
            candidate = unfrackpath(os.path.join(base, name))
            if os.path.isdir(candidate):
                return candidate
        candidate = unfrackpath(name)
        if os.path.isdir(candidate):
            return candidate
        raise AnsibleError("microvm.sandbox.role_digest: the role %r was not found (looked in the installed collections "
                           "and in %s); give its FQCN (namespace.collection.role) or a path" % (name, ":".join(searches)))


def _collection_role_path(name: str) -> str | None:
    """A collection role's directory by its FQCN, through core's own collection finder (as include_role does)."""
    finder: Callable[..., Any]
    try:
        from ansible.utils.collection_loader import AnsibleCollectionRef
        from ansible.utils.collection_loader._collection_finder import _get_collection_role_path as finder
    except ImportError:  # pragma: no cover - every supported core has both
        return None
    if not AnsibleCollectionRef.is_valid_fqcr(name):
        return None
    found = finder(name)
    return to_text(found[1]) if found else None
