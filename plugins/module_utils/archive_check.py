# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Controller-side checks of a workspace archive before it is extracted in a sandbox.

`check_archive(path, target)` reads every member of a tar archive (any compression
tarfile opens with mode ``r:*``) and refuses the whole archive, naming every
offending member, when any member would land outside ``target`` once extracted
there: an absolute name, a ``..`` escape, a symbolic link whose target leaves
``target``, a hard link to something outside it, a member reached through a link
the same archive creates, or a device, FIFO or other special file. Nothing is
extracted here: the check is lexical, on the names alone, so it gives the same
answer whatever the controller's own file system holds.

`sha256_file(path)` is the lowercase hex sha256 of a file, read in chunks.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import hashlib
import posixpath
import tarfile

CHUNK = 1024 * 1024


class ArchiveRefused(Exception):
    """The archive holds members that would land outside the target (or cannot be read)."""

    def __init__(self, message, offending=None):
        super(ArchiveRefused, self).__init__(message)
        self.offending = list(offending or [])


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _inside(rel):
    """rel is a normalized path relative to the target: does it stay inside it?"""
    return rel != ".." and not rel.startswith("../") and not rel.startswith("/")


def member_problem(member, target, links):
    """Why this member would land outside target (None when it stays inside).

    target is the absolute guest directory the archive is extracted into; links is the set of
    normalized names of the links seen so far in the archive (updated here).
    """
    name = member.name
    if name.startswith("/"):
        return "absolute path"
    rel = posixpath.normpath(name)
    if not _inside(rel):
        return "path leaves the target (..)"
    parts = rel.split("/")
    for i in range(1, len(parts)):
        if "/".join(parts[:i]) in links:
            return "goes through the link %s in the same archive" % "/".join(parts[:i])
    if member.issym():
        links.add(rel)
        link = member.linkname
        if not link:
            return "symbolic link with an empty target"
        if link.startswith("/"):
            resolved = posixpath.normpath(link)
            root = posixpath.normpath(target)
            if not (resolved == root or resolved.startswith(root.rstrip("/") + "/")):
                return "symbolic link to %s, outside %s" % (link, root)
        elif not _inside(posixpath.normpath(posixpath.join(posixpath.dirname(rel), link))):
            return "symbolic link to %s leaves the target" % link
    elif member.islnk():
        links.add(rel)
        link = member.linkname
        if link.startswith("/") or not _inside(posixpath.normpath(link)):
            return "hard link to %s leaves the target" % link
    elif not (member.isreg() or member.isdir()):
        return "special file (device, FIFO or other) is not allowed"
    return None


def check_archive(path, target="/workspace", limit=20):
    """Read every member of the tar at path; -> a summary dict, or ArchiveRefused naming the offending members.

    The summary holds members (count), files, dirs, symlinks, hardlinks and size (bytes of regular files).
    """
    offending = []
    summary = {"members": 0, "files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0, "size": 0}
    links = set()
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                summary["members"] += 1
                problem = member_problem(member, target, links)
                if problem:
                    offending.append("%s (%s)" % (member.name, problem))
                    continue
                if member.issym():
                    summary["symlinks"] += 1
                elif member.islnk():
                    summary["hardlinks"] += 1
                elif member.isdir():
                    summary["dirs"] += 1
                else:
                    summary["files"] += 1
                    summary["size"] += member.size
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArchiveRefused("%s is not a readable tar archive: %s" % (path, e))
    if offending:
        shown = offending[:limit]
        more = len(offending) - len(shown)
        raise ArchiveRefused(
            "the archive %s would write outside %s, so nothing was extracted; offending member%s: %s%s"
            % (path, target, "s" if len(offending) > 1 else "", "; ".join(shown),
               " (and %d more)" % more if more else ""),
            offending)
    return summary
