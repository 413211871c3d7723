# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Directory trees for microvm.sandbox.sync, on both ends: walked, described, changed; never followed out.

This one file is used twice: the controller imports it, and its source is run in the guest with the
guest's python3 (`python3 -c <this file> <json>`), so it is stdlib only and self-contained.

- `Excludes`: gitignore-style patterns (and rsync's `- ` / `+ ` prefixes), pruning whole directories.
- `walk()`: a tree as manifest entries, in one canonical order on both ends (pre-order, names sorted
  bytewise at each level), produced one directory at a time: memory grows with the width of a
  directory, never with the size of the tree. Every directory is opened relative to its parent's fd
  with O_NOFOLLOW, so a link inside the tree is described as a link and never entered.
- Manifest records: `path \\0 kind+"mode size mtime" \\0 extra \\0` (extra: a link's target or a
  file's sha256), streamed and parsed in chunks.
- `open_beneath()`: a path below a directory fd, no link followed on the way or at the end (openat2 with
  RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS through ctypes where the kernel has it, one O_NOFOLLOW openat per
  component where not); `open_root()`: the root the user named, resolved one held fd per component (links of
  that path followed like rsync, never out of the workspace), so a check and the open are one.
- `link_is_safe()` (rsync 3.4's --safe-links rule) and `source_entries()`: what a receiver accepts of the
  sender's manifest, judged by the receiver whatever the sender decided; set-id bits dropped unless asked.
- `apply_stage()` moves a staged tree into place one entry at a time with rename(2) (atomic per
  file: a cut leaves each file old or new), and `run_ops()` does the deletions and the
  directory/mode/mtime fixes, in the order the plan wrote them.
- `guest_main()`: one step of a sync run in the guest, a command of its own with one-shot stdin (see
  plugins/action/sync.py).
"""

import errno
import hashlib
import json
import os
import re
import stat
import sys

from typing import TYPE_CHECKING, BinaryIO, Callable, Iterable, Iterator, List, Optional, Pattern, Tuple  # noqa: F401 (in annotation strings)

if TYPE_CHECKING:
    import tarfile  # imported where used at run time: most runs write no archive

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
HASH_CHUNK = 1024 * 1024
ROOT = b"."
END = b""               # the empty path ends the manifest
KIND_FILE, KIND_DIR, KIND_LINK, KIND_SKIPPED = b"f", b"d", b"l", b"x"
PLAIN_MODES = (0o644, 0o755)  # what every tar extractor keeps as it is; other modes get an explicit fix
SETID_MASK = 0o1777  # permission bits without set-user-ID and set-group-ID
MAX_LINKS = 40  # symbolic links followed in one resolution, as Linux does


class SyncError(Exception):
    """A refusal or failure with a message for the user."""


# ------------------------------------------------------------------ excludes

def glob_regex(pattern: str) -> str:
    """A gitignore glob as a regex: * and ? stay within a name, ** crosses directories, [...] is a class."""
    out = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern[i:i + 2] == "**":
                if pattern[i + 2:i + 3] == "/":
                    out.append("(?:.*/)?")
                    i += 3
                    continue
                out.append(".*")
                i += 2
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            j = pattern.find("]", j)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j + 1
                continue
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


class Excludes:
    """Ordered exclude rules; the last rule that matches a path decides (gitignore).

    `name` matches that name at any depth; a leading or inner `/` anchors the pattern at the root of
    the tree; a trailing `/` matches directories only; `!` (or rsync's `+ `) re-includes; `- ` is
    rsync's spelling of a plain exclude. An excluded directory is pruned with everything in it.
    """

    def __init__(self, patterns: "Iterable[str]" = ()) -> None:
        self.rules: "List[Tuple[bool, bool, bool, Pattern[str]]]" = []
        for raw in patterns:
            self.add(raw)

    def add(self, raw: str) -> None:
        pattern = raw.rstrip("\n").rstrip("\r")
        if not pattern.strip() or pattern.startswith("#"):
            return
        if pattern.endswith(" ") and not pattern.endswith("\\ "):
            pattern = pattern.rstrip(" ")
        negate = False
        if pattern.startswith("+ "):
            negate, pattern = True, pattern[2:]
        elif pattern.startswith("- "):
            pattern = pattern[2:]
        elif pattern.startswith("!"):
            negate, pattern = True, pattern[1:]
        elif pattern.startswith("\\!") or pattern.startswith("\\#"):
            pattern = pattern[1:]
        dir_only = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        if not pattern:
            return
        anchored = "/" in pattern
        pattern = pattern.lstrip("/")
        if pattern.startswith("**/"):
            anchored = True  # "**/x" is x at any depth, written as an anchored pattern
        self.rules.append((negate, dir_only, anchored, re.compile(glob_regex(pattern), re.S)))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def excluded(self, rel: str, is_dir: bool) -> bool:
        """rel: the path relative to the tree's root (str, '/'-separated)."""
        result = False
        base = rel.rsplit("/", 1)[-1]
        for negate, dir_only, anchored, rx in self.rules:
            if dir_only and not is_dir:
                continue
            if rx.fullmatch(rel if anchored else base):
                result = not negate
        return result


def read_patterns(path: str) -> "List[str]":
    with open(path, "r", encoding="utf-8", errors="surrogateescape") as f:
        return list(f)


# ------------------------------------------------------------------ entries and records

class Entry:
    __slots__ = ("path", "kind", "mode", "size", "mtime", "extra")

    def __init__(self, path: bytes, kind: bytes, mode: int, size: int, mtime: int, extra: bytes = b"") -> None:
        self.path = path      # bytes, relative, '/'-separated; ROOT for the root
        self.kind = kind      # KIND_*
        self.mode = mode      # permission bits
        self.size = size
        self.mtime = mtime    # whole seconds, the resolution every tar and filesystem keeps
        self.extra = extra    # a link's target, or a file's sha256 (hex, bytes) when checksums are asked for

    def key(self) -> "Tuple[bytes, ...]":
        return sort_key(self.path)

    def encode(self) -> bytes:
        return b"%s\0%s%o %d %d\0%s\0" % (self.path, self.kind, self.mode, self.size, self.mtime, self.extra)

    def __repr__(self) -> str:
        return "Entry(%r, %r, %o, %d, %d, %r)" % (self.path, self.kind, self.mode, self.size, self.mtime, self.extra)


def sort_key(path: bytes) -> "Tuple[bytes, ...]":
    """The canonical order: a directory right before its contents, names compared as bytes."""
    return () if path == ROOT else tuple(path.split(b"/"))


def parse_meta(path: bytes, meta: bytes, extra: bytes) -> Entry:
    kind = meta[:1]
    try:
        mode, size, mtime = meta[1:].split(b" ")
        return Entry(path, kind, int(mode, 8), int(size), int(mtime), extra)
    except ValueError as e:
        raise SyncError("a malformed manifest record for %r" % rel_text(path)[:200]) from e


# ------------------------------------------------------------------ walking

def rel_text(path: bytes) -> str:
    return path.decode("utf-8", "surrogateescape")


def link_is_safe(rel: bytes, target: bytes) -> bool:
    """A link that stays inside the tree, judged on its text alone (rsync's --safe-links, as rsync 3.4 made it).

    Relative, and `..` only as leading components, no more of them than the link's depth: `d/../../x` is
    refused even where it would land inside, because `d` may be (or become) a link on either end
    (CVE-2024-12088: `d -> .` then `logs -> d/d/d/../../../x` climbs out through the receiver's own tree).
    With every link of a tree so, no chain of them leaves it.
    """
    if not target or target.startswith(b"/"):
        return False
    parent = rel.rsplit(b"/", 1)[0] if b"/" in rel else b""
    depth = len([p for p in parent.split(b"/") if p])
    named = False
    for part in target.split(b"/"):
        if part == b"..":
            depth -= 1
            if depth < 0 or named:
                return False
        elif part and part != b".":
            named = True
    return True


def source_entries(entries: "Iterable[Entry]", keep_setid: bool = False, private_root: bool = False) -> "Iterator[Entry]":
    """The source side's manifest as the receiver may apply it (every entry the guest sends passes here).

    The root first, then plain relative paths in canonical order (else SyncError); links that fail
    link_is_safe() become KIND_SKIPPED (left out), whoever walked the tree; set-id bits are dropped unless
    keep_setid; with private_root, the root directory never becomes world-writable.
    """
    mask = 0o7777 if keep_setid else SETID_MASK
    last = None
    for entry in entries:
        key = entry.key()
        if (last is None) != (entry.path == ROOT) or (last is not None and key <= last) or \
                entry.kind not in (KIND_FILE, KIND_DIR, KIND_LINK, KIND_SKIPPED):
            raise SyncError("refused the manifest at %r: not a plain path in order" % rel_text(entry.path)[:200])
        if entry.path != ROOT:
            split_rel(entry.path)
        last = key
        if entry.kind == KIND_LINK and not link_is_safe(entry.path, entry.extra):
            entry = Entry(entry.path, KIND_SKIPPED, 0, 0, 0, entry.extra)
        elif entry.kind in (KIND_FILE, KIND_DIR):
            entry.mode &= mask
            if private_root and entry.path == ROOT:
                entry.mode &= ~0o002
        yield entry


def file_digest(dir_fd: int, name: bytes) -> bytes:
    fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    try:
        digest = hashlib.sha256()
        while True:
            data = os.read(fd, HASH_CHUNK)
            if not data:
                return digest.hexdigest().encode()
            digest.update(data)
    finally:
        os.close(fd)


def entry_of(dir_fd: int, name: bytes, rel: bytes, st: os.stat_result, checksum: bool) -> "Optional[Entry]":
    mode = stat.S_IMODE(st.st_mode)
    mtime = int(st.st_mtime)
    if stat.S_ISREG(st.st_mode):
        return Entry(rel, KIND_FILE, mode, st.st_size, mtime, file_digest(dir_fd, name) if checksum else b"")
    if stat.S_ISDIR(st.st_mode):
        return Entry(rel, KIND_DIR, mode, 0, mtime)
    if stat.S_ISLNK(st.st_mode):
        return Entry(rel, KIND_LINK, 0o777, 0, mtime, os.readlink(name, dir_fd=dir_fd))
    return None


def walk(root_fd: int, excludes: "Optional[Excludes]" = None, checksum: bool = False,
         skip_unsafe_links: bool = False) -> "Iterator[Entry]":
    """Entries of the tree under root_fd, the root first, in canonical order.

    Special files (sockets, FIFOs, devices) and, with skip_unsafe_links, links that leave the tree
    come out as KIND_SKIPPED entries, so the other end can say what was left out.
    """
    st = os.fstat(root_fd)
    yield Entry(ROOT, KIND_DIR, stat.S_IMODE(st.st_mode), 0, int(st.st_mtime))
    yield from _walk_dir(root_fd, b"", excludes, checksum, skip_unsafe_links)


def _walk_dir(dir_fd: int, prefix: bytes, excludes: "Optional[Excludes]", checksum: bool, skip_unsafe_links: bool) -> "Iterator[Entry]":
    with os.scandir(dir_fd) as it:
        names = sorted(os.fsencode(e.name) for e in it)
    for name in names:
        rel = prefix + name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # vanished while walking
        is_dir = stat.S_ISDIR(st.st_mode)
        if excludes and excludes.excluded(rel_text(rel), is_dir):
            continue
        try:
            entry = entry_of(dir_fd, name, rel, st, checksum)
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # replaced by a link or a FIFO meanwhile
                continue
            raise
        if entry is None or (skip_unsafe_links and entry.kind == KIND_LINK and not link_is_safe(rel, entry.extra)):
            yield Entry(rel, KIND_SKIPPED, 0, 0, 0, entry.extra if entry is not None else b"special file")
            continue
        yield entry
        if is_dir:
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    continue
                raise
            try:
                yield from _walk_dir(sub, rel + b"/", excludes, checksum, skip_unsafe_links)
            finally:
                os.close(sub)


# ------------------------------------------------------------------ opening paths without following links

# openat2(2) (Linux 5.6): one call that walks a relative path below a directory fd and refuses every link on the
# way. Its number is the same on every architecture (calls from 424 on share one table).
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x02, 0x04, 0x08
BENEATH = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_openat2: "List[Optional[Callable[..., int]]]" = []  # [] until probed, then [function or None]


def _load_openat2() -> "Optional[Callable[..., int]]":
    """openat2 through ctypes, or None where the python (no ctypes), a filter (EPERM) or the kernel (ENOSYS) has none."""
    try:
        import ctypes
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (ImportError, OSError, AttributeError):
        return None

    class OpenHow(ctypes.Structure):
        _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

    syscall.restype = ctypes.c_long

    def openat2(dir_fd: int, path: bytes, flags: int, mode: int, resolve: int) -> int:
        how = OpenHow(flags, mode if flags & os.O_CREAT else 0, resolve)
        fd = syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(path), ctypes.byref(how),
                     ctypes.c_size_t(ctypes.sizeof(how)))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), os.fsdecode(path))
        return fd

    try:
        probe = os.open(".", DIR_FLAGS)
        try:
            os.close(openat2(probe, b".", DIR_FLAGS, 0, BENEATH))
        finally:
            os.close(probe)
    except OSError:
        return None
    return openat2


def use_openat2(enabled: "bool | None" = None) -> bool:
    """Whether paths below a directory fd are opened with openat2; enabled=False forces the per-component walk
    (tests run both), True or None probes the kernel again."""
    del _openat2[:]
    _openat2.append(_load_openat2() if enabled is not False else None)
    return _openat2[0] is not None


def open_beneath(dir_fd: int, rel: bytes, flags: int, mode: int = 0) -> int:
    """Open dir_fd/rel (bytes, a plain relative path) without following any link, on the way or at the end.

    openat2 with RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS where the kernel has it, else one O_NOFOLLOW openat per
    component from held fds: either way a link anywhere is ELOOP/ENOTDIR, never followed.
    """
    if not _openat2:
        use_openat2()
    fn = _openat2[0]
    if fn is not None:
        for _attempt in range(16):
            try:
                return fn(dir_fd, rel, flags | os.O_NOFOLLOW, mode, BENEATH)
            except OSError as e:
                if e.errno != errno.EAGAIN:  # EAGAIN: a rename raced the walk; the kernel asks for a retry
                    raise
    parts = rel.split(b"/")
    parent = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, DIR_FLAGS, dir_fd=parent)
            os.close(parent)
            parent = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW, mode, dir_fd=parent)
    finally:
        os.close(parent)


def open_dir_at(root_fd: int, parts: "list[bytes]") -> int:
    """The fd of the directory root/parts[0]/..., no link followed on the way (open_beneath)."""
    if not parts:
        return os.dup(root_fd)
    return open_beneath(root_fd, b"/".join(parts), DIR_FLAGS)


def split_rel(rel: bytes) -> "Tuple[List[bytes], bytes]":
    parts = rel.split(b"/")
    if rel.startswith(b"/") or any(p in (b"", b".", b"..") for p in parts):
        raise SyncError("refused path %r: not a plain relative path" % rel_text(rel))
    return parts[:-1], parts[-1]


def open_root(path: "str | bytes", create: bool = False, workspace: "str | None" = None) -> "int | None":
    """Open the tree's root directory, following the links of the path the user named (like rsync); -> fd or None.

    Resolved here one component at a time from held directory fds (each opened with O_NOFOLLOW, each link read
    and expanded by this code, `..` going back to the fd held for the parent), so the directory checked is the
    directory opened: swapping a directory for a link meanwhile changes nothing. With workspace set, a root named
    inside it must stay inside it at every step: a link that leads out is refused, never followed, and nothing is
    created outside. With create, missing directories are made (mode 0777 less the umask, like mkdir -p).
    """
    path = os.fsencode(path)
    text = rel_text(path)
    bound = None
    if workspace and within(os.path.normpath(text), workspace.rstrip("/")):
        bound = [p for p in os.fsencode(workspace).split(b"/") if p]
    fds = [os.open(b"/", DIR_FLAGS)]
    names: "List[bytes]" = []
    todo = list(reversed(path.split(b"/")))
    links = made = retries = 0
    try:
        while todo:
            part = todo.pop()
            if part in (b"", b"."):
                continue
            if part == b"..":
                if len(fds) > 1:
                    os.close(fds.pop())
                    names.pop()
                continue
            here = names + [part]
            if bound is not None and here[:len(bound)] != bound and bound[:len(here)] != here:
                where = os.path.normpath("/" + rel_text(b"/".join(here + list(reversed(todo)))))
                raise SyncError("%s resolves to %s through a link, outside %s: refused (name the real path "
                                "if you mean it)" % (text, where, workspace))
            try:
                fd = os.open(part, DIR_FLAGS, dir_fd=fds[-1])
            except FileNotFoundError as e:
                if not create:
                    return None
                if bound is not None and here[:len(bound)] != bound or made > 4096:
                    raise SyncError("%s: cannot create %s" % (text, rel_text(b"/" + b"/".join(here)))) from e
                try:
                    os.mkdir(part, 0o777, dir_fd=fds[-1])
                except FileExistsError:
                    pass  # made meanwhile: opened below like anything else found there
                made += 1
                todo.append(part)
                continue
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                try:
                    target = os.readlink(part, dir_fd=fds[-1])
                except OSError as e2:
                    retries += 1
                    if e2.errno not in (errno.ENOENT, errno.EINVAL) or retries > 100:
                        raise SyncError("%s is not a directory" % text) from e2
                    todo.append(part)  # changed since the open (a link again a directory): look again
                    continue
                links += 1
                if links > MAX_LINKS:
                    raise SyncError("%s: too many levels of symbolic links" % text) from e
                if target.startswith(b"/"):
                    while len(fds) > 1:
                        os.close(fds.pop())
                    del names[:]
                todo.extend(reversed(target.split(b"/")))
                continue
            fds.append(fd)
            names.append(part)
        if bound is not None and names[:len(bound)] != bound:
            raise SyncError("%s resolves to /%s, outside %s: refused" % (text, rel_text(b"/".join(names)), workspace))
        return os.dup(fds[-1])
    finally:
        for fd in fds:
            os.close(fd)


def within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# ------------------------------------------------------------------ changing a tree

def remove_entry(dir_fd: int, name: bytes, rel: bytes, excludes: "Optional[Excludes]" = None) -> bool:
    """Remove dir_fd/name; a directory goes depth first, never through a link; excluded entries stay.

    -> False when something excluded was kept (so the directory stays too).
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return True
    sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    empty = True
    try:
        with os.scandir(sub) as it:
            names = [os.fsencode(e.name) for e in it]
        for child in names:
            child_rel = rel + b"/" + child
            if excludes:
                try:
                    cst = os.stat(child, dir_fd=sub, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if excludes.excluded(rel_text(child_rel), stat.S_ISDIR(cst.st_mode)):
                    empty = False
                    continue
            empty = remove_entry(sub, child, child_rel, excludes) and empty
    finally:
        os.close(sub)
    if not empty:
        return False
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def copy_entry(src_fd: int, name: bytes, dst_fd: int, dst_name: bytes) -> None:
    """Copy src_fd/name to dst_fd/dst_name (across filesystems), with modes and mtimes."""
    st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=src_fd), dst_name, dir_fd=dst_fd)
        return
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(dst_name, 0o700, dir_fd=dst_fd)
        sub_src = os.open(name, DIR_FLAGS, dir_fd=src_fd)
        sub_dst = os.open(dst_name, DIR_FLAGS, dir_fd=dst_fd)
        try:
            with os.scandir(sub_src) as it:
                names = [os.fsencode(e.name) for e in it]
            for child in names:
                copy_entry(sub_src, child, sub_dst, child)
            set_attrs(sub_dst, stat.S_IMODE(st.st_mode), int(st.st_mtime))
        finally:
            os.close(sub_src)
            os.close(sub_dst)
        return
    fin = os.open(name, READ_FLAGS, dir_fd=src_fd)
    try:
        fout = os.open(dst_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dst_fd)
        try:
            while True:
                data = os.read(fin, HASH_CHUNK)
                if not data:
                    break
                os.write(fout, data)
            set_attrs(fout, stat.S_IMODE(st.st_mode), int(st.st_mtime))
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def move_into(src_fd: int, name: bytes, dst_fd: int) -> None:
    """rename(2) src_fd/name over dst_fd/name: atomic. Across filesystems: copy beside it, then rename."""
    try:
        os.rename(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        return
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    tmp = b".~sync." + os.urandom(4).hex().encode() + b"." + name[:100]
    try:
        copy_entry(src_fd, name, dst_fd, tmp)
        os.rename(tmp, name, src_dir_fd=dst_fd, dst_dir_fd=dst_fd)
    except BaseException:
        remove_entry(dst_fd, tmp, tmp)
        raise


def chown_entry(dir_fd: int, name: bytes, owner: "Tuple[int, int]") -> None:
    """Give dir_fd/name, and everything in it for a directory, to owner (uid, gid); links themselves."""
    os.chown(name, owner[0], owner[1], dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        return
    sub = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        with os.scandir(sub) as it:
            names = [os.fsencode(e.name) for e in it]
        for child in names:
            chown_entry(sub, child, owner)
    finally:
        os.close(sub)


def apply_stage(stage_fd: int, dest_fd: int, rel: bytes = b"", owner: "Optional[Tuple[int, int]]" = None) -> int:
    """Move every entry of the staged tree into the destination tree; -> number of entries moved.

    A staged directory whose counterpart is a directory is entered; any other entry replaces its
    counterpart in one rename (a directory that becomes a file is removed first). With owner
    (uid, gid), what is moved in is handed to that user first.
    """
    moved = 0
    with os.scandir(stage_fd) as it:
        names = sorted(os.fsencode(e.name) for e in it)
    for name in names:
        st = os.stat(name, dir_fd=stage_fd, follow_symlinks=False)
        try:
            dst = os.stat(name, dir_fd=dest_fd, follow_symlinks=False)
        except FileNotFoundError:
            dst = None
        if stat.S_ISDIR(st.st_mode) and dst is not None and stat.S_ISDIR(dst.st_mode):
            sub_stage = os.open(name, DIR_FLAGS, dir_fd=stage_fd)
            try:
                sub_dest = os.open(name, DIR_FLAGS, dir_fd=dest_fd)
                try:
                    moved += apply_stage(sub_stage, sub_dest, rel + name + b"/", owner)
                finally:
                    os.close(sub_dest)
            finally:
                os.close(sub_stage)
            continue
        if dst is not None and (stat.S_ISDIR(dst.st_mode) != stat.S_ISDIR(st.st_mode)):
            remove_entry(dest_fd, name, rel + name)  # a type change replaces the whole entry
        move_into(stage_fd, name, dest_fd)
        if owner:
            chown_entry(dest_fd, name, owner)  # after the move: a copy across filesystems makes new files
        moved += 1
    return moved


def set_attrs(fd_or_dir: int, mode: int, mtime: int, name: "Optional[bytes]" = None) -> None:
    """Mode and mtime of an open fd, or of dir_fd/name (never through a link)."""
    if name is None:
        os.fchmod(fd_or_dir, mode)
        os.utime(fd_or_dir, ns=(mtime * 10 ** 9, mtime * 10 ** 9))
        return
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=fd_or_dir)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return  # a link: links carry no mode of their own
        if e.errno != errno.EACCES:
            raise
        # unreadable to a non-root owner (mode 000): an O_PATH fd of that very entry (never a link's target), changed
        # through its /proc/self/fd name, which names the inode the fd holds, not a path to look up again
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=fd_or_dir)
        try:
            if not stat.S_ISLNK(os.fstat(fd).st_mode):
                os.chmod("/proc/self/fd/%d" % fd, mode)
                os.utime("/proc/self/fd/%d" % fd, ns=(mtime * 10 ** 9, mtime * 10 ** 9))
        finally:
            os.close(fd)
        return
    try:
        set_attrs(fd, mode, mtime)
    finally:
        os.close(fd)


def op_delete(rel: bytes) -> bytes:
    return b"-" + rel + b"\0"


def op_attrs(rel: bytes, mode: int, mtime: int) -> bytes:
    return b"=%o %d %s\0" % (mode, mtime, rel)


def run_ops(root_fd: int, records: "Iterable[bytes]", excludes: "Optional[Excludes]" = None) -> "Tuple[int, int]":
    """Do the plan's deletions and attribute fixes, in order; -> (deleted, fixed)."""
    deleted = fixed = 0
    for record in records:
        op, body = record[:1], record[1:]
        if op == b"-":
            parents, name = split_rel(body)
            try:
                fd = open_dir_at(root_fd, parents)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                remove_entry(fd, name, body, excludes)
            finally:
                os.close(fd)
            deleted += 1
        elif op == b"=":
            mode, mtime, rel = body.split(b" ", 2)
            if rel == ROOT:
                set_attrs(root_fd, int(mode, 8), int(mtime))
            else:
                parents, name = split_rel(rel)
                try:
                    fd = open_dir_at(root_fd, parents)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    set_attrs(fd, int(mode, 8), int(mtime), name)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(fd)
            fixed += 1
        elif op:
            raise SyncError("unknown operation %r" % op)
    return deleted, fixed


def split_stream(chunks: "Iterable[bytes]") -> "Iterator[bytes]":
    """NUL-terminated records from bytes chunks."""
    tail = b""
    for chunk in chunks:
        parts = (tail + chunk).split(b"\0")
        tail = parts.pop()
        yield from parts
    if tail:
        raise SyncError("the operation stream ended in the middle of a record")


# ------------------------------------------------------------------ archives of selected entries (pull)

def tar_selected(root_fd: int, paths: "Iterable[bytes]", out: BinaryIO) -> int:
    """Write a tar stream of the given entries (each alone, not recursively) to the file out; -> members."""
    import tarfile
    count = 0
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tar:
        for rel in paths:
            parents, name = split_rel(rel)
            try:
                dir_fd = open_dir_at(root_fd, parents)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                if add_member(tar, dir_fd, name, rel):
                    count += 1
            finally:
                os.close(dir_fd)
            tar.members = []  # type: ignore[attr-defined]  # tarfile keeps every header it wrote: memory would grow with the archive
    return count


def add_member(tar: "tarfile.TarFile", dir_fd: int, name: bytes, rel: bytes) -> bool:
    """Add dir_fd/name as the member rel; False when it vanished or is no longer a plain entry."""
    import tarfile
    info = tarfile.TarInfo(rel_text(rel))
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, rel_text(os.readlink(name, dir_fd=dir_fd))
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as f:
                now = os.fstat(fd)
                if not stat.S_ISREG(now.st_mode):
                    return False  # swapped for a FIFO or a device since the stat: never read one
                info.size = now.st_size
                tar.addfile(info, f)
        else:
            return False
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # swapped for a link (or a socket) since the stat
            return False
        raise
    return True


def extract_checked(fileobj: "BinaryIO", stage_fd: int, wanted: "Iterator[bytes] | None" = None,
                    keep_setid: bool = False) -> "list[tuple[bytes, bytes]]":
    """Extract a checked tar stream under stage_fd, with exact modes and mtimes and no link ever followed.

    Only plain relative names, regular files, directories and links that pass link_is_safe(); parents must come
    first. With wanted (an iterator of the paths asked for, in the order asked), every member must be one of them,
    in that order: the sender cannot slip in anything else. Set-id bits are dropped unless keep_setid.
    -> [(path, target)] of the links it made, for a judgement against the tree they join (sync's pull).
    """
    import tarfile
    mask = 0o7777 if keep_setid else SETID_MASK
    dirs = []
    links = []
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        for member in iter(tar.next, None):
            tar.members = []  # type: ignore[attr-defined]  # tarfile keeps every header it read: memory would grow with the archive
            rel = os.fsencode(member.name.rstrip("/"))
            parents, name = split_rel(rel)
            if wanted is not None and next((p for p in wanted if p == rel), None) is None:
                raise SyncError("refused archive member %r: not asked for (or out of order)" % member.name)
            if member.issym() and not link_is_safe(rel, os.fsencode(member.linkname)):
                raise SyncError("refused archive member %r: a link to %r, which may lead out of the tree"
                                % (member.name, member.linkname))
            dir_fd = open_dir_at(stage_fd, parents)
            try:
                if member.isdir():
                    try:
                        os.mkdir(name, 0o700, dir_fd=dir_fd)
                    except FileExistsError:
                        pass
                    dirs.append((rel, member.mode & mask, int(member.mtime)))
                elif member.issym():
                    os.symlink(os.fsencode(member.linkname), name, dir_fd=dir_fd)
                    links.append((rel, os.fsencode(member.linkname)))
                elif member.isreg():
                    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
                    try:
                        src = tar.extractfile(member)  # a regular member always has a file object
                        while True:
                            data = src.read(HASH_CHUNK)  # type: ignore[union-attr]
                            if not data:
                                break
                            os.write(fd, data)
                        set_attrs(fd, member.mode & mask, int(member.mtime))
                    finally:
                        os.close(fd)
                else:
                    raise SyncError("refused archive member %r: not a file, directory or link" % member.name)
            finally:
                os.close(dir_fd)
    for rel, mode, mtime in reversed(dirs):
        parents, name = split_rel(rel)
        dir_fd = open_dir_at(stage_fd, parents)
        try:
            set_attrs(dir_fd, mode, mtime, name)
        finally:
            os.close(dir_fd)
    return links


# ------------------------------------------------------------------ the guest's side of a run

def read_chunks(stream: BinaryIO, size: int = 65536) -> "Iterator[bytes]":
    while True:
        data = stream.read1(size) if hasattr(stream, "read1") else stream.read(size)
        if not data:
            return
        yield data


def guest_main(argv: "list[str]") -> int:
    """python3 -c <this file> '<json>': one step of a sync run in the guest (plugins/action/sync.py runs them).

    Each step is a command of its own whose stdin is whole before it matters (one-shot: the api road carries
    nothing else without the team's interactive stdin), and whose stdout is its answer:
    manifest: the manifest of root, ended by the END record ({"exists"}); a pull's walk leaves out unsafe links.
    apply:    (push) with stage_name (the stage dir, 0700, the controller's sh step made in the run's scratch dir
              and the agent's Upload extracted the archive into), move the stage's entries into place, refusing a
              stage that is not ours; then the operations on stdin (deletions and fixes) -> a JSON summary. The
              stage dir is removed whatever happened.
    pack:     (pull) the wanted paths on stdin -> a tar of exactly those in the stage file (0600, ours, made
              here) and a JSON line; the file stays for the controller's Download (then its sh step removes it).
    Every path is opened from held directory fds (open_root, open_beneath): a guest user who swaps a directory
    for a link while this runs as root moves nothing outside the tree.
    """
    args = json.loads(argv[1])
    out = sys.stdout.buffer
    phase = args["phase"]
    workspace = args.get("workspace")
    if phase == "manifest":
        return guest_manifest(args, out)
    run_fd = open_root(os.environ.get("TMPDIR") or "/tmp", workspace=workspace)
    if run_fd is None:
        raise SyncError("the run's scratch dir %s does not exist" % os.environ.get("TMPDIR"))
    try:
        stage_name = os.fsencode(args["stage_name"]) if args.get("stage_name") else None
        if stage_name is not None:
            split_rel(stage_name)
            if b"/" in stage_name:
                raise SyncError("the stage name %r is not one name" % args["stage_name"])
        records = split_stream(read_chunks(sys.stdin.buffer))
        if phase == "apply":
            return guest_push(args, run_fd, stage_name, records, out)
        if phase == "pack" and stage_name is not None:
            return guest_pull(args, run_fd, stage_name, records, out)
        raise SyncError("unknown step %r (or no stage name)" % phase)
    finally:
        os.close(run_fd)


def guest_manifest(args: dict, out: "BinaryIO") -> int:
    root_fd = open_root(args["root"], create=False, workspace=args.get("workspace"))
    if root_fd is None and args["mode"] == "pull":
        raise SyncError("%s does not exist" % args["root"])
    try:
        if root_fd is not None:
            excludes = Excludes(args.get("excludes") or [])
            for entry in walk(root_fd, excludes, bool(args.get("checksum")), skip_unsafe_links=(args["mode"] == "pull")):
                out.write(entry.encode())
        out.write(b"\0END\0" + json.dumps({"exists": root_fd is not None}).encode() + b"\0")
        out.flush()
    finally:
        if root_fd is not None:
            os.close(root_fd)
    return 0


def open_stage(run_fd: int, stage_name: bytes) -> int:
    """The stage dir the controller made: a directory (no link followed) of ours that nobody else may write."""
    fd = os.open(stage_name, DIR_FLAGS, dir_fd=run_fd)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise SyncError("refused the stage dir: it is not the one this run made (owner %d, mode %o)"
                        % (st.st_uid, stat.S_IMODE(st.st_mode)))
    return fd


def guest_pull(args: dict, run_fd: int, stage_name: bytes, records: "Iterator[bytes]", out: "BinaryIO") -> int:
    root_fd = open_root(args["root"], create=False, workspace=args.get("workspace"))
    if root_fd is None:
        raise SyncError("%s does not exist" % args["root"])
    wanted = (p for p in records if p)
    try:
        fd = os.open(stage_name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o600, dir_fd=run_fd)
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                members = tar_selected(root_fd, wanted, f)
            out.write(json.dumps({"members": members, "size": os.fstat(fd).st_size}).encode() + b"\n")
            out.flush()
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)
    return 0


def guest_push(args: dict, run_fd: int, stage_name: "bytes | None", records: "Iterator[bytes]",
               out: "BinaryIO") -> int:
    summary = {"moved": 0, "deleted": 0, "fixed": 0}
    stage_fd = None
    try:
        if stage_name is not None:
            stage_fd = open_stage(run_fd, stage_name)
        owner = args.get("owner")
        workspace = args.get("workspace")
        root_fd = open_root(args["root"], create=False, workspace=workspace)
        if root_fd is None:
            root_fd = open_root(args["root"], create=True, workspace=workspace)
            if root_fd is None:  # open_root returns None only without create
                raise SyncError("%s could not be created" % args["root"])
            if owner:
                os.fchown(root_fd, owner[0], owner[1])
        try:
            if stage_fd is not None:
                summary["moved"] = apply_stage(stage_fd, root_fd, owner=owner)
                if not summary["moved"]:
                    raise SyncError("the stage dir held nothing: the archive was not extracted where this run made it")
            summary["deleted"], summary["fixed"] = run_ops(root_fd, records, Excludes(args.get("excludes") or []))
        finally:
            os.close(root_fd)
    finally:
        if stage_fd is not None:
            os.close(stage_fd)
        if stage_name is not None:
            remove_entry(run_fd, stage_name, b"stage")  # whatever happened: the stage never outlives this step
    out.write(json.dumps(summary).encode() + b"\n")
    out.flush()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(guest_main(sys.argv))
    except SyncError as exc:
        sys.stderr.write("%s\n" % exc)
        sys.exit(3)
    except OSError as exc:
        sys.stderr.write("%s\n" % exc)
        sys.exit(5)
