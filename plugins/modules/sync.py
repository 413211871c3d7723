#!/usr/bin/python
# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
module: sync
short_description: Push a directory tree into a sandbox or pull one out, sending only what changed (like rsync)
version_added: 0.1.0
description:
  - Makes a directory in a sandbox match a directory on the controller (O(mode=push)), or a directory on the
    controller match one in a sandbox (O(mode=pull)), with the semantics of C(rsync -a) - only what changed is
    sent, modes, mtimes and symbolic links are kept, O(delete) removes what the source no longer has,
    O(exclude) and O(exclude_from) leave paths out.
  - A file is changed when its size or its mtime (whole seconds) differ, or with O(checksum) when its content
    differs. A directory whose mode or mtime differ is updated in place.
  - One run is a few commands in the guest (the guest's C(python3)) - one that streams the other side's
    manifest, and when something changed, one that applies the deletions and mode and mtime fixes (a push) or
    packs what is wanted (a pull) - and at most one archive with every change in it - C(Upload) with
    C(is_archive) for a push, C(Download) of an archive the guest packs for a pull - never a round trip per
    file. No command needs stdin while it runs, so with P(microvm.sandbox.agent#connection)'s C(transport=api)
    it works on the documented exec and file API alone, without the team's interactive stdin.
  - The archive is checked like M(microvm.sandbox.workspace_archive)'s before anything is written - every
    member must stay inside its target, or nothing is written - and extracted into a stage directory (the
    run's scratch dir in the sandbox, a hidden directory beside O(dest) on the controller). Each entry is then
    renamed into place on its own, so a connection cut in the middle leaves every file either as it was or
    as it should be, never half written. Destinations outside C(/workspace) work the same way.
  - No link is ever followed inside either tree - every path below the tree's root is opened from the root's
    directory fd with C(openat2) C(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS) where the kernel has it, one
    C(O_NOFOLLOW) component at a time where not - and links whose target may leave the tree are left out and
    reported in RV(left_out), with the rule of C(rsync --safe-links) since rsync 3.4 (CVE-2024-12088) - a link
    must be relative, with C(..) only as its leading components and no more of them than its depth, so
    C(d/../x) is left out even where it would land inside. The controller judges what a guest sends again,
    whatever the guest's side decided, and a pulled link that would lead out through links O(dest) already
    holds on disk (the user's own, say) refuses the whole pull before anything changes.
  - A guest path inside C(/workspace) that resolves outside it through a link is refused. The guest side
    resolves its paths one component at a time from held directory fds, so a guest user who swaps a directory
    for a link while a push or pull runs as root moves nothing outside the tree.
  - Set-user-ID and set-group-ID bits are dropped unless O(preserve_setid), and a pull never makes O(dest)
    itself world-writable.
  - Memory stays bounded whatever the size of the tree; manifests are compared as they stream, and the
    archive is written to and read from disk.
  - The sandbox's scratch dir is never synced nor deleted when it lies inside the guest tree.
  - This is an action plugin; it runs on the controller and needs the P(microvm.sandbox.agent#connection)
    connection. See docs/connection.md in the collection for when to use it instead of M(ansible.builtin.copy)
    and for its figures against C(rsync) over SSH.
author:
  - microvm.sandbox maintainers (@microvm)
options:
  mode:
    description:
      - V(push) makes O(dest) in the sandbox match O(src) on the controller; V(pull) makes O(dest) on the
        controller match O(src) in the sandbox.
    type: str
    choices: [push, pull]
    default: push
  src:
    description:
      - The source directory. Its contents are synced into O(dest), B(with or without a trailing slash) (always like
        rsync's C(src/ dest/); unlike rsync, C(src) without the slash does not create C(dest/src)).
      - On the controller (push), a relative path is looked up like M(ansible.builtin.copy)'s (the role's or
        playbook's C(files/), then the playbook's directory). In the sandbox (pull), a relative path is relative
        to C(/workspace); C(~) is the sandbox's home.
    type: str
    required: true
  dest:
    description:
      - The destination directory, created when missing (with its parents).
      - In the sandbox (push), relative to C(/workspace) when relative; on the controller (pull), relative to
        the playbook's directory.
    type: str
    required: true
  delete:
    description:
      - Remove entries of O(dest) that O(src) does not have. Excluded entries of O(dest) are never removed
        (and a directory holding one stays).
      - What the other side wrote into O(dest) goes too, on every run, for example the C(__pycache__) directories
        Python writes next to the sources it imports in the sandbox (rebuilt at the next import, at a cost). List
        them in O(exclude) (C(__pycache__/)) to keep them.
    type: bool
    default: false
  checksum:
    description:
      - Compare file contents (sha256 on both sides) instead of size and mtime, like C(rsync --checksum).
        Reads every file on both sides.
    type: bool
    default: false
  exclude:
    description:
      - Patterns of paths to leave out, on both sides, in C(.gitignore) syntax - C(name) matches at any depth,
        a leading or inner C(/) anchors the pattern at the tree's root, a trailing C(/) matches directories only,
        C(*) and C(?) stay within a name, C(**) crosses directories, C(!pattern) includes again; the last pattern
        that matches decides. rsync's C(- pattern) and C(+ pattern) work too.
      - An excluded directory is left out with everything in it.
      - With O(delete), exclude what the destination makes for itself, such as C(__pycache__/) or
        C(.pytest_cache/), or O(delete) removes it on every push.
    type: list
    elements: str
    default: []
  exclude_from:
    description:
      - Controller files of patterns in the same syntax, one per line (blank lines and C(#) comments ignored),
        for example the tree's own C(.gitignore). Read after O(exclude).
    type: list
    elements: path
    default: []
  preserve_setid:
    description:
      - Keep set-user-ID and set-group-ID bits (mode C(04000) and C(02000)) on what is synced. Off by default -
        like rsync without C(--perms), the special bits are dropped, on both ends - so a guest's C(chmod 4755)
        copy of a shell, pulled by root, gives no local user root. The other permission bits are kept, as with
        C(rsync --perms), and a mode that differs only by those bits is not a change.
      - Whatever this says, a pull never makes O(dest) itself world-writable (the C(o+w) bit of the source's
        root directory is dropped); entries below O(dest) keep their modes.
    type: bool
    default: false
  list_limit:
    description:
      - How many paths of each kind (added, updated, deleted, left out) the result and the diff list; the counts
        in RV(counts) are always complete.
    type: int
    default: 1000
attributes:
  check_mode:
    description: Reads both trees and reports what would change, without changing anything.
    support: full
  diff_mode:
    description: Lists the paths that are (or would be) added (C(+)), updated (C(~)) and deleted (C(-)).
    support: full
  platform:
    description: Runs on the controller; the sandbox needs C(python3).
    support: full
    platforms: posix
notes:
  - Ownership is not synced; files belong to the agent's user in the sandbox and to the controller user locally.
  - Hard links are copied as separate files; sockets, FIFOs and devices are left out (see RV(left_out)).
  - mtimes are compared and kept to the second.
seealso:
  - module: microvm.sandbox.workspace_archive
  - module: ansible.builtin.copy
"""

EXAMPLES = r"""
- name: Push the source tree, removing what was deleted locally and leaving build output out
  microvm.sandbox.sync:
    src: "{{ playbook_dir }}/src"
    dest: /workspace/src
    delete: true
    exclude: [__pycache__/, "*.pyc", /build/]

- name: Honour the project's .gitignore
  microvm.sandbox.sync:
    src: "{{ playbook_dir }}/project"
    dest: /workspace/project
    exclude_from: ["{{ playbook_dir }}/project/.gitignore"]
    exclude: [.git/]

- name: Bring the results out
  microvm.sandbox.sync:
    mode: pull
    src: /workspace/results
    dest: "{{ playbook_dir }}/out/results"
  register: results

- name: What would change, without changing it
  microvm.sandbox.sync:
    src: "{{ playbook_dir }}/src"
    dest: /workspace/src
    delete: true
  check_mode: true
  diff: true
"""

RETURN = r"""
changed:
  description: Whether anything was (or, in check mode, would be) added, updated or deleted.
  returned: always
  type: bool
src:
  description: The source directory, as resolved.
  returned: always
  type: str
  sample: /home/me/project/src
dest:
  description: The destination directory, as resolved.
  returned: always
  type: str
  sample: /workspace/src
mode:
  description: V(push) or V(pull).
  returned: always
  type: str
added:
  description: Paths (relative to O(dest)) that were created, in order; at most O(list_limit).
  returned: always
  type: list
  elements: str
  sample: [lib, lib/util.py]
updated:
  description: Paths whose content, type, mode or mtime was changed; at most O(list_limit).
  returned: always
  type: list
  elements: str
deleted:
  description: Paths that were removed (a removed directory is listed alone); at most O(list_limit).
  returned: always
  type: list
  elements: str
left_out:
  description: Source paths left out - links whose target leaves the tree, special files; at most O(list_limit).
  returned: always
  type: list
  elements: str
counts:
  description: How many paths were added, updated, deleted and left out.
  returned: always
  type: dict
  sample: {added: 2, updated: 0, deleted: 1, left_out: 0}
bytes:
  description: Bytes of file content sent (or, in check mode, that would be sent).
  returned: always
  type: int
applied:
  description: What the guest did for a push - entries moved into place, deletions and fixes.
  returned: when a push changed something
  type: dict
  sample: {moved: 2, deleted: 1, fixed: 3}
"""
