# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What the collection's action plugins call on the microvm.sandbox.agent connection beyond Ansible's API.

An action plugin gets its connection typed as Ansible's ConnectionBase; sync and workspace_archive also
call the methods below, which only plugins/connection/agent.py has. sandbox_connection() checks for the
one the caller needs (any other connection gets a clear error from the caller) and types it as this.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.command_stream import ExecStream


class SandboxConnection(Protocol):
    """plugins/connection/agent.py's Connection, as the action plugins use it."""

    def get_option(self, option: str, hostvars: dict[str, Any] | None = None) -> Any: ...

    def fetch_file(self, in_path: str, out_path: str) -> None: ...

    def put_archive(self, in_path: str, out_dir: str) -> dict[str, Any]: ...

    def exec_stream(self, argv: list[str], as_user: bool = True) -> tuple[ExecStream, str]: ...

    def guest_user(self) -> tuple[int, int] | None: ...


def sandbox_connection(conn: object, method: str) -> SandboxConnection | None:
    """conn as a SandboxConnection when it has `method` (the one the caller cannot do without), else None."""
    if not callable(getattr(conn, method, None)):
        return None
    return cast(SandboxConnection, conn)
