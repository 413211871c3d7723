# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""ansible-core's internals, A8 (listed in core_compat.py): this collection's compiled code, once per run.

A module of its own, and a small one: core's loader compiles from source whatever a worker imports before the
cache is in place, in every task's worker, so the connection plugin imports this first (it was core_compat,
1.1 ms to compile in each task's worker; issue 45). Only the standard library and ansible-core (imported lazily).
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import tempfile
from typing import Any

COLLECTION = "ansible_collections.microvm.sandbox."


def cache_collection_code() -> bool:
    """Have core's collection loader keep the compiled code of this collection's modules for the run.

    Every task's worker imports the connection plugin afresh, and core's loader compiles each of its modules
    from source there (about a third of loading the plugin). The first worker of a run now writes the
    code (marshal) to the run's local temp dir, created by ansible-playbook before it forks the workers and
    removed when it ends, named by the digest of the interpreter's magic number, file name and source; the
    other workers read it. Only this collection's modules; anything unexpected leaves core's own path.
    True when the hook is in place.
    """
    try:
        from ansible import constants as C
        from ansible.utils.collection_loader import _collection_finder as finder

        base = finder._AnsibleCollectionPkgLoaderBase
        original = base.get_code
        if getattr(original, "microvm_cached", False):
            return True
        cache_dir = C.DEFAULT_LOCAL_TMP
    except Exception:  # a core without this loader: an optimisation only
        return False

    def get_code(self: Any, fullname: str) -> Any:
        if getattr(self, "_compiled_code", None) or not fullname.startswith(COLLECTION):
            return original(self, fullname)
        try:
            filename = self.get_filename(fullname) or "<string>"
            source = self.get_source(fullname)
        except Exception:
            return original(self, fullname)
        if source is None:
            return original(self, fullname)
        raw = source if isinstance(source, bytes) else source.encode("utf-8", "surrogateescape")
        digest = hashlib.sha256(importlib.util.MAGIC_NUMBER + filename.encode("utf-8", "surrogateescape") + b"\0" + raw)
        path = os.path.join(cache_dir, "microvm-code-%s" % digest.hexdigest()[:40])
        try:
            with open(path, "rb") as f:
                code = marshal.load(f)
        except (OSError, EOFError, ValueError, TypeError):
            code = compile(source=source, filename=filename, mode="exec", flags=0, dont_inherit=True)
            try:
                fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".microvm-code-")
                with os.fdopen(fd, "wb") as f:
                    marshal.dump(code, f)
                os.replace(tmp, path)
            except (OSError, ValueError):
                pass
        self._compiled_code = code
        return code

    get_code.microvm_cached = True  # type: ignore[attr-defined]
    base.get_code = get_code  # type: ignore[method-assign]  # patching core's loader is the point
    return True
