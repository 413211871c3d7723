# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The one mapping of an error's kind (_shared/errors.py) to what the task becomes in Ansible.

The connection plugin (plugins/connection/agent.py) and the action plugins that talk to the mux themselves
(microvm.sandbox.sync, microvm.sandbox.workspace_archive) all decide here, so a lost command, a gone session
or a missing file gives the same outcome whichever path (cold command, warm module, transfer, sync stream)
met it:

- unreachable, lost, gone, protocol: the host is UNREACHABLE (AnsibleConnectionFailure); a lost command
  is never re-run.
- not_found: a missing file (AnsibleFileNotFound, which `fetch` with `fail_on_missing: false` accepts).
- everything else (denied, path, failed, a kind this side does not know): the task fails.

warm_refused is not an outcome: the connection runs the module cold and never lets it reach a task.
"""

from __future__ import annotations

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

UNREACHABLE = "unreachable"
MISSING = "missing"
FAILED = "failed"

OUTCOME_OF_KIND: dict[str, str] = {
    errors.ERR_UNREACHABLE: UNREACHABLE,
    errors.ERR_LOST: UNREACHABLE,
    errors.ERR_GONE: UNREACHABLE,
    errors.ERR_PROTOCOL: UNREACHABLE,
    errors.ERR_NOT_FOUND: MISSING,
    errors.ERR_DENIED: FAILED,
    errors.ERR_PATH: FAILED,
    errors.ERR_FAILED: FAILED,
}
# Which Ansible exception gives each outcome.
EXCEPTION_OF_OUTCOME: dict[str, type[AnsibleError]] = {
    UNREACHABLE: AnsibleConnectionFailure,
    MISSING: AnsibleFileNotFound,
    FAILED: AnsibleError,
}


def outcome(kind: str) -> str:
    """UNREACHABLE, MISSING or FAILED for an error kind (an unknown kind is a task failure)."""
    return OUTCOME_OF_KIND.get(kind, FAILED)


def ansible_error(e: errors.SandboxError, who: str) -> AnsibleError:
    """The Ansible exception for `e`, its message prefixed by `who` (the plugin's name)."""
    return EXCEPTION_OF_OUTCOME[outcome(e.kind)]("%s: %s" % (who, e))


def task_failure(e: Exception, who: str) -> str:
    """For action `who` (sync, workspace_archive): the text of its failed result, or raise when the host is UNREACHABLE.

    `e` is a SandboxError (from a stream the action reads itself) or an AnsibleError the connection already
    mapped here (an AnsibleConnectionFailure then goes up as it is).
    """
    if isinstance(e, errors.SandboxError):
        if outcome(e.kind) == UNREACHABLE:
            raise ansible_error(e, "microvm.sandbox." + who) from e
    elif isinstance(e, AnsibleConnectionFailure):
        raise e
    return str(e)
