# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Controller-side checks of a workspace archive before it is extracted in a sandbox.

`check_archive(path, target)` reads every member of a tar archive (any compression
tarfile opens with mode ``r:*``) and refuses the whole archive, naming every
offending member, when any member would land outside ``target`` once extracted
there: an absolute name, a ``..`` escape, a symbolic link whose target leaves
``target``, a hard link to something outside it, a member reached through a link
the same archive creates, or a device, FIFO or other special file. Symbolic
link targets are resolved through the archive's own links (``d -> .`` then
``e -> d/d/d/../..`` leaves the target), once when each link is read and once
more with every link of the archive. Nothing is extracted here: the check is
symbolic, on the names alone, so it gives the same answer whatever the
controller's own file system holds.

`sha256_file(path)` is the lowercase hex sha256 of a file, read in chunks.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import hashlib
import posixpath
import tarfile
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing only: module_utils stay free of what older targets' typing may lack
    from typing import Protocol

    class LinkLookup(Protocol):
        """Normalized name -> the target of the symbolic link there, or None: a dict, or a view of a tree on disk."""

        def get(self, name: str, /) -> str | None: ...

CHUNK = 1024 * 1024
MAX_LINKS = 40  # symbolic links followed in one resolution, as Linux does
NAME_MAX, PATH_MAX = 255, 4096  # bytes; the guest agent refuses longer names and paths


class ArchiveRefused(Exception):
    """The archive holds members that would land outside the target (or cannot be read)."""

    def __init__(self, message: str, offending: list[str] | None = None) -> None:
        super(ArchiveRefused, self).__init__(message)
        self.offending = list(offending or [])


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _inside(rel: str) -> bool:
    """rel is a normalized path relative to the target: does it stay inside it?"""
    return rel != ".." and not rel.startswith("../") and not rel.startswith("/")


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def resolve_link(link_dir: list[str], link: str, symlinks: LinkLookup, root: list[str]) -> list[str] | str:
    """Where a symbolic link of the archive leads, following the archive's own links.

    link_dir is the link's directory (list of names relative to the target), symlinks maps the normalized names of
    the archive's symbolic links to their targets, root is the target's list of names. Returns the list of names
    relative to the target, or a string saying why the link leaves the target (the controller knows nothing outside
    it, so leaving it even for a moment is refused).
    """
    stack = list(link_dir)
    todo: deque[str] = deque()
    hops = 0
    text = link
    while True:
        if text.startswith("/"):
            parts = text.split("/")
            names = _parts(text)
            if ".." in parts[:len(root) + 1] or names[:len(root)] != root:
                return "symbolic link to %s, outside /%s" % (link, "/".join(root))
            stack = []
            todo.extendleft(reversed(names[len(root):]))
        else:
            todo.extendleft(reversed(text.split("/")))
        followed: str | None = None
        while todo:
            part = todo.popleft()
            if part in ("", "."):
                continue
            if part == "..":
                if not stack:
                    return "symbolic link to %s leaves the target" % link
                stack.pop()
                continue
            stack.append(part)
            target = symlinks.get("/".join(stack))
            if target is not None:
                hops += 1
                if hops > MAX_LINKS:
                    return "symbolic link to %s is a loop of links" % link
                stack.pop()
                followed = target
                break
        if followed is None:
            return stack
        text = followed


def _too_long(target: str, rel: str) -> str | None:
    longest = max(len(part.encode("utf-8", "surrogateescape")) for part in rel.split("/"))
    if longest > NAME_MAX:
        return "a name of %d bytes, longer than the file system allows (NAME_MAX %d)" % (longest, NAME_MAX)
    size = len((target.rstrip("/") + "/" + rel).encode("utf-8", "surrogateescape"))
    if size >= PATH_MAX:
        return "a path of %d bytes once extracted, longer than the file system allows (PATH_MAX %d)" % (size, PATH_MAX)
    return None


def link_problem(rel: str, link: str, symlinks: LinkLookup, target: str) -> str | None:
    """Why the symbolic link rel -> link leaves the target (None when it stays inside)."""
    if not link:
        return "symbolic link with an empty target"
    where = resolve_link(rel.split("/")[:-1], link, symlinks, _parts(posixpath.normpath(target)))
    return where if isinstance(where, str) else None


def member_problem(member: tarfile.TarInfo, target: str, links: set[str], symlinks: dict[str, str] | None = None) -> str | None:
    """Why this member would land outside target (None when it stays inside).

    target is the absolute guest directory the archive is extracted into; links is the set of
    normalized names of the links seen so far in the archive, symlinks maps the symbolic ones to their
    targets (both updated here).
    """
    symlinks = {} if symlinks is None else symlinks
    name = member.name
    if name.startswith("/"):
        return "absolute path"
    rel = posixpath.normpath(name)
    if not _inside(rel):
        return "path leaves the target (..)"
    too_long = _too_long(target, rel)
    if too_long:
        return too_long
    parts = rel.split("/")
    for i in range(1, len(parts)):
        if "/".join(parts[:i]) in links:
            return "goes through the link %s in the same archive" % "/".join(parts[:i])
    if member.issym():
        links.add(rel)
        symlinks[rel] = member.linkname
        return link_problem(rel, member.linkname, symlinks, target)
    elif member.islnk():
        links.add(rel)
        link = member.linkname
        if link.startswith("/") or not _inside(posixpath.normpath(link)):
            return "hard link to %s leaves the target" % link
    elif not (member.isreg() or member.isdir()):
        return "special file (device, FIFO or other) is not allowed"
    return None


def check_archive(path: str, target: str = "/workspace", limit: int = 20) -> dict[str, Any]:
    """Read every member of the tar at path; -> a summary dict, or ArchiveRefused naming the offending members.

    The summary holds members (count), files, dirs, symlinks, hardlinks and size (bytes of regular files).
    """
    offending = []
    summary = {"members": 0, "files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0, "size": 0}
    links: set[str] = set()
    symlinks: dict[str, str] = {}
    flagged = set()
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in iter(tar.next, None):
                tar.members = []  # type: ignore[attr-defined]  # tarfile keeps every header it read: memory would grow with the archive
                summary["members"] += 1
                problem = member_problem(member, target, links, symlinks)
                if problem:
                    offending.append("%s (%s)" % (member.name, problem))
                    flagged.add(posixpath.normpath(member.name))
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
        raise ArchiveRefused("%s is not a readable tar archive: %s" % (path, e)) from e
    # A later link can change where an earlier one leads: every link once more, with all of them.
    for rel, link in symlinks.items():
        problem = link_problem(rel, link, symlinks, target)
        if problem and rel not in flagged:
            offending.append("%s (%s)" % (rel, problem))
    if offending:
        shown = offending[:limit]
        more = len(offending) - len(shown)
        raise ArchiveRefused(
            "the archive %s would write outside %s, so nothing was extracted; offending member%s: %s%s"
            % (path, target, "s" if len(offending) > 1 else "", "; ".join(shown),
               " (and %d more)" % more if more else ""),
            offending)
    return summary
