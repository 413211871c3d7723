# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A command in the guest as a live stream: stdout read as it arrives, after its stdin was written and closed.

The mux's `exec` op already relays both directions frame by frame; MuxClient.exec() collects the output
into memory, which a manifest of a big tree must not be. Stdin is one-shot (no `hold_stdin`): write it whole
and close it before reading stdout; on the api road the command starts only then, as a job of the documented
buffered exec, so it needs no interactive stdin. This talks the same op over its own connection
to the mux (stdlib only, like everything on the worker side), so an action plugin can run an
Exec, an Upload and a Download of the same session side by side.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp

if TYPE_CHECKING:  # the worker imports it anyway; only the name is needed here
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient

STDIN_FRAME = 1024 * 1024
STDERR_KEPT = 64 * 1024


class ExecStream:
    """One command; iterate `stdout()` once, then read `exit` (the EXIT payload) and `stderr`."""

    def __init__(self, client: MuxClient, argv: list[str], env: dict[str, str] | None = None,
                 run: dict[str, Any] | None = None) -> None:
        self.client = client
        self.stderr = b""
        self.exit: dict[str, Any] | None = None
        self._stdin_open = True
        self.sock = client.connect()._socket()
        mp.send_frame(self.sock, mp.REQUEST, {"op": "exec", "argv": list(argv), "env": env or {}, "workdir": "",
                                              "timeout": 0, "run": run})
        frame = mp.recv_frame(self.sock)
        if frame is None or frame[0] != mp.ACK:
            raise errors.Unreachable("the connection multiplexer did not take the command")

    def stdout(self) -> Iterator[bytes]:
        """Chunks of stdout until the command exits; a SandboxError when it fails or is lost."""
        while True:
            frame = mp.recv_frame(self.sock)
            if frame is None:
                raise errors.CommandLost("the connection multiplexer hung up during the command")
            kind, payload = frame
            if kind == mp.STDOUT:
                yield payload
            elif kind == mp.STDERR:
                self.stderr = (self.stderr + payload)[-STDERR_KEPT:]
            elif kind == mp.EXIT:
                self.exit = payload
                return
            elif kind == mp.ERROR:
                raise errors.from_frame(payload)
            else:
                raise errors.ProtocolMismatch("unexpected frame %d from the mux" % kind)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        for offset in range(0, len(view), STDIN_FRAME):
            mp.send_frame(self.sock, mp.STDIN, view[offset:offset + STDIN_FRAME])

    def close_stdin(self) -> None:
        if self._stdin_open:
            self._stdin_open = False
            mp.send_frame(self.sock, mp.STDIN_EOF)

    def close(self) -> None:
        try:
            if self.exit is not None:
                self.close_stdin()  # keeps the connection in step, as MuxClient does
        except OSError:
            pass
        self.client.close()
