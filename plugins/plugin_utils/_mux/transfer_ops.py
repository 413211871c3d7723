# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Transfers and staging: put, fetch and put_archive for one session (ops of the mux, see _mux/server.py).

The mux does the file I/O itself (the worker sends local paths). Guest paths inside the transfer
root go straight through the agent; others are staged through the run's TMPDIR with commands in
the guest, and renamed into place so a cut copy leaves the old file or nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import uuid
from collections.abc import Iterator
from typing import Any

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import exec_ops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.session_link import RC_DENIED, RC_NOT_FOUND, SessionLink
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

log = logging.getLogger("microvm.mux")

# The staged put: copy next to the destination, then rename (atomic on the guest even across filesystems).
# A missing destination directory is told by its exit code, never by cp's words.
PUT_STAGED = ('trap \'rm -f -- "$1"\' EXIT; d=$(dirname -- "$2"); [ -d "$d" ] || exit %d; '
              't="$d/.microvm.$$.$(basename -- "$2")"; '
              'cp -- "$1" "$t" && mv -f -- "$t" "$2" || { rc=$?; rm -f -- "$t"; exit $rc; }' % RC_NOT_FOUND)
# The staged fetch's copy into the run's dir: a missing or unreadable source is told by its exit code.
FETCH_STAGED = '[ -e "$1" ] || exit %d; [ -r "$1" ] || exit %d; cp -- "$1" "$2"' % (RC_NOT_FOUND, RC_DENIED)


@contextlib.contextmanager
def _controller_file(path: str) -> Iterator[None]:
    """The mux's own I/O on a controller file of a transfer: its OSError as a task failure naming the file."""
    try:
        yield
    except OSError as e:
        raise errors.SandboxError("controller file %s: %s" % (path, e.strerror or e)) from e


def _moved(size: int, staged: bool) -> dict[str, Any]:
    """A transfer's reply: its bytes, whether it was staged, and what carried it ("bulk", "grpc"; the api road: "api")."""
    return {"bytes": int(size), "staged": staged, "via": getattr(size, "via", "api")}


def _guest_path(path: str) -> str:
    with errors.path_rules():
        return profile.guest_path(path)


def _stage_name(run_dir: str, remote: str) -> str:
    return posixpath.join(run_dir, ".stage.%s.%s" % (uuid.uuid4().hex[:12], posixpath.basename(remote)[:60]))


def _stage_dir(link: SessionLink, req: dict[str, Any], remote: str) -> str:
    run_dir = link.runs.ensure(req.get("run"))
    if not run_dir:
        raise errors.SandboxError("cannot stage %s: no run scratch dir" % remote)
    return run_dir


def op_put(link: SessionLink, req: dict[str, Any]) -> dict[str, Any]:
    """A put, after the task tmp dir commands deferred to it (`ahead`: the task's mkdtemp, so its dir exists when the
    file is written); one that fails is answered {"ahead_failed": ...} and nothing is written."""
    local, remote = req["local"], _guest_path(req["remote"])
    if not os.path.isfile(local):
        raise errors.NotFound("local file %s to upload does not exist" % local)
    link.ensure_ready()
    if req.get("ahead"):
        link.runs.ensure(req.get("run"))
        failed = exec_ops.tmp_ahead(link, req)
        if failed is not None:
            return {"ahead_failed": failed}
    if profile.is_within(remote):
        try:
            with _controller_file(local):
                return _moved(link.client.upload(local, remote), staged=False)
        except errors.Denied:
            pass  # a symlink inside the workspace pointing outside it: stage instead
    stage = _stage_name(_stage_dir(link, req, remote), remote)
    with _controller_file(local):
        written = link.client.upload(local, stage)
    try:
        link.guest(PUT_STAGED, stage, remote)
    except errors.NotFound as e:
        raise errors.NotFound("cannot put %s into session %s: its directory does not exist" % (remote, link.label)) from e
    return _moved(written, staged=True)


def op_put_archive(link: SessionLink, req: dict[str, Any]) -> dict[str, Any]:
    """Extract a local tar into a guest directory through Upload(is_archive); never staged.

    The agent checks every member before writing, so a refused archive leaves the target as it was.
    """
    local, remote = req["local"], _guest_path(req["remote"])
    if not os.path.isfile(local):
        raise errors.NotFound("local archive %s to upload does not exist" % local)
    link.ensure_ready()
    with _controller_file(local):
        return _moved(link.client.upload(local, remote, is_archive=True), staged=False)


def op_fetch(link: SessionLink, req: dict[str, Any]) -> dict[str, Any]:
    remote, local = _guest_path(req["remote"]), req["local"]
    link.ensure_ready()
    if profile.is_within(remote):
        try:
            with _controller_file(local):
                return _moved(link.client.download(remote, local), staged=False)
        except errors.Denied:
            pass
    run_dir = _stage_dir(link, req, remote)
    stage = _stage_name(run_dir, remote)
    try:
        link.guest(FETCH_STAGED, remote, stage)
    except errors.NotFound as e:
        raise errors.NotFound("cannot fetch %s from session %s: no such file" % (remote, link.label)) from e
    except errors.SandboxError as e:
        if isinstance(e, errors.CommandLost):
            raise
        raise e.rebuild("cannot stage %s from session %s through %s: %s" % (remote, link.label, run_dir, e), e.kind) from e
    try:
        with _controller_file(local):
            return _moved(link.client.download(stage, local), staged=True)
    finally:
        try:
            link.guest('rm -f -- "$1"', stage)
        except Exception as e:
            log.warning("session %s: could not remove staged copy %s: %s", link.label, stage, e)
