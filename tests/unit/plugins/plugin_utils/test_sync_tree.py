"""sync_tree and sync_plan on one side, without a sandbox: excludes, manifests, the plan, applying a stage,
and memory that does not grow with the tree."""
import io
import os
import tarfile
import tracemalloc

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import sync_plan as sp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import sync_tree as st


@pytest.mark.parametrize("pattern,path,is_dir,excluded", [
    ("*.pyc", "x.pyc", False, True),
    ("*.pyc", "deep/down/x.pyc", False, True),
    ("/build/", "build", True, True),
    ("/build/", "sub/build", True, False),
    ("/build/", "build", False, False),
    ("node_modules", "a/node_modules", True, True),
    ("docs/*.md", "docs/a.md", False, True),
    ("docs/*.md", "docs/sub/a.md", False, False),
    ("docs/*.md", "x/docs/a.md", False, False),
    ("a/**/z", "a/z", False, True),
    ("a/**/z", "a/b/c/z", False, True),
    ("**/tmp", "x/y/tmp", True, True),
    ("file[0-9].txt", "file7.txt", False, True),
    ("file[!0-9].txt", "file7.txt", False, False),
    ("- *.log", "x.log", False, True),
    ("# comment", "# comment", False, False),
])
def test_excludes(pattern, path, is_dir, excluded):
    assert st.Excludes([pattern]).excluded(path, is_dir) is excluded


def test_excludes_last_match_wins():
    ex = st.Excludes(["*.pyc", "!keep.pyc", "+ also.pyc"])
    assert ex.excluded("a.pyc", False) and not ex.excluded("keep.pyc", False) and not ex.excluded("also.pyc", False)


@pytest.mark.parametrize("rel,target,safe", [
    (b"l", b"x", True), (b"a/l", b"../x", True), (b"a/l", b"../../x", False), (b"l", b"/etc", False),
    (b"a/b/l", b"../../c/./y", True), (b"l", b"..", False), (b"l", b"", False), (b"d", b".", True),
    # rsync 3.4's rule (CVE-2024-12088): `..` only before the first name, whatever the text adds up to
    (b"a/b/l", b"../c/./../../y", False), (b"logs", b"d/d/d/../../../srv/victim", False), (b"l", b"d/..", False),
])
def test_link_is_safe(rel, target, safe):
    assert st.link_is_safe(rel, target) is safe


def make_tree(root):
    os.makedirs(os.path.join(root, "d/e"))
    for rel, data in (("a", b"1"), ("a b", b"2"), ("d/f", b"3"), ("d/e/g", b"4"), ("z", b"5")):
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
    os.symlink("d/f", os.path.join(root, "link"))
    os.symlink("/etc/passwd", os.path.join(root, "out"))


def open_root(path):
    return os.open(path, st.DIR_FLAGS)


def test_walk_order_links_and_records(tmp_path):
    make_tree(str(tmp_path))
    fd = open_root(str(tmp_path))
    try:
        entries = list(st.walk(fd, skip_unsafe_links=True))
    finally:
        os.close(fd)
    paths = [e.path for e in entries]
    # a directory right before its contents, names bytewise: "a b" after "a", "d/..." before "link"
    assert paths == [b".", b"a", b"a b", b"d", b"d/e", b"d/e/g", b"d/f", b"link", b"out", b"z"]
    assert [e.key() for e in entries] == sorted(e.key() for e in entries)
    kinds = {e.path: e.kind for e in entries}
    assert kinds[b"link"] == st.KIND_LINK and kinds[b"out"] == st.KIND_SKIPPED and kinds[b"d"] == st.KIND_DIR
    stream = b"".join(e.encode() for e in entries) + b"\0END\0{\"exists\": true}\0"
    chunks = iter([stream[i:i + 7] for i in range(0, len(stream), 7)])
    reader = sp.ManifestReader(chunks)
    again = list(reader.entries())
    assert [(e.path, e.kind, e.mode, e.size, e.mtime, e.extra) for e in again] == \
        [(e.path, e.kind, e.mode, e.size, e.mtime, e.extra) for e in entries]
    assert reader.info == {"exists": True}


def entry(path, kind=st.KIND_FILE, mode=0o644, size=1, mtime=1, extra=b""):
    return st.Entry(path, kind, mode, size, mtime, extra)


def plan(src, dst, delete=True, checksum=False):
    sent, ops = [], []
    planner = sp.Planner(lambda e, ancestor_only=False: sent.append((e.path, ancestor_only)), ops.append,
                         delete=delete, checksum=checksum)
    planner.run(iter(src), iter(dst))
    return planner, sent, ops


def test_plan_changes_ancestors_and_order():
    root = entry(b".", st.KIND_DIR, 0o755, 0, 5)
    src = [root, entry(b"a", st.KIND_DIR, 0o755, 0, 5), entry(b"a/b", st.KIND_DIR, 0o755, 0, 5),
           entry(b"a/b/new", size=3), entry(b"a/same"), entry(b"c", mode=0o600), entry(b"t", st.KIND_DIR, 0o755, 0, 5),
           entry(b"t/x")]
    dst = [root, entry(b"a", st.KIND_DIR, 0o755, 0, 5), entry(b"a/b", st.KIND_DIR, 0o755, 0, 5),
           entry(b"a/b/gone", st.KIND_DIR, 0o755, 0, 5), entry(b"a/b/gone/inner"), entry(b"a/same"),
           entry(b"c", mode=0o644), entry(b"t"), entry(b"zz", st.KIND_LINK, 0o777, 0, 1, b"a")]
    planner, sent, ops = plan(src, dst)
    assert planner.added.paths == ["a/b/new", "t/x"] and planner.updated.paths == ["c", "t"]
    assert planner.deleted.paths == ["a/b/gone", "zz"], "a deleted directory is one deletion"
    # ancestors of a/b/new first (as bare directories), a type change sends the new directory itself
    assert sent == [(b"a", True), (b"a/b", True), (b"a/b/new", False), (b"t", False), (b"t/x", False)]
    # mode fix of c; a/b and a fixed after their contents, the root last
    # (a itself is untouched: nothing was added to or removed from it directly)
    assert ops == [st.op_delete(b"a/b/gone"), st.op_attrs(b"a/b", 0o755, 5),
                   st.op_attrs(b"c", 0o600, 1), st.op_attrs(b"t", 0o755, 5), st.op_delete(b"zz"),
                   st.op_attrs(b".", 0o755, 5)]
    assert plan(src, src)[0].changed is False


def test_plan_without_delete_and_with_checksum():
    src = [entry(b".", st.KIND_DIR), entry(b"f", size=2, mtime=9, extra=b"aa")]
    dst = [entry(b".", st.KIND_DIR), entry(b"f", size=2, mtime=1, extra=b"aa"), entry(b"g")]
    planner, sent, ops = plan(src, dst, delete=False, checksum=True)
    assert sent == [] and planner.updated.paths == ["f"] and planner.deleted.count == 0
    assert ops == [st.op_attrs(b"f", 0o644, 9)], "same content: only the mtime is set"
    planner, sent, _ops = plan(src, dst, delete=False, checksum=False)
    assert sent == [(b"f", False)]


def synthetic(count, mtime=1):
    yield entry(b".", st.KIND_DIR, 0o755, 0, 1)
    for d in range(count // 100):
        yield entry(b"dir%05d" % d, st.KIND_DIR, 0o755, 0, 1)
        for f in range(100):
            yield entry(b"dir%05d/file%03d" % (d, f), mtime=mtime)


def test_plan_memory_does_not_grow_with_the_tree():
    """30,000 files a side, every one changed: the plan holds a path, never the tree (that would be ~5 MB)."""
    sent = [0]

    def send(e, ancestor_only=False):
        sent[0] += 1
    ops = io.BytesIO()
    planner = sp.Planner(send, lambda r: None, delete=True, limit=100)
    tracemalloc.start()
    try:
        planner.run(synthetic(30_000, mtime=2), synthetic(30_000, mtime=1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # every file, and once each of the 300 directories holding them (as the files' ancestors)
    assert sent[0] == 30_300 and planner.updated.count == 30_000 and len(planner.updated.paths) == 100
    assert peak < 512 * 1024, "the plan of 30,000 entries peaked at %d bytes" % peak
    del ops


def test_walk_memory_does_not_grow_with_the_tree(tmp_path):
    for d in range(16):
        os.makedirs(tmp_path / ("d%02d" % d))
        for f in range(250):
            (tmp_path / ("d%02d" % d) / ("f%03d" % f)).write_bytes(b"x")
    fd = open_root(str(tmp_path))
    tracemalloc.start()
    try:
        count = sum(1 for _e in st.walk(fd))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        os.close(fd)
    assert count == 1 + 16 + 4_000
    assert peak < 256 * 1024, "walking 4,000 files peaked at %d bytes (their entries alone take ~500 kB)" % peak


def tar_of(members):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, value, mode in members:
            info = tarfile.TarInfo(name)
            info.mode, info.mtime = mode, 1_600_000_000
            data = None
            if kind == "file":
                info.size, data = len(value), io.BytesIO(value)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
            else:
                info.type, info.linkname = tarfile.SYMTYPE, value
            tar.addfile(info, data)
    buf.seek(0)
    return buf


def test_extract_apply_and_ops(tmp_path):
    dest, stage = tmp_path / "dest", tmp_path / "stage"
    dest.mkdir()
    stage.mkdir()
    (dest / "was-dir").mkdir()
    (dest / "was-dir" / "x").write_text("x")
    (dest / "was-file").write_text("f")
    (dest / "keep.pyc").write_text("k")
    (dest / "gone").mkdir()
    (dest / "gone" / "cache.pyc").write_text("c")
    (dest / "gone" / "other").write_text("o")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(str(outside), str(dest / "linked"))
    archive = tar_of([("was-dir", "file", b"now a file", 0o600), ("was-file", "dir", None, 0o750),
                      ("was-file/inner", "file", b"i", 0o644), ("linked", "dir", None, 0o755),
                      ("linked/t", "file", b"t", 0o644), ("l", "sym", "was-dir", 0o777)])
    stage_fd, dest_fd = open_root(str(stage)), open_root(str(dest))
    try:
        st.extract_checked(archive, stage_fd)
        assert st.apply_stage(stage_fd, dest_fd) == 4
        ops = st.op_delete(b"gone") + st.op_attrs(b"was-file", 0o750, 1_600_000_000)
        assert st.run_ops(dest_fd, st.split_stream([ops]), st.Excludes(["*.pyc"])) == (1, 1)
    finally:
        os.close(stage_fd)
        os.close(dest_fd)
    assert (dest / "was-dir").read_text() == "now a file" and oct((dest / "was-dir").stat().st_mode & 0o777) == "0o600"
    assert (dest / "was-file" / "inner").read_text() == "i"
    assert oct((dest / "was-file").stat().st_mode & 0o777) == "0o750"
    assert not (dest / "linked").is_symlink() and (dest / "linked" / "t").read_text() == "t"
    assert os.listdir(outside) == [], "written through a link"
    assert sorted(os.listdir(dest / "gone")) == ["cache.pyc"], "an excluded entry keeps its directory"
    assert os.readlink(dest / "l") == "was-dir"


def test_extract_refuses_paths_that_climb(tmp_path):
    stage_fd = open_root(str(tmp_path))
    try:
        with pytest.raises(st.SyncError):
            st.extract_checked(tar_of([("../evil", "file", b"x", 0o644)]), stage_fd)
        os.symlink(str(tmp_path.parent), str(tmp_path / "up"))
        with pytest.raises(OSError):
            st.extract_checked(tar_of([("up/evil", "file", b"x", 0o644)]), stage_fd)
    finally:
        os.close(stage_fd)
    assert not (tmp_path.parent / "evil").exists()


def flat_tree(root, count):
    for d in range(count // 250):
        os.makedirs(os.path.join(root, "d%02d" % d))
        for f in range(250):
            with open(os.path.join(root, "d%02d" % d, "f%03d" % f), "wb") as out:
                out.write(b"x")


def test_archive_memory_does_not_grow_with_the_tree(tmp_path):
    """Writing a tar of 4,000 entries and extracting it keep no header per member (tarfile would keep them all)."""
    src, stage = tmp_path / "src", tmp_path / "stage"
    flat_tree(str(src), 4_000)
    os.mkdir(stage)
    fd, stage_fd = open_root(str(src)), open_root(str(stage))
    paths = [e.path for e in st.walk(fd) if e.path != b"."]
    tar_path = str(tmp_path / "x.tar")
    tracemalloc.start()
    try:
        with open(tar_path, "wb") as out:
            written = st.tar_selected(fd, iter(paths), out)
        write_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        with open(tar_path, "rb") as f:
            st.extract_checked(f, stage_fd)
        extract_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        os.close(fd)
        os.close(stage_fd)
    del paths
    assert written == 4_016 and len(os.listdir(stage / "d15")) == 250
    # bounded by the copy chunk; 4,016 kept TarInfo headers would add about 2 MB
    bound = st.HASH_CHUNK + 512 * 1024
    assert write_peak < bound, "writing 4,016 members peaked at %d bytes" % write_peak
    assert extract_peak < bound, "extracting 4,016 members peaked at %d bytes" % extract_peak
