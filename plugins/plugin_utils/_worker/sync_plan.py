# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""What one sync run must change: two manifests in, in one pass, one entry of each side at a time.

`Planner.run(source, destination)` merges two manifests (iterators of sync_tree.Entry in canonical
order) and calls back for each change: `send(entry)` for an entry whose content must travel (with
every ancestor directory first, so an archive of them extracts in order), and `op(record)` for a
deletion or a mode/mtime fix of the destination, in the order they must run (a directory's fix after
everything inside it). It keeps counts and the first `limit` paths of each kind for the result.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import sync_tree as st


class Listing:
    """A count and the first `limit` paths."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.paths: list[str] = []

    def add(self, path: bytes) -> None:
        self.count += 1
        if len(self.paths) < self.limit:
            self.paths.append(st.rel_text(path))


def is_under(key: tuple[bytes, ...], prefix: tuple[bytes, ...]) -> bool:
    return len(key) > len(prefix) and key[:len(prefix)] == prefix


def merged(source: Iterable[st.Entry],
           destination: Iterable[st.Entry]) -> Iterator[tuple[tuple[bytes, ...], st.Entry | None, st.Entry | None]]:
    """(key, source entry or None, destination entry or None), in canonical order."""
    def keyed(entries: Iterable[st.Entry]) -> Iterator[tuple[tuple[bytes, ...], st.Entry]]:
        for entry in entries:
            yield entry.key(), entry

    src, dst = keyed(source), keyed(destination)
    s, d = next(src, None), next(dst, None)
    while s is not None or d is not None:
        if s is not None and (d is None or s[0] < d[0]):
            yield s[0], s[1], None
            s = next(src, None)
        elif d is not None and (s is None or d[0] < s[0]):
            yield d[0], None, d[1]
            d = next(dst, None)
        else:  # the same key on both sides
            yield s[0], s[1], d[1]  # type: ignore[index]
            s, d = next(src, None), next(dst, None)


class OpenDir:
    __slots__ = ("key", "entry", "new", "differs", "dirty")

    def __init__(self, key: tuple[bytes, ...], entry: st.Entry, new: bool, differs: bool) -> None:
        self.key, self.entry, self.new, self.differs, self.dirty = key, entry, new, differs, False


class Planner:
    def __init__(self, send: Callable[..., None], op: Callable[[bytes], object], delete: bool = False, checksum: bool = False,
                 limit: int = 1000) -> None:
        self._send = send
        self._op = op
        self.delete = delete
        self.checksum = checksum
        self.added = Listing(limit)
        self.updated = Listing(limit)
        self.deleted = Listing(limit)
        self.skipped = Listing(limit)
        self.root_created = False
        self.bytes = 0
        self._dirs: list[OpenDir] = []  # directories of the source still open (the path to the current entry)
        self._sent_dirs: list[tuple[bytes, ...]] = []  # directories already in the archive, along the current path
        self._covered: tuple[bytes, ...] | None = None  # a destination subtree that goes away with its root (deleted or replaced)

    @property
    def changed(self) -> bool:
        return bool(self.added.count or self.updated.count or self.deleted.count or self.root_created)

    # -- output -------------------------------------------------------------------------------------
    def send(self, entry: st.Entry, key: tuple[bytes, ...]) -> None:
        """Send entry, after whichever of its ancestors the archive does not hold yet."""
        depth = len(key) - 1
        while self._sent_dirs and (len(self._sent_dirs[-1]) > depth or key[:len(self._sent_dirs[-1])] != self._sent_dirs[-1]):
            self._sent_dirs.pop()
        for i in range(len(self._sent_dirs[-1]) if self._sent_dirs else 0, depth):
            ancestor = key[:i + 1]
            self._send(st.Entry(b"/".join(ancestor), st.KIND_DIR, 0o700, 0, 0), ancestor_only=True)
            self._sent_dirs.append(ancestor)
        self._send(entry, ancestor_only=False)
        if entry.kind == st.KIND_FILE:
            self.bytes += entry.size
        if entry.kind == st.KIND_DIR:
            self._sent_dirs.append(key)

    def touch_parent(self) -> None:
        if self._dirs:
            self._dirs[-1].dirty = True

    def close_dirs(self, key: tuple[bytes, ...]) -> None:
        """Close the open directories that key is not inside: their fixes come after their contents."""
        while self._dirs and not (key[:len(self._dirs[-1].key)] == self._dirs[-1].key and key != self._dirs[-1].key):
            done = self._dirs.pop()
            if done.new or done.differs or done.dirty:
                self._op(st.op_attrs(done.entry.path, done.entry.mode, done.entry.mtime))

    # -- the merge ----------------------------------------------------------------------------------
    def run(self, source: Iterable[st.Entry], destination: Iterable[st.Entry]) -> None:
        for key, s, d in merged(source, destination):
            self.close_dirs(key)
            if s is None:
                if self._covered is not None and is_under(key, self._covered):
                    continue
                self.only_in_destination(key, d)  # type: ignore[arg-type]  # merged() never yields two Nones
            elif d is None:
                self.only_in_source(key, s)
            else:
                self._covered = None
                self.in_both(key, s, d)
        self.close_dirs((b"\0end",))
        self.close_dirs(())

    def only_in_destination(self, key: tuple[bytes, ...], d: st.Entry) -> None:
        if d.kind == st.KIND_DIR:
            self._covered = key  # deleted or kept, its contents follow it
        if not self.delete:
            return
        self._op(st.op_delete(d.path))
        self.deleted.add(d.path)
        self.touch_parent()

    def only_in_source(self, key: tuple[bytes, ...], s: st.Entry) -> None:
        if s.kind == st.KIND_SKIPPED:
            self.skipped.add(s.path)
            return
        if key == ():
            self.root_created = True
        else:
            self.added.add(s.path)
            self.touch_parent()
            self.send(s, key)
        self.after_send(key, s, new=True)

    def after_send(self, key: tuple[bytes, ...], s: st.Entry, new: bool) -> None:
        if s.kind == st.KIND_DIR:
            self._dirs.append(OpenDir(key, s, new, False))
        elif s.kind == st.KIND_FILE and s.mode not in st.PLAIN_MODES:
            self._op(st.op_attrs(s.path, s.mode, s.mtime))  # an extractor may filter such modes: set them

    def in_both(self, key: tuple[bytes, ...], s: st.Entry, d: st.Entry) -> None:
        if s.kind == st.KIND_SKIPPED:
            self.skipped.add(s.path)
            if d.kind == st.KIND_DIR:
                self._covered = key  # left alone, with what it holds
            return
        if s.kind != d.kind:
            self.updated.add(s.path)
            self.touch_parent()
            if d.kind == st.KIND_DIR:
                self._covered = key  # replaced whole
            self.send(s, key)
            self.after_send(key, s, new=True)
            return
        if s.kind == st.KIND_DIR:
            differs = s.mode != d.mode or s.mtime != d.mtime
            if differs and key != ():
                self.updated.add(s.path)
            elif differs:
                self.root_created = True  # the root's own attributes: a change, not a listed path
            self._dirs.append(OpenDir(key, s, False, differs))
            return
        if s.kind == st.KIND_LINK:
            if s.extra != d.extra:
                self.updated.add(s.path)
                self.touch_parent()
                self.send(s, key)
            return
        same_content = s.size == d.size and (s.extra == d.extra if self.checksum else s.mtime == d.mtime)
        if not same_content:
            self.updated.add(s.path)
            self.touch_parent()
            self.send(s, key)
            self.after_send(key, s, new=False)
        elif s.mode != d.mode or s.mtime != d.mtime:
            self.updated.add(s.path)
            self._op(st.op_attrs(s.path, s.mode, s.mtime))


class ManifestReader:
    """The manifest step's stdout: manifest records up to the END record."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self.info = None

    def entries(self) -> Iterator[st.Entry]:
        """sync_tree.Entry values until the END record (then `info` holds its JSON)."""
        pending = []
        tail = b""
        for chunk in self._chunks:
            parts = (tail + chunk).split(b"\0")
            tail = parts.pop()
            pending.extend(parts)
            usable = len(pending) - len(pending) % 3
            for i in range(0, usable, 3):
                path, meta, extra = pending[i], pending[i + 1], pending[i + 2]
                if path == st.END:
                    if meta != b"END":
                        raise st.SyncError("bad end of manifest from the guest")
                    self.info = st.json.loads(extra.decode("utf-8"))
                    return
                yield st.parse_meta(path, meta, extra)
            del pending[:usable]
        raise st.SyncError("the guest ended its manifest early")

    def finish(self) -> None:
        for _chunk in self._chunks:
            pass
