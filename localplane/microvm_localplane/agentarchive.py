"""The agent's tar archives: refuse an archive whole before writing anything, extract it through held directory fds,
and stream a directory as a tar.

`plan()` reads every header first and resolves every member, and every link target, symbolically against the tree
that exists plus what the archive itself will have created by then (beneath.Walk with an overlay). A member or link
that would land outside the destination, a name the file system cannot hold, a file where the guest has a
directory, or an archive over the plane's bounds refuses the whole archive: nothing is written. `extract()` then
writes member by member, each resolved again from held fds (beneath), so a tree changed meanwhile cannot move a
write outside the destination either.
"""
import json
import os
import posixpath
import stat
import tarfile

from .beneath import DIR, FILE, LINK, MISSING, Entry, TooLong, Walk, check_lengths, open_beneath

LIMITS_FILE = "agent-limits.json"   # in the guest's run dir, written by the plane (`up --archive-max-*`)
# The platform documents 50 GiB as the largest transfer; it documents no member count.
DEFAULT_LIMITS = {"archive_max_members": 250_000, "archive_max_bytes": 50 * 1024 ** 3}
READ_SIZE = 256 * 1024


class ArchiveRefused(Exception):
    """kind: "invalid", "escape", "conflict" or "limit" (the agent maps each to a status)."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind
        self.message = message


def load_limits(run_dir):
    """The plane's archive bounds for this guest (DEFAULT_LIMITS for what it does not set)."""
    limits = dict(DEFAULT_LIMITS)
    try:
        with open(os.path.join(run_dir, LIMITS_FILE)) as f:
            given = json.load(f)
    except (OSError, ValueError):
        return limits
    if isinstance(given, dict):
        for key in limits:
            value = given.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                limits[key] = value
    return limits


def write_limits(run_dir, limits):
    """The plane's bounds into a guest's run dir (replaced atomically; the agent reads them at every archive)."""
    tmp = os.path.join(run_dir, LIMITS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(limits, f)
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(run_dir, LIMITS_FILE))


def safe_mode(mode):
    """tarfile's data filter: no set-id/sticky bits, no group/other write; the owner can read and write."""
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


def _resolved(walk, path, follow_last, overlay=None, start=None):
    """A resolution whose fds are released at once: the planner only needs names and kinds."""
    with Walk(walk) as w:
        return w.resolve(path, follow_last, overlay, start)


class Planner:
    def __init__(self, target, given, limits, walk):
        self.walk = walk
        self.target = target
        self.base = target.names
        self.base_path = target.logical
        self.given = given
        self.limits = limits
        self.overlay = {}
        self.lexical_links = set()
        self.symlinks = []
        self.members = []
        self.files_bytes = 0
        self.name_max = walk.name_max

    def refuse(self, kind, member, why):
        raise ArchiveRefused(kind, 'archive member "%s" %s; nothing was extracted into "%s"' % (member.name, why, self.given))

    def add(self, m):
        if len(self.members) >= self.limits["archive_max_members"]:
            raise ArchiveRefused("limit", "the archive has more than %d members, the plane's limit (archive_max_members);"
                                 " nothing was extracted into \"%s\"" % (self.limits["archive_max_members"], self.given))
        if m.name.startswith("/"):
            self.refuse("escape", m, "has an absolute path")
        rel = posixpath.normpath(m.name)
        if rel == ".." or rel.startswith("../"):
            self.refuse("escape", m, "leaves the destination (..)")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            self.refuse("escape", m, "is a special file (device, FIFO or other), which is not allowed")
        if m.isreg():
            self.files_bytes += m.size
            if self.files_bytes > self.limits["archive_max_bytes"]:
                raise ArchiveRefused("limit", "the archive expands to more than %d bytes, the plane's limit "
                                     "(archive_max_bytes); nothing was extracted into \"%s\""
                                     % (self.limits["archive_max_bytes"], self.given))
        if rel == ".":
            if not m.isdir():
                self.refuse("invalid", m, "names the destination itself but is not a directory")
            return
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in self.lexical_links:
                # A member reached through a link the same archive created could land anywhere.
                self.refuse("escape", m, "goes through the link %s of the same archive" % "/".join(parts[:i]))
        path = self.base_path + "/" + rel
        try:
            check_lengths(path, self.name_max)
            # From the destination's held entries: the same answer as from "/" (the destination is resolved,
            # links and all), without opening its components again for every member.
            r = _resolved(self.walk, rel, m.isdir(), self.overlay, start=self.target.entries)
        except TooLong as e:
            self.refuse("invalid", m, "cannot be created: %s" % e)
        except OSError as e:
            self.refuse("conflict", m, "cannot be resolved: %s" % (e.strerror or e))
        if not r.within(self.base):
            self.refuse("escape", m, "would land outside the destination (at %s)" % r.logical)
        if any(e.kind in (FILE, LINK) for e in r.entries[1:-1]):
            self.refuse("conflict", m, "is below something that is not a directory")
        final = r.final
        if m.isdir():
            if final.kind not in (DIR, MISSING):
                self.refuse("conflict", m, "is a directory but the sandbox has a file there")
            self.overlay[r.names] = Entry(final.name, DIR)
        else:
            if final.kind == DIR:
                self.refuse("conflict", m, "is not a directory but the sandbox has a directory there")
            if m.issym():
                if not m.linkname:
                    self.refuse("invalid", m, "is a symbolic link with an empty target")
                self.overlay[r.names] = Entry(final.name, LINK, link=m.linkname)
                self.symlinks.append((m, r.names))
                self.check_link(m, r.names)
            elif m.islnk():
                self.check_hardlink(m)
                self.overlay[r.names] = Entry(final.name, FILE)
            else:
                self.overlay[r.names] = Entry(final.name, FILE)
            if m.issym() or m.islnk():
                self.lexical_links.add(rel)
        self.members.append(m)

    def check_link(self, m, names):
        """The link's target, resolved now (links of the archive included), stays inside the destination."""
        start = "" if m.linkname.startswith("/") else "/" + "/".join(names[:-1]) + "/"
        try:
            r = _resolved(self.walk, start + m.linkname, True, self.overlay)
        except OSError as e:
            self.refuse("escape", m, "is a symbolic link to %s that cannot be resolved (%s)" % (m.linkname, e.strerror or e))
        if not r.within(self.base):
            self.refuse("escape", m, "is a symbolic link to %s, which leads outside the destination (to %s)"
                        % (m.linkname, r.logical))

    def check_hardlink(self, m):
        link = posixpath.normpath(m.linkname or ".")
        if m.linkname.startswith("/") or link == "." or link == ".." or link.startswith("../"):
            self.refuse("escape", m, "is a hard link to %s, outside the destination" % m.linkname)
        try:
            r = _resolved(self.walk, self.base_path + "/" + link, False, self.overlay)
        except OSError as e:
            self.refuse("escape", m, "is a hard link to %s that cannot be resolved (%s)" % (m.linkname, e.strerror or e))
        if not r.within(self.base):
            self.refuse("escape", m, "is a hard link to %s, outside the destination" % m.linkname)
        if r.final.kind != FILE:
            self.refuse("conflict", m, "is a hard link to %s, which is not a file of the destination" % m.linkname)

    def finish(self):
        # A later member may have changed what an earlier link goes through: every link, once more, as extracted.
        for m, names in self.symlinks:
            if self.overlay.get(names) is not None and self.overlay[names].kind == LINK:
                self.check_link(m, names)
        return self.members


def plan(tar, target, given, limits, walk):
    """Every member of the tar, checked whole; ArchiveRefused before anything is written.

    `walk` is the one that resolved target (its fds still held)."""
    planner = Planner(target, given, limits, walk)
    try:
        for m in tar:
            planner.add(m)
    except (tarfile.TarError, EOFError) as e:
        raise ArchiveRefused("invalid", "corrupt tar archive: %s" % e) from e
    return planner.finish()


def extract(tar, members, target, given, walk):
    """Write the planned members under target (resolved by `walk`, whose fds are still held).

    Every member is resolved from the destination's own fd, not by its name, and checked again: a tree changed
    meanwhile cannot move a write outside the destination.
    """
    base = target.names
    walk.dir_fd(target)
    for m in members:
        rel = posixpath.normpath(m.name)
        if rel == ".":
            continue
        with Walk(walk) as w:
            r = w.resolve(rel, follow_last=m.isdir(), start=target.entries)
            if not r.within(base):
                raise ArchiveRefused("escape", 'archive member "%s" would land outside "%s": the sandbox changed '
                                     "while it was extracted" % (m.name, given))
            if m.isdir():
                w.dir_fd(r)
                continue
            if r.final.kind == DIR:
                raise ArchiveRefused("conflict", 'archive member "%s" is not a directory but the sandbox has one there'
                                     % m.name)
            parent, name = w.parent_fd(r), r.final.name
            tmp = ".%s.extract-%s" % (name[:100], os.urandom(6).hex())
            try:
                if m.isreg():
                    _write_file(tar, m, parent, tmp)
                elif m.issym():
                    os.symlink(m.linkname, tmp, dir_fd=parent)
                else:
                    src = w.resolve(posixpath.normpath(m.linkname), follow_last=False, start=target.entries)
                    if not src.within(base):
                        raise ArchiveRefused("escape", 'archive member "%s" links outside "%s"' % (m.name, given))
                    os.link(src.final.name, tmp, src_dir_fd=w.parent_fd_existing(src), dst_dir_fd=parent,
                            follow_symlinks=False)
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=parent)
                except OSError:
                    pass
                raise


def _write_file(tar, m, parent, tmp):
    fd = open_beneath(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, parent, 0o600)
    with os.fdopen(fd, "wb") as out:
        src = tar.extractfile(m)
        if src is not None:
            with src:
                while True:
                    data = src.read(READ_SIZE)
                    if not data:
                        break
                    out.write(data)
        out.flush()
        os.fchmod(fd, safe_mode(m.mode))
        os.utime(fd, (m.mtime, m.mtime))


# ---------------------------------------------------------------- Download as a tar

def tar_stream(dir_fd):
    """A POSIX tar of the directory's contents, produced piece by piece (constant memory), read through fds only.

    os.fwalk opens every directory relative to its parent and checks it is the one it listed, so a directory
    swapped for a link while it is read is skipped, never followed: links are archived as links.
    """
    for dirpath, dirnames, filenames, fd in os.fwalk(".", dir_fd=dir_fd):
        dirnames.sort()
        for name in dirnames + sorted(filenames):
            arcname = posixpath.normpath(posixpath.join(dirpath, name))
            try:
                info = tar_info(fd, name, arcname)
            except OSError:
                continue  # vanished while walking
            if info is None:
                continue
            yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            if info.isreg():
                yield from file_payload(fd, name, info.size)
    yield b"\0" * (tarfile.BLOCKSIZE * 2)


def tar_info(dir_fd, name, arcname):
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    info = tarfile.TarInfo(arcname)
    info.mode = stat.S_IMODE(st.st_mode)
    info.mtime = int(st.st_mtime)
    info.uid, info.gid = st.st_uid, st.st_gid
    if stat.S_ISREG(st.st_mode):
        info.type, info.size = tarfile.REGTYPE, st.st_size
    elif stat.S_ISDIR(st.st_mode):
        info.type = tarfile.DIRTYPE
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dir_fd)
    else:
        return None  # sockets, fifos, devices: nothing a transfer should carry
    return info


def file_payload(dir_fd, name, size):
    """Exactly `size` bytes then tar padding, even if the file changes (or is swapped for a link) while it is read."""
    sent = 0
    try:
        fd = open_beneath(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd)
        with os.fdopen(fd, "rb") as f:
            while sent < size:
                data = f.read(min(READ_SIZE, size - sent))
                if not data:
                    break
                sent += len(data)
                yield data
    except OSError:
        pass
    if sent < size:
        yield b"\0" * (size - sent)
    pad = -size % tarfile.BLOCKSIZE
    if pad:
        yield b"\0" * pad
