# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The mux's error vocabulary: every failure becomes one ERROR frame kind (mux_protocol.ERR_*) here.

The worker turns a kind into the Ansible exception in one place (connection/agent.py, mux_error):
unreachable, lost and gone (mux_protocol.UNREACHABLE_KINDS) make the host UNREACHABLE, whichever path
(cold command, warm module, transfer) hit them; not_found is a missing file; the rest are task failures.
"""

from __future__ import annotations

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import agent_client as ac
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp


class MuxFailure(Exception):
    """A failure the mux reports with its kind."""

    kind = mp.ERR_FAILED

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class Unreachable(MuxFailure):
    """The guest agent cannot be reached (yet); nothing was started."""

    kind = mp.ERR_UNREACHABLE


class SessionGone(Unreachable):
    """The session is deleted, failed or unknown."""

    kind = mp.ERR_GONE


class GuestCommandFailed(MuxFailure):
    """A helper command the mux runs in the guest (staging, mkdir) failed."""


class CommandLost(MuxFailure):
    """A command or module started and its stream was lost: it is reported, never re-run."""

    kind = mp.ERR_LOST


# Exceptions an op may raise that become an ERROR frame (anything else is a bug: logged, then reported).
EXPECTED = (MuxFailure, profile.TransferPathError, ac.AgentError, OSError)


def classify(e: BaseException) -> tuple[str, str]:
    """(kind, message) of an exception, before the session's health is taken into account."""
    if isinstance(e, MuxFailure):
        return e.kind, str(e)
    if isinstance(e, profile.TransferPathError):
        return mp.ERR_PATH, str(e)
    if isinstance(e, ac.RemoteNotFound):
        return mp.ERR_NOT_FOUND, str(e)
    if isinstance(e, ac.TransferDenied):
        return mp.ERR_DENIED, str(e)
    if isinstance(e, (ac.CommandLost, ac.AgentUnavailable)):
        return mp.ERR_LOST, str(e)
    return mp.ERR_FAILED, str(e)
