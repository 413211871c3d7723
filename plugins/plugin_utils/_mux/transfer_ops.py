# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Transfers and staging: put, fetch and put_archive for one session (ops of the mux, see _mux/server.py).

The mux does the file I/O itself (the worker sends local paths). Guest paths inside the transfer
root go straight through the agent; others are staged through the run's TMPDIR with commands in
the guest, and renamed into place so a cut copy leaves the old file or nothing.
"""

from __future__ import annotations

import logging
import os
import posixpath
import uuid

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp

log = logging.getLogger("microvm.mux")



def _stage_name(run_dir: str, remote: str) -> str:
    return posixpath.join(run_dir, ".stage.%s.%s" % (uuid.uuid4().hex[:12], posixpath.basename(remote)[:60]))


def _stage_dir(link, req: dict, remote: str) -> str:
    run_dir = link.runs.ensure(req.get("run"))
    if not run_dir:
        raise errors.GuestCommandFailed("cannot stage %s: no run scratch dir" % remote)
    return run_dir


def op_put(link, req: dict) -> dict:
    local, remote = req["local"], profile.guest_path(req["remote"])
    if not os.path.isfile(local):
        raise ac.RemoteNotFound("local file %s to upload does not exist" % local)
    link.ensure_ready()
    if profile.is_within(remote):
        try:
            return {"bytes": link.agent.upload(local, remote), "staged": False}
        except ac.TransferDenied:
            pass  # a symlink inside the workspace pointing outside it: stage instead
    stage = _stage_name(_stage_dir(link, req, remote), remote)
    written = link.agent.upload(local, stage)
    # copy next to the destination, then rename: atomic on the guest even across filesystems
    link.guest('trap \'rm -f -- "$1"\' EXIT; d=$(dirname -- "$2"); t="$d/.microvm.$$.$(basename -- "$2")"; '
               'cp -- "$1" "$t" && mv -f -- "$t" "$2" || { rc=$?; rm -f -- "$t"; exit $rc; }', stage, remote)
    return {"bytes": written, "staged": True}


def op_put_archive(link, req: dict) -> dict:
    """Extract a local tar into a guest directory through Upload(is_archive); never staged.

    The agent checks every member before writing, so a refused archive leaves the target as it was.
    """
    local, remote = req["local"], profile.guest_path(req["remote"])
    if not os.path.isfile(local):
        raise ac.RemoteNotFound("local archive %s to upload does not exist" % local)
    link.ensure_ready()
    return {"bytes": link.agent.upload(local, remote, is_archive=True), "staged": False}


def op_fetch(link, req: dict) -> dict:
    remote, local = profile.guest_path(req["remote"]), req["local"]
    link.ensure_ready()
    if profile.is_within(remote):
        try:
            return {"bytes": link.agent.download(remote, local), "staged": False}
        except ac.TransferDenied:
            pass
    run_dir = _stage_dir(link, req, remote)
    stage = _stage_name(run_dir, remote)
    try:
        link.guest('cp -- "$1" "$2"', remote, stage)
    except errors.GuestCommandFailed as e:
        if e.kind == mp.ERR_NOT_FOUND:
            raise ac.RemoteNotFound("cannot fetch %s from session %s: no such file" % (remote, link.label)) from e
        raise errors.GuestCommandFailed("cannot stage %s from session %s through %s: %s"
                                        % (remote, link.label, run_dir, e), e.kind) from e
    try:
        return {"bytes": link.agent.download(stage, local), "staged": True}
    finally:
        try:
            link.guest('rm -f -- "$1"', stage)
        except Exception as e:
            log.warning("session %s: could not remove staged copy %s: %s", link.label, stage, e)
