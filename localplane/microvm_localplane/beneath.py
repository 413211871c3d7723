"""Guest paths resolved one component at a time from held directory fds, so a check and the write it allows are one.

The agent used to resolve a path (realpath), check it was under /workspace, and then write by name: anything that
swapped a directory for a symbolic link in between moved the write outside. Here every component is opened with
O_PATH|O_NOFOLLOW|O_DIRECTORY relative to the fd of its parent, symbolic links are expanded by this code (with the
same rules as the kernel and realpath: relative to the link's directory, absolute from "/", 40 at most), and the
caller gets the fd of the directory that was checked: the openat/mkdirat/renameat/symlinkat that follow happen in
that very directory, whatever happens to the names meanwhile.

Why not one openat2(RESOLVE_BENEATH) for the whole path: it refuses every absolute symbolic link, also one that
points inside /workspace, which the contract's confinement (resolve as the guest does, then check) accepts; this walk
gives realpath's answers. Each single step, though, is an openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
RESOLVE_NO_MAGICLINKS) where the kernel has it (Linux 5.6+, called through ctypes): the kernel itself then refuses to
leave the held directory or to follow any link, whatever name reaches it; where it has not, openat(O_NOFOLLOW) of a
name without "/" is the same step (`open_beneath`).

An `overlay` (logical path tuple -> Entry) lets the archive planner resolve names against "the existing tree plus
what the archive will have created", before anything is written.
"""
import errno
import os
import struct
from collections import deque

NAME_MAX_DEFAULT = 255
PATH_MAX = 4096        # bytes with the terminating NUL (Linux)
MAX_LINKS = 40         # symbolic links followed in one resolution (Linux's limit)
DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

DIR, FILE, LINK, MISSING = "dir", "file", "link", "missing"

SYS_OPENAT2 = 437      # the same number on every architecture (asm-generic table)
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_BENEATH = 0x02, 0x04, 0x08
RESOLVE_STEP = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_openat2 = None        # the libc syscall() entry once openat2 is known to work; False when the kernel lacks it


def _probe_openat2():
    """syscall() when this kernel (and the guest's seccomp profile) has openat2, else False."""
    global _openat2
    if _openat2 is None:
        try:
            import ctypes  # here, not at the top: the agent's boot needs no ctypes, only its first transfer
            call = ctypes.CDLL(None, use_errno=True).syscall
            call.restype = ctypes.c_long
            how = struct.pack("QQQ", os.O_PATH | os.O_CLOEXEC, 0, RESOLVE_STEP)
            fd = call(SYS_OPENAT2, ctypes.c_int(-100), b".", how, ctypes.c_size_t(len(how)))
            if fd >= 0:
                os.close(fd)
            _openat2 = call if fd >= 0 or ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM) else False
        except (OSError, AttributeError):
            _openat2 = False
    return _openat2


def open_beneath(name: str, flags: int, dir_fd: int, mode: int = 0o777) -> int:
    """Open the one entry `name` of the directory `dir_fd`, never through a symbolic link -> fd.

    openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) where the kernel has it: a name that
    tried to leave dir_fd (`..`, an absolute path) is EXDEV and any link on the way ELOOP, by the kernel's own
    check. Elsewhere openat(O_NOFOLLOW), which is the same for a name without "/" (the only kind passed here).
    """
    if "/" in name or name in ("", ".."):
        raise OSError(errno.EXDEV, "not a single name below its directory", name)
    call = _probe_openat2()
    if not call:
        return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=dir_fd)
    how = struct.pack("QQQ", flags | os.O_NOFOLLOW, mode if flags & os.O_CREAT else 0, RESOLVE_STEP)
    import ctypes
    fd = call(SYS_OPENAT2, ctypes.c_int(dir_fd), os.fsencode(name), how, ctypes.c_size_t(len(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)
    return fd


class Outside(Exception):
    """The path resolves outside the boundary."""


class TooLong(Exception):
    """A name or a path is longer than the file system allows (message names the limit)."""


class Entry:
    """One resolved component: its name, its kind, the O_PATH fd when it is an existing directory."""
    __slots__ = ("name", "kind", "fd", "link")

    def __init__(self, name, kind, fd=None, link=None):
        self.name, self.kind, self.fd, self.link = name, kind, fd, link


def name_max(fd):
    try:
        return os.pathconf(fd, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX_DEFAULT


def check_lengths(path, limit_name):
    """Refuse a path no file system here can hold, before anything is created (TooLong)."""
    size = len(os.fsencode(path))
    if size >= PATH_MAX:
        raise TooLong("path of %d bytes is longer than the file system allows (PATH_MAX %d bytes with its NUL): %s..."
                      % (size, PATH_MAX, path[:80]))
    for part in path.split("/"):
        n = len(os.fsencode(part))
        if n > limit_name:
            raise TooLong("a path component of %d bytes is longer than the file system allows (NAME_MAX %d bytes): "
                          "%s..." % (n, limit_name, part[:80]))


class Resolved:
    """A resolved path: entries[0] is "/", entries[-1] the final component."""

    def __init__(self, entries):
        self.entries = entries

    @property
    def names(self):
        return tuple(e.name for e in self.entries[1:])

    @property
    def logical(self):
        return "/" + "/".join(self.names)

    @property
    def final(self):
        return self.entries[-1]

    def within(self, boundary):
        """boundary is a names tuple; the path is it or below it."""
        return self.names[:len(boundary)] == boundary


class Walk:
    """Resolutions that hold their fds until close(); use as a context manager."""

    def __init__(self, parent: "Walk | None" = None) -> None:
        """With parent, share its root fd and limits (it must outlive this walk): an archive resolves every member
        in a walk of its own, and opening "/" and asking its NAME_MAX each time would cost more than the member."""
        self._fds = []
        if parent is not None:
            self.root, self.name_max = parent.root, parent.name_max
            return
        self.root = self._track(os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        self.name_max = name_max(self.root)

    def _track(self, fd):
        self._fds.append(fd)
        return fd

    def close(self):
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _lookup(self, parent, name, key, overlay):
        """The entry `name` in the directory `parent`: what the overlay plans there, else what the file system has."""
        planned = overlay.get(key) if overlay else None
        if planned is not None and planned.kind != DIR:
            return Entry(name, planned.kind, link=planned.link)
        real = self._real(parent, name)
        if planned is not None:  # a directory the archive creates or keeps
            return Entry(name, DIR, fd=real.fd if real.kind == DIR else None)
        return real

    def _real(self, parent, name):
        if parent.fd is None:  # below something missing or not a directory
            return Entry(name, MISSING)
        try:
            return Entry(name, DIR, fd=self._track(open_beneath(name, DIR_FLAGS, parent.fd)))
        except FileNotFoundError:
            return Entry(name, MISSING)
        except OSError as e:
            if e.errno not in (errno.ENOTDIR, errno.ELOOP):  # a file, or a link (openat2 says ELOOP)
                raise
        try:
            return Entry(name, LINK, link=os.readlink(name, dir_fd=parent.fd))
        except FileNotFoundError:
            return Entry(name, MISSING)
        except OSError as e:
            if e.errno == errno.EINVAL:  # not a link: a file, a socket, a device...
                return Entry(name, FILE)
            raise

    def resolve(self, path, follow_last=True, overlay=None, start=None):
        """Resolve a path like the guest's realpath would; the final component may be missing.

        An absolute path starts at "/", a relative one at `start` (the entries of a resolution whose fds are still
        held, e.g. an archive's destination). A non-directory in the middle makes the rest missing (as realpath
        does); writing through it then fails.
        """
        entries = list(start) if start and not path.startswith("/") else [Entry("", DIR, fd=self.root)]
        todo = deque(path.split("/"))
        links = 0
        while todo:
            comp = todo.popleft()
            if comp in ("", "."):
                continue
            if comp == "..":
                if len(entries) > 1:
                    entries.pop()
                continue
            key = tuple(e.name for e in entries[1:]) + (comp,)
            entry = self._lookup(entries[-1], comp, key, overlay)
            if entry.kind == LINK and (follow_last or any(t not in ("", ".") for t in todo)):
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "Too many levels of symbolic links")
                if entry.link.startswith("/"):
                    del entries[1:]
                todo.extendleft(reversed(entry.link.split("/")))
                continue
            entries.append(entry)
        return Resolved(entries)

    # ------------------------------------------------------------ writes, relative to checked fds

    def parent_fd(self, resolved, mode=0o777):
        """The fd of the final component's directory, creating the missing ones (each opened O_NOFOLLOW)."""
        entries = resolved.entries[:-1] if len(resolved.entries) > 1 else resolved.entries
        return self._materialize(entries, mode)

    def dir_fd(self, resolved, mode=0o777):
        """The fd of the final component as a directory, created with its missing parents when needed."""
        return self._materialize(resolved.entries, mode)

    def _materialize(self, entries, mode):
        fd = None
        for e in entries:
            if e.kind == DIR and e.fd is not None:
                fd = e.fd
                continue
            if e.kind in (FILE, LINK):
                raise OSError(errno.ENOTDIR, "Not a directory")
            try:
                os.mkdir(e.name, mode, dir_fd=fd)
            except FileExistsError:
                pass  # created meanwhile: opened with O_NOFOLLOW below, so a link put there is refused
            fd = self._track(open_beneath(e.name, DIR_FLAGS, fd))
            e.kind, e.fd = DIR, fd
        return fd

    def open_readable_dir(self, resolved):
        """An O_RDONLY fd of the final component (a directory), opened without following a link."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        if len(resolved.entries) == 1:  # "/" itself (never inside a boundary, but keep the walk total)
            return self._track(os.open("/", flags))
        return self._track(open_beneath(resolved.final.name, flags, self.parent_fd_existing(resolved)))

    def parent_fd_existing(self, resolved):
        if len(resolved.entries) == 1:
            return self.root
        parent = resolved.entries[-2]
        if parent.fd is None:
            raise OSError(errno.ENOENT, "No such file or directory")
        return parent.fd
