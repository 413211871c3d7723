# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""AnsiballZ payload contents kept across runs, in the task's worker (core_compat A10).

ansible-core builds a module's AnsiballZ zip once per run: `module_common.recursive_finder` parses every
module_util the module imports (60 ms for `command` on an idle machine, 114-231 ms under load) in the first
worker of each run that uses the module, and core's own cache of the result lives in the run's temp dir. This
keeps what recursive_finder put into the zip in the controller user's own dir and hands it back to core's zip
when nothing it was made from has changed:

- the key: core's version, the module's name, fqn, path and sha256, the zip's compression, core's payload
  extensions (debugger, coverage), and the search paths of module_utils and of collections;
- checked at every use: the sha256 of each file an entry came from, and that nothing appeared where the
  import would find it first (an earlier module_utils dir, an earlier collection path);
- never kept: a payload with an entry that came from no file, other than core's own package inits (a
  redirect's shim: its text follows routing rules the key does not cover).

A store dir another user can write is not used. Anything unexpected builds as core does. The payload core
then makes is the one it would have made: the same entries, bytes and order (only the zip's timestamps are
this run's, as always).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import stat
import tempfile
from typing import Any, Callable

FORMAT = 1
HEADER = b"microvm-payload-cache %d\n" % FORMAT
# core's package inits made from no file (recursive_finder's py_module_cache seed): their text is core's version
CORE_MADE = frozenset({"ansible/__init__.py", "ansible/module_utils/__init__.py"})
KEEP_MAX = 256           # entries per core version; the least recently used go first
READ_MAX = 64 * 1024 * 1024  # a stored payload bigger than this is not ours


def default_root() -> str:
    return os.path.join(os.path.expanduser("~"), ".ansible", "microvm_sandbox", "payloads")


@dataclasses.dataclass
class Counts:
    """What this process's hook did (tests and -vvv read it)."""

    hits: int = 0
    built: int = 0
    kept: int = 0
    refused: int = 0


COUNTS = Counts()
_state: dict[str, Any] = {"root": None, "note": None}


def configure(root: str | None, note: Callable[[str], None] | None = None) -> None:
    """Where the store is (None or "" switches the cache off), and where a line about each use goes."""
    _state["root"] = os.path.expanduser(root) if root else None
    _state["note"] = note


def install() -> bool:
    """Put the hook around core's recursive_finder; True when it is in place."""
    try:
        from ansible.executor import module_common
    except ImportError:
        return False
    original = getattr(module_common, "recursive_finder", None)
    if original is None or not all(hasattr(module_common, n) for n in ("_make_zinfo", "Origin", "metadata_versions")):
        return False
    if getattr(original, "microvm_payload_cache", False):
        return True

    def recursive_finder(name: str, module_fqn: str, module_data: Any, zf: Any, date_time: Any,
                         extension_manager: Any, *args: Any, **kwargs: Any) -> Any:
        store = _store()
        if store is None or args or kwargs:
            return original(name, module_fqn, module_data, zf, date_time, extension_manager, *args, **kwargs)
        try:
            key = store.key(module_common, name, module_fqn, module_data, zf.compression, extension_manager)
        except Exception:  # anything unexpected in core's objects: core builds as always
            key = None
        if key is not None:
            hit = store.load(module_common, key)
            if hit is not None:
                entries, metadata = hit
                for arcname, data in entries:
                    zf.writestr(module_common._make_zinfo(arcname, date_time, zf=zf), data)
                COUNTS.hits += 1
                _say("the AnsiballZ payload of %s came from the payload cache (%s)" % (module_fqn, store.root))
                return metadata
        recording = Recording(zf)
        metadata = original(name, module_fqn, module_data, recording, date_time, extension_manager)
        COUNTS.built += 1
        if key is not None and [e[0] for e in recording.entries] == zf.namelist():  # all it wrote went by writestr
            if store.save(module_common, key, recording.entries, metadata):
                COUNTS.kept += 1
            else:
                COUNTS.refused += 1
        return metadata

    recursive_finder.microvm_payload_cache = True  # type: ignore[attr-defined]
    module_common.recursive_finder = recursive_finder
    return True


def _say(line: str) -> None:
    note = _state["note"]
    if note is not None:
        note(line)


def _store() -> Store | None:
    root = _state["root"]
    if not root:
        return None
    from ansible.release import __version__

    return Store(os.path.join(root, "core-%s-%d" % (__version__, FORMAT)))


class Recording:
    """Core's zip, with a note of what recursive_finder writes into it: (name, bytes, source path or None)."""

    def __init__(self, zf: Any) -> None:
        self._zf = zf
        self.compression = zf.compression
        self.entries: list[tuple[str, bytes, str | None]] = []

    def writestr(self, zinfo: Any, data: Any, *args: Any, **kwargs: Any) -> None:
        from ansible.executor import module_common

        origin = module_common.Origin.get_tag(data)
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        self.entries.append((zinfo.filename if hasattr(zinfo, "filename") else str(zinfo), raw,
                             origin.path if origin is not None else None))
        self._zf.writestr(zinfo, data, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._zf, name)


def _sha256_file(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _module_utils_roots(module_common: Any) -> list[str]:
    """The dirs core's recursive_finder searches for ansible.module_utils, in its order."""
    from ansible.plugins.loader import module_utils_loader

    roots = [p for p in module_utils_loader._get_paths(subdirs=False) if os.path.isdir(p)]
    return roots + [module_common._MODULE_UTILS_PATH]


def _collection_roots() -> list[str]:
    from ansible.utils.collection_loader import AnsibleCollectionConfig

    return list(AnsibleCollectionConfig.collection_paths)


def _other_forms(rel: str) -> list[str]:
    """A module file's relative path and the other file that would be imported for the same name."""
    if rel.endswith("/__init__.py"):
        return [rel, rel[:-len("/__init__.py")] + ".py"]
    return [rel, rel[:-3] + "/__init__.py"]


def _must_stay_absent(source: str, mu_roots: list[str], coll_roots: list[str]) -> list[str] | None:
    """The paths where a new file would win the import of `source`; None when we cannot tell (not kept)."""
    for i, root in enumerate(mu_roots):
        prefix = root.rstrip(os.sep) + os.sep
        if source.startswith(prefix):
            rel = source[len(prefix):]
            return [os.path.join(earlier, form) for earlier in mu_roots[:i] for form in _other_forms(rel)]
    marker = os.sep + "ansible_collections" + os.sep
    if marker in source:
        base, _marker, rest = source.partition(marker)
        parts = rest.split(os.sep)
        if len(parts) < 3:
            return None
        bases = [r.rstrip(os.sep) for r in coll_roots]
        if base.rstrip(os.sep) not in bases:
            return None
        earlier = bases[:bases.index(base.rstrip(os.sep))]
        return [os.path.join(b, "ansible_collections", parts[0], parts[1]) for b in earlier]
    return None


class Store:
    """One core version's entries: a file per key, written whole by rename, readable only by its owner."""

    def __init__(self, root: str) -> None:
        self.root = root

    def key(self, module_common: Any, name: str, module_fqn: str, module_data: Any, compression: int,
            extension_manager: Any) -> str | None:
        origin = module_common.Origin.get_tag(module_data)
        if origin is None or not origin.path:
            return None
        raw = module_data.encode("utf-8") if isinstance(module_data, str) else bytes(module_data)
        parts = {"name": name, "fqn": module_fqn, "path": origin.path, "sha256": hashlib.sha256(raw).hexdigest(),
                 "compression": compression, "extensions": list(extension_manager.extension_names or ()),
                 "module_utils": _module_utils_roots(module_common),
                 # a path that does not exist holds nothing (a run's playbook dir names its own `collections`):
                 # one that appears since changes the key
                 "collections": [p for p in _collection_roots() if os.path.isdir(p)]}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _private_dir(self, create: bool) -> bool:
        """The store dir exists (made if asked) and only this user can write it and its parents up to root."""
        try:
            if create:
                os.makedirs(self.root, mode=0o700, exist_ok=True)
            for path in (self.root, os.path.dirname(self.root)):
                st = os.stat(path)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
                    return False
            return True
        except OSError:
            return False

    def load(self, module_common: Any, key: str) -> tuple[list[tuple[str, bytes]], Any] | None:
        path = self._path(key)
        if not os.path.exists(path) or not self._private_dir(create=False):
            return None
        try:
            with open(path, "rb") as f:
                if f.readline() != HEADER:
                    return None
                head = json.loads(f.readline())
                blob = f.read(READ_MAX + 1)
            entries = []
            offset = 0
            for entry in head["entries"]:
                data = blob[offset:offset + entry["size"]]
                offset += entry["size"]
                if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    return None  # cut or changed on disk
                if entry["source"] is not None and _sha256_file(entry["source"]) != entry["sha256"]:
                    return None  # the file it came from changed (or went): core builds it afresh
                if any(os.path.lexists(p) for p in entry["absent"]):
                    return None  # something new would now be imported in its place
                entries.append((entry["name"], data))
            if offset != len(blob):
                return None
            metadata = _metadata_from(module_common, head["metadata"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if metadata is None:
            return None
        try:
            os.utime(path)  # recently used: kept when the store is trimmed
        except OSError:
            pass
        return entries, metadata

    def save(self, module_common: Any, key: str, recorded: list[tuple[str, bytes, str | None]],
             metadata: Any) -> bool:
        """Keep what was recorded; False when it must not be kept (an entry from no file, a shared dir)."""
        meta = _metadata_to(module_common, metadata)
        if meta is None:
            return False
        mu_roots, coll_roots = _module_utils_roots(module_common), _collection_roots()
        head_entries = []
        for name, data, source in recorded:
            if source is None:
                if data and name not in CORE_MADE:
                    return False
                absent: list[str] | None = []
            else:
                absent = _must_stay_absent(source, mu_roots, coll_roots)
                if absent is None:
                    return False
            head_entries.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                 "source": source, "absent": absent})
        if not self._private_dir(create=True):
            return False
        body = io.BytesIO()
        body.write(HEADER)
        body.write(json.dumps({"entries": head_entries, "metadata": meta}).encode("utf-8") + b"\n")
        for _name, data, _source in recorded:
            body.write(data)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".part-")
            with os.fdopen(fd, "wb") as f:
                f.write(body.getvalue())
            os.replace(tmp, self._path(key))
        except OSError:
            return False
        self._trim()
        return True

    def _trim(self) -> None:
        try:
            names = [n for n in os.listdir(self.root) if not n.startswith(".")]
            if len(names) <= KEEP_MAX:
                return
            by_age = sorted(names, key=lambda n: os.stat(os.path.join(self.root, n)).st_mtime)
            for name in by_age[:len(names) - KEEP_MAX]:
                os.unlink(os.path.join(self.root, name))
        except OSError:
            pass


def _metadata_to(module_common: Any, metadata: Any) -> dict[str, Any] | None:
    cls = type(metadata)
    if cls not in set(module_common.metadata_versions.values()) or not dataclasses.is_dataclass(metadata) \
            or isinstance(metadata, type):
        return None
    fields = dataclasses.asdict(metadata)
    if not all(isinstance(v, (str, int, bool)) for v in fields.values()):
        return None
    return {"class": cls.__name__, "fields": fields}


def _metadata_from(module_common: Any, meta: dict[str, Any]) -> Any:
    for cls in module_common.metadata_versions.values():
        if cls.__name__ == meta["class"]:
            return cls(**meta["fields"])
    return None
