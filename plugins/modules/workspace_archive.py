#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: workspace_archive
short_description: Extract a controller tar archive into a sandbox's workspace, refusing anything that escapes it
version_added: 0.1.0
description:
  - Checks a tar archive (plain or compressed) on the controller, then extracts it into a directory inside
    C(/workspace) of a sandbox through the guest agent's archive upload (C(Upload) with C(is_archive)).
  - Before anything is sent, the archive must exist, match O(sha256) when it is given, and hold no member
    that would land outside O(dest) once extracted - an absolute path, a C(..) escape, a symbolic link or hard
    link to a place outside O(dest), a member reached through a link of the same archive, or a device or FIFO.
    The task fails naming every offending member, and nothing is written in the sandbox.
  - The agent checks every member again and refuses the whole archive, writing nothing, when one escapes.
  - Files in the archive replace files of the same path in O(dest); other files are kept unless O(clean) is set.
    Regular file modes are kept (group and other write bits and set-id bits are dropped by the agent);
    symbolic links that stay inside O(dest) are kept; ownership is the agent's user.
  - This is an action plugin; it runs on the controller and needs the P(microvm.sandbox.agent#connection)
    connection (it fails clearly with any other).
  - The role C(microvm.sandbox.workspace_restore) uses it.
author:
  - microvm.sandbox maintainers (@microvm)
options:
  src:
    description:
      - Path of the archive on the controller.
    type: path
    required: true
  dest:
    description:
      - Directory in the sandbox to extract into; must be C(/workspace) or inside it. Created when missing.
    type: str
    default: /workspace
  sha256:
    description:
      - The sha256 (hex) the archive must have. Checked before anything is sent.
    type: str
  clean:
    description:
      - Empty O(dest) before extracting (after every check passed), so that it holds exactly the archive's contents.
      - Top-level entries of O(dest) that hold a path of O(keep) are left alone.
      - The sandbox resolves O(dest) (every symbolic link followed) before anything is removed, and removes only
        below that real directory. When it lies outside C(/workspace) (a O(dest) through a link such as
        C(/workspace/up -> /)), nothing is removed or extracted and the task fails naming the real path.
    type: bool
    default: false
  keep:
    description:
      - Paths that O(clean) never removes. The default keeps the scratch dir, where Ansible's own temporary
        files of the run live.
    type: list
    elements: str
    default: [/workspace/.scratch]
attributes:
  check_mode:
    description: Can run in C(check_mode) and return changed status prediction without modifying the target.
    support: full
    details:
      - Checks the archive and reports what would change; nothing is sent or removed.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in C(check_mode)), when in diff mode.
    support: none
  action:
    description: Indicates this has a corresponding action plugin so some parts of the options can be executed on the controller.
    support: full
    details:
      - Runs on the controller and calls the connection.
  platform:
    description: Target OS/families that can be operated against.
    support: N/A
    platforms: posix
notes:
  - The check is on the member names, resolving symbolic links through the archive's own links (a chain such as
    C(d -> .) then C(e -> d/d/d/../..) is refused). A symbolic link that already exists in the sandbox and points
    outside O(dest) is caught by the agent, which checks the whole archive against the sandbox's tree and refuses
    it before writing anything.
  - Names longer than 255 bytes, or paths longer than 4096 bytes once extracted, are refused on the controller.
  - What only the agent can refuse comes after O(clean) - an archive over the platform's bounds, or one that writes
    through a link kept by O(keep). Then O(dest) stays emptied and the task fails with C(cleaned=true).
seealso:
  - module: microvm.sandbox.workspace_object
"""

EXAMPLES = r"""
- name: Restore an exported workspace into a fresh session
  microvm.sandbox.workspace_archive:
    src: out/ci-42-workspace.tar.gz
    sha256: "{{ lookup('ansible.builtin.file', 'out/ci-42-workspace.tar.gz.sha256').split()[0] }}"

- name: Replace a project directory with the archive's contents
  microvm.sandbox.workspace_archive:
    src: out/project.tar.gz
    dest: /workspace/restored
    clean: true
"""

RETURN = r"""
src:
  description: The archive on the controller.
  returned: always
  type: str
dest:
  description: The directory in the sandbox the archive was extracted into.
  returned: always
  type: str
  sample: /workspace
sha256:
  description: The archive's sha256.
  returned: when the archive exists
  type: str
archive:
  description: What the archive holds.
  returned: when the archive passed the checks
  type: dict
  contains:
    members:
      description: Number of members.
      type: int
    files:
      description: Regular files.
      type: int
    dirs:
      description: Directories.
      type: int
    symlinks:
      description: Symbolic links.
      type: int
    hardlinks:
      description: Hard links.
      type: int
    size:
      description: Bytes of the regular files.
      type: int
offending:
  description: The members that would land outside O(dest), with the reason.
  returned: when the archive was refused
  type: list
  elements: str
  sample: ["../evil (path leaves the target (..))"]
cleaned:
  description: Whether O(dest) was emptied first (false in check mode and when nothing was removed).
  returned: when the archive passed the checks
  type: bool
bytes:
  description: Bytes of archive sent to the agent.
  returned: when the archive was extracted
  type: int
"""
