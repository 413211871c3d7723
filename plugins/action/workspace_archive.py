# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action plugin of microvm.sandbox.workspace_archive: check a tar on the controller, then extract it in the sandbox.

Everything that can be checked is checked on the controller before anything reaches the sandbox: the archive
exists, has the expected sha256, and has no member that would land outside the target (the agent checks again).
Then, only with clean, the target is emptied (keeping the entries that hold the kept paths), and the archive is
streamed through the connection's put_archive (the guest agent's Upload with is_archive).
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import os
import posixpath
import shlex
from typing import Any

from ansible.errors import AnsibleError
from ansible.module_utils.common.text.converters import to_text
from ansible.plugins.action import ActionBase

from ansible_collections.microvm.sandbox.plugins.module_utils.archive_check import (
    ArchiveRefused, check_archive, sha256_file)
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import outcomes
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.sandbox_connection import sandbox_connection
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.untrusted import shown

WORKSPACE = "/workspace"

ARGUMENT_SPEC = dict(
    src=dict(type="path", required=True),
    dest=dict(type="str", default=WORKSPACE),
    sha256=dict(type="str"),
    clean=dict(type="bool", default=False),
    keep=dict(type="list", elements="str", default=["/workspace/.scratch"]),
)


def inside_workspace(path: str) -> bool:
    return path == WORKSPACE or path.startswith(WORKSPACE + "/")


OUTSIDE_RC = 3  # the clean command's exit code when dest resolves outside /workspace in the guest


def clean_command(dest: str, keep: list[str], workspace: str = WORKSPACE) -> str:
    """A shell command that empties dest, except the entries that hold kept paths - only once the guest itself
    resolved dest (cd -P: every link followed, the directory then held as the working directory) to a real
    directory inside /workspace. Otherwise it removes nothing and exits OUTSIDE_RC with the real path on stderr.

    Everything is removed relative to that working directory (find . and rm -rf never follow a link), so a link
    swapped in on the way cannot redirect the removal. Kept paths are resolved in the guest too.
    """
    keep_args = " ".join(shlex.quote(posixpath.normpath(k)) for k in keep)
    return (
        "[ -e {d} ] || exit 0; cd -P -- {d} || exit 1; real=$(pwd -P); "
        'case "$real" in {ws}|{ws}/*) ;; *) printf "%s\\n" "$real" >&2; exit {rc};; esac; '
        "set --; for k in {keep}; do "
        'kr=$(realpath -m -- "$k") || continue; '
        'case "$kr" in "$real"/*) top=${{kr#"$real"/}}; set -- "$@" ! -path "./${{top%%/*}}";; esac; '
        "done; "
        'find . -mindepth 1 -maxdepth 1 "$@" -exec rm -rf -- {{}} +'
    ).format(d=shlex.quote(dest), ws=shlex.quote(workspace), rc=OUTSIDE_RC, keep=keep_args or "''")


class ActionModule(ActionBase):

    TRANSFERS_FILES = False
    _supports_check_mode = True
    _requires_connection = True

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super(ActionModule, self).run(tmp, task_vars)
        del tmp
        validation, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        del validation
        src = os.path.abspath(os.path.expanduser(args["src"]))
        dest = posixpath.normpath(args["dest"] or WORKSPACE)
        result.update(changed=False, src=src, dest=dest)

        if not dest.startswith("/") or not inside_workspace(dest):
            return dict(result, failed=True,
                        msg="workspace_archive: dest %r is not inside /workspace: the platform only extracts archives "
                            "under /workspace (its agent answers PERMISSION_DENIED 'path outside workspace')." % args["dest"])
        if not os.path.isfile(src):
            return dict(result, failed=True, msg="workspace_archive: the archive %s does not exist on the controller" % src)

        digest = sha256_file(src)
        result["sha256"] = digest
        expected = (args["sha256"] or "").strip().lower()
        if expected and expected != digest:
            return dict(result, failed=True,
                        msg="workspace_archive: %s has sha256 %s, not the expected %s: it was changed or damaged, "
                            "so nothing was written in the sandbox" % (src, digest, expected))
        try:
            summary = check_archive(src, dest)
        except ArchiveRefused as e:
            return dict(result, failed=True, offending=e.offending,
                        msg="workspace_archive: %s" % e)
        result["archive"] = summary

        conn = sandbox_connection(self._connection, "put_archive")
        if conn is None:
            return dict(result, failed=True,
                        msg="workspace_archive needs the microvm.sandbox.agent connection (it extracts through the guest "
                            "agent's archive upload); this host uses %s"
                            % getattr(self._connection, "transport", type(self._connection).__name__))

        result["changed"] = True
        result["cleaned"] = False
        if self._task.check_mode:
            return result

        if args["clean"]:
            cmd = clean_command(dest, args["keep"])
            res = self._low_level_execute_command(cmd)
            stderr = shown(res.get("stderr") or "", text=True).strip()  # the guest's words, shown to the user
            if res.get("rc") == OUTSIDE_RC:
                return dict(result, failed=True, changed=False,
                            msg="workspace_archive: dest %s resolves to %s in the sandbox (through a symbolic link), "
                                "outside /workspace: nothing was removed or extracted" % (dest, stderr[-1000:]))
            if res.get("rc", 1) != 0:
                return dict(result, failed=True, changed=False,
                            msg="workspace_archive: could not empty %s before the restore (rc %s): %s"
                                % (dest, res.get("rc"), stderr[-2000:]))
            result["cleaned"] = True
        try:
            sent = conn.put_archive(src, dest)
        except AnsibleError as e:  # the connection's mapping: an UNREACHABLE host goes up as such
            return dict(result, failed=True, changed=result["cleaned"],
                        msg="workspace_archive: the sandbox refused or failed to extract %s into %s: %s"
                            % (src, dest, to_text(outcomes.task_failure(e, "workspace_archive"))))
        if isinstance(sent, dict) and "bytes" in sent:
            result["bytes"] = sent["bytes"]
        return result
