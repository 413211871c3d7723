# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The one error vocabulary: every failure on the way to or from a sandbox is a SandboxError carrying its kind.

Defined once, here, for both sides of the unix socket (standard library only): the mux and its two roads
(_mux/agent_client.py, _mux/api_road.py) raise these; the mux sends one as an ERROR frame ({"kind",
"message"}, `to_frame()`); the worker rebuilds the same class from the frame (`from_frame()`); and
_worker/outcomes.py is the one place that turns a kind into an Ansible outcome (UNREACHABLE, a missing
file, a failed task). A subclass may refine a kind (ChecksumMismatch is a plain failure with its own
name); it never changes what the kind means to a task.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

from ansible_collections.microvm.sandbox.plugins.module_utils import profile

# The kinds, as they travel in an ERROR frame (their strings are the wire format: never change one).
ERR_UNREACHABLE = "unreachable"   # the link or session is not usable; nothing was started
ERR_LOST = "lost"                 # a command or transfer started and its stream was lost: never re-run
ERR_GONE = "gone"                 # the session is deleted, failed or unknown
ERR_NOT_FOUND = "not_found"       # a file to transfer does not exist
ERR_DENIED = "denied"             # the guest refused a path
ERR_PATH = "path"                 # refused locally by the platform profile's path rules
ERR_FAILED = "failed"             # anything else: a plain task failure
ERR_PROTOCOL = "protocol"         # a bug or a version mismatch between worker and mux
ERR_WARM = "warm_refused"         # the warm module runner did not start the module: the worker runs it cold


class SandboxError(Exception):
    """A failure with its kind (ERR_*). Raise a subclass; the base is a plain task failure."""

    kind = ERR_FAILED

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind

    def to_frame(self) -> dict[str, str]:
        """The payload of the ERROR frame that carries this error to the worker."""
        return {"kind": self.kind, "message": str(self)}

    def with_context(self, note: str) -> SandboxError:
        """The same error (same class, same kind) with `note` appended to its message."""
        return self.__class__.rebuild("%s; %s" % (self, note), self.kind)

    @classmethod
    def rebuild(cls, message: str, kind: str) -> SandboxError:
        """An instance of this class from its message (subclasses with more fields keep their defaults)."""
        error = cls.__new__(cls)
        SandboxError.__init__(error, message, kind)
        return error


class Unreachable(SandboxError):
    """The guest cannot be reached (yet): nothing was started. The host is UNREACHABLE."""

    kind = ERR_UNREACHABLE


class TunnelFailure(Unreachable):
    """A port-forward dial or connection failed (HTTP status or close code). `fatal`: retrying cannot help."""

    def __init__(self, message: str, status: int | None = None, close_code: int | None = None,
                 fatal: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.close_code = close_code
        self.fatal = fatal
        self.at = time.monotonic()


class SessionGone(Unreachable):
    """The session is deleted, failed or unknown."""

    kind = ERR_GONE


class UnusableDirectory(Unreachable):
    """A local directory of the multiplexer (mux_dir, a mux's own dir, a tunnel's) is not this user's private one:
    a symlink, another user's, a mode that cannot be made 0700. Nothing was started; the message names the fix."""


class CommandLost(SandboxError):
    """A command, module or transfer started and its stream was lost: it may have partly run; never re-run."""

    kind = ERR_LOST


class GuestUnavailable(CommandLost):
    """The guest agent or the data plane stopped answering during a call (a cut transfer, a 5xx)."""


class NotFound(SandboxError):
    """A file to transfer does not exist (in the guest, or on the controller)."""

    kind = ERR_NOT_FOUND


class Denied(SandboxError):
    """The guest refused a transfer path (PERMISSION_DENIED, HTTP 403)."""

    kind = ERR_DENIED


class PathRefused(SandboxError):
    """A guest path refused before any call, by the platform profile's rules (module_utils/profile.py)."""

    kind = ERR_PATH


class ChecksumMismatch(SandboxError):
    """A transferred file's sha256 or size did not match; nothing was put in place."""


class OutputOverLimit(SandboxError):
    """A command printed more than its task may hold (option max_output_bytes): it was stopped. A plain failure.

    The worker raises it past the limit it counts; the api road's mux raises it as soon as the guest's job has
    written more than the limit, without moving those bytes (they would only be dropped)."""

    def __init__(self, session: str, limit: int, seen: str) -> None:
        super().__init__("the command on session %s printed more than %d bytes (%s), the most one task keeps in memory "
                         "(option max_output_bytes of the microvm.sandbox.agent connection: MICROVM_MAX_OUTPUT_BYTES or "
                         "ansible_microvm_max_output_bytes, 0 for no limit); it was stopped. Send big output to a file "
                         "in the sandbox and fetch it instead" % (session, limit, seen))


class HttpRefused(SandboxError):
    """The data plane (api road) answered a call with an error status; `status` says which."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ProtocolMismatch(SandboxError):
    """Worker and mux do not understand each other (an unknown op or setting, an unexpected frame): a bug or two
    versions. Bytes that are not frames at all are frames.ProtocolError, a broken connection like an OSError."""

    kind = ERR_PROTOCOL


class WarmRefused(SandboxError):
    """The warm module runner did not start the request: nothing ran, so the worker runs it cold."""

    kind = ERR_WARM


@contextlib.contextmanager
def path_rules() -> Iterator[None]:
    """Around a call of the profile's path rules: their refusal as a PathRefused.

    module_utils/profile.py is shared with modules, which cannot import this package, so it raises its own
    TransferPathError; the mux and its roads turn it into the family's member right where they call it.
    """
    try:
        yield
    except profile.TransferPathError as e:
        raise PathRefused(str(e)) from e


# The class a worker rebuilds for each kind it reads in an ERROR frame.
CLASS_OF_KIND: dict[str, type[SandboxError]] = {
    ERR_UNREACHABLE: Unreachable,
    ERR_LOST: CommandLost,
    ERR_GONE: SessionGone,
    ERR_NOT_FOUND: NotFound,
    ERR_DENIED: Denied,
    ERR_PATH: PathRefused,
    ERR_FAILED: SandboxError,
    ERR_PROTOCOL: ProtocolMismatch,
    ERR_WARM: WarmRefused,
}
KINDS = frozenset(CLASS_OF_KIND)


def from_frame(payload: Any) -> SandboxError:
    """The error an ERROR frame's payload carries, as the class of its kind.

    A kind this side does not know (a mux of another version) keeps its name and is a plain task failure.
    """
    if not isinstance(payload, dict):
        return ProtocolMismatch("the connection multiplexer sent an ERROR frame without a kind: %r" % (payload,))
    kind = str(payload.get("kind") or ERR_FAILED)
    message = str(payload.get("message") or "the connection multiplexer reported a %s error" % kind)
    return CLASS_OF_KIND.get(kind, SandboxError).rebuild(message, kind)
