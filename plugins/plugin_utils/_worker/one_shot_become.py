# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""sudo with a password where no stdin comes while a command runs: the api road's one-shot stdin.

The documented exec delivers stdin whole, then closes it; a password prompt cannot be answered as it
appears (that needs the team's interactive stdin). sudo -S (ansible.builtin.sudo's default flags) reads its
password from stdin before the command reads anything, so the password goes FIRST on the one-shot stdin,
and the rest of stdin is the command's. Where sudo will not prompt (`<become_exe> -n true` succeeds: root,
NOPASSWD), a small guest-side script takes the password line off again, so it never reaches the command.
What sudo printed is then judged after the fact, as the interaction would have: its prompt seen, its
success marker, its "incorrect password" text (the caller's checks).

su has no -S: where it would prompt (the connection user is not root) it is left to interactive stdin, which
the mux refuses at once, naming sudo and the team setting, when the team does not have it. su from root asks
nothing, so su on the api road runs first behind a guard (ROOT_FIRST) on the buffered exec: as root the
command runs there, judged after the fact like sudo's; as anyone else the guard stops before su with a marker
only this call knows (nothing ran), and the connection takes the interactive road for this and later su commands;
so does a su that asked root all the same (it gave up on the empty stdin: nothing ran). Only su itself: another
become_exe may ask root too, so it goes to the interactive road at once.
"""

from __future__ import annotations

import os
from typing import Any

# $1 the become exe; then the become command. The password line is taken off stdin when sudo will not ask.
# $e unquoted: a become_exe of several words ("sudo -u dev sudo") is split as the become command splits it.
PASSWORD_FIRST = 'e=$1; shift; if $e -n true </dev/null >/dev/null 2>&1; then IFS= read -r _ || :; fi; exec "$@"'
SUDO_NAMES = ("sudo", "ansible.builtin.sudo")
SU_NAMES = ("su", "ansible.builtin.su")
# $1 the marker; then the become command, run only by root (whose su never prompts).
ROOT_FIRST = 'm=$1; shift; if [ "$(id -u)" = 0 ]; then exec "$@"; fi; printf "%s\\n" "$m" >&2; exit 125'
NOT_ROOT_RC = 125


def applies(become: Any, attached: dict[str, Any] | None) -> bool:
    """True for sudo expecting a password on a link of the api road (the mux's attach answer names its road)."""
    return (attached or {}).get("road") == "api" and getattr(become, "name", "") in SUDO_NAMES


def wrap(become: Any, argv: list[str], stdin: bytes, password: bytes) -> tuple[list[str], bytes]:
    """(argv, stdin) that give sudo its password first on the one-shot stdin."""
    exe = become.get_option("become_exe") or "sudo"
    return ["/bin/sh", "-c", PASSWORD_FIRST, "sh", exe] + list(argv), password.rstrip(b"\n") + b"\n" + stdin


def judge(become: Any, stdout: bytes, stderr: bytes, prompted: list[bool], succeeded: list[bool]) -> None:
    """Fill `prompted` and `succeeded` from the whole output, as the live interaction fills them."""
    if become.check_password_prompt(stderr) or become.check_password_prompt(stdout):
        prompted.append(True)
    if become.check_success(stdout):
        succeeded.append(True)


def su_first(become: Any, attached: dict[str, Any] | None) -> bool:
    """True for su itself (not another become_exe, which may ask root too) on a link of the api road: tried first
    where it needs no password (root)."""
    if (attached or {}).get("road") != "api" or getattr(become, "name", "") not in SU_NAMES:
        return False
    exe = (become.get_option("become_exe") or "su").split()
    return bool(exe) and os.path.basename(exe[0]) == "su"


def su_asked(become: Any, rc: int, stdout: bytes, stderr: bytes, marker: str) -> bool:
    """The guarded su did not run the command because it needs a password: the guard stopped before it (not root),
    or su asked all the same and gave up (a PAM that asks root too); either way nothing ran as the target user."""
    if rc == NOT_ROOT_RC and stderr.rstrip(b"\n").endswith(marker.encode()):
        return True
    asked = become.check_password_prompt(stdout) or become.check_password_prompt(stderr)
    return bool(asked) and not become.check_success(stdout)


def root_only(argv: list[str]) -> tuple[list[str], str]:
    """(argv that runs the become command only as root, the marker it prints instead when not root)."""
    marker = "microvm-su-not-root-%s" % os.urandom(8).hex()
    return ["/bin/sh", "-c", ROOT_FIRST, "sh", marker] + list(argv), marker
