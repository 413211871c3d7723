# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Hand ansible-core a plugin's option definitions parsed with libyaml.

ansible-core forks a worker per task, and a worker loads the task's connection
plugin afresh: before the plugin can read an option, core parses the plugin's
DOCUMENTATION with its origin-tracking YAML loader, about 15-20 ms for the
agent connection's, on every task. Core skips that parse when the options are
already defined (ConfigManager.has_configuration_definition), so the plugin
defines them itself when it is imported, from the same DOCUMENTATION, parsed
by libyaml in about 2 ms, once per run (the other workers read the result from
the run's local temp dir). Anything unusual (no libyaml, doc fragments to merge,
a template in a default, which core would need to mark as trusted) leaves the
work to core, unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

try:
    import yaml
    from yaml import CSafeLoader as FAST_LOADER
except ImportError:  # no libyaml: core parses as usual
    FAST_LOADER = None  # type: ignore[misc,assignment]


def parsed_options(documentation: str) -> dict[str, Any] | None:
    """The `options` of a DOCUMENTATION string, or None when core must handle it itself."""
    if FAST_LOADER is None:
        return None
    doc = yaml.load(documentation, Loader=FAST_LOADER)
    if not isinstance(doc, dict) or doc.get("extends_documentation_fragment"):
        return None
    options = doc.get("options")
    if not isinstance(options, dict) or "{{" in documentation or "{%" in documentation:
        return None
    return options


def cached_options(documentation: str) -> dict[str, Any] | None:
    """parsed_options, kept as JSON in this run's local temp dir: the first worker parses, the others read.

    The dir is ansible-core's per-run one (created by the parent before it forks workers), so nothing
    outlives the run; a file that cannot be read or written just means parsing again.
    """
    from ansible import constants as C

    path = os.path.join(C.DEFAULT_LOCAL_TMP, "microvm-options-%s.json"
                        % hashlib.sha256(documentation.encode("utf-8")).hexdigest()[:32])
    try:
        with open(path, "r") as f:
            return json.load(f)
    except (OSError, ValueError):
        pass
    options = parsed_options(documentation)
    if options is not None:
        try:
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".microvm-options-")
            with os.fdopen(fd, "w") as f:
                json.dump(options, f)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError):
            pass
    return options


def register(plugin_type: str, name: str, documentation: str) -> bool:
    """Define the options of plugin `name` unless core already has them; True if defined here.

    `name` is what core files the plugin's options under: for a collection plugin, its
    Python module name (the plugin module passes its __name__).
    """
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat

    try:
        if core_compat.plugin_options_defined(plugin_type, name):
            return False
        options = cached_options(documentation)
        if options is None:
            return False
        core_compat.define_plugin_options(plugin_type, name, options)
        return True
    except Exception:  # an optimisation only: core's own parse is always the fallback
        return False
