"""The sync layers that face a hostile tree, without a sandbox, each run with openat2 and with the per-component
O_NOFOLLOW walk: property tests over random trees of links (relative, absolute, chains, `..`, loops, to files
and directories) across repeated pulls and pushes, checking that nothing outside the destination changed."""
import io
import os
import stat

import hypothesis
import pytest
from hypothesis import strategies as hst

from ansible_collections.microvm.sandbox.plugins.action import sync as sync_action
from ansible_collections.microvm.sandbox.plugins.module_utils.archive_check import ArchiveRefused, check_archive
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import sync_plan as sp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import sync_tree as st

SETTINGS = dict(deadline=None, suppress_health_check=list(hypothesis.HealthCheck), derandomize=True)
NAMES = ["a", "b", "d", "logs"]
EXAMPLES = int(os.environ.get("SYNC_PROPERTY_EXAMPLES", "60"))
OUT = "@OUT@"  # replaced by the absolute path of a directory outside every tree


@pytest.fixture(params=["openat2", "walk"])
def resolver(request):
    """Every test here runs twice: paths below a directory fd opened with openat2, then with the O_NOFOLLOW walk."""
    if request.param == "openat2" and not st.use_openat2(True):
        pytest.skip("this kernel (or a seccomp filter) has no openat2")
    if request.param == "walk":
        st.use_openat2(False)
    yield request.param
    st.use_openat2(None)


def test_the_kernel_here_has_openat2():
    """The suite's machine must exercise the openat2 path, not only the fallback."""
    assert st.use_openat2(True)
    st.use_openat2(None)


# ------------------------------------------------------------------ random trees

TARGET = hst.one_of(
    hst.lists(hst.sampled_from(["..", ".", "a", "b", "d", "logs", "x"]), min_size=1, max_size=7).map("/".join),
    hst.sampled_from([OUT, OUT + "/f", "/etc", "/", "d/d/d/../../../" + "x", "../../../../../../" + "x"]),
)
ENTRY = hst.tuples(hst.lists(hst.sampled_from(NAMES), min_size=1, max_size=3),
                   hst.sampled_from(["f", "d", "l", "l", "l"]), TARGET)
TREE = hst.lists(ENTRY, max_size=12)


def build(root, spec, outside):
    """Make the tree spec under root, never through a link (entries whose parent is not a directory are skipped)."""
    os.makedirs(root, exist_ok=True)
    for parts, kind, target in spec:
        here = root
        for part in parts[:-1]:
            here = os.path.join(here, part)
            if not os.path.lexists(here):
                os.mkdir(here)
            elif not stat.S_ISDIR(os.lstat(here).st_mode):
                break
        else:
            path = os.path.join(here, parts[-1])
            if os.path.lexists(path):
                continue
            if kind == "f":
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                os.write(fd, ("content of %s\n" % "/".join(parts)).encode())
                os.close(fd)
            elif kind == "d":
                os.mkdir(path)
            else:
                os.symlink(target.replace(OUT, outside), path)


def snapshot(root, *skip):
    """{path: what it is} for everything under root except the subtrees skip, links never followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skip]
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if full in skip:
                continue
            s = os.lstat(full)
            if stat.S_ISLNK(s.st_mode):
                out[full] = ("l", os.readlink(full))
            elif stat.S_ISDIR(s.st_mode):
                out[full] = ("d", s.st_mode)
            else:
                with open(full, "rb") as f:
                    out[full] = ("f", s.st_mode, f.read())
    return out


def arena(tmp):
    """tmp/outside (a victim dir with a file and a subdir), tmp/area/<dest>, a sibling of dest with a file."""
    outside = os.path.join(tmp, "outside")
    os.makedirs(os.path.join(outside, "sub"), exist_ok=True)
    with open(os.path.join(outside, "f"), "w") as f:
        f.write("victim\n")
    os.makedirs(os.path.join(tmp, "area", "sibling"), exist_ok=True)
    with open(os.path.join(tmp, "area", "sibling", "g"), "w") as f:
        f.write("sibling\n")
    return outside


# ------------------------------------------------------------------ one run of each direction, without a sandbox

def pull(src, dest, work, delete, hostile):
    """The controller's side of a pull (sync._pull_tree and _apply_local) with src as the guest's tree.

    hostile: the guest sends every link (its own check off) and packs every entry, asked for or not.
    """
    src_fd = os.open(src, st.DIR_FLAGS)
    dest_fd = st.open_root(dest, create=True)
    try:
        manifest = list(st.walk(src_fd, skip_unsafe_links=not hostile))
        wanted_path, ops_path, tar_path = (os.path.join(work, n) for n in ("wanted", "ops", "changes.tar"))
        wanted = []
        with open(ops_path, "wb") as ops:
            planner = sp.Planner(lambda e, ancestor_only=False: wanted.append(e.path), ops.write, delete=delete)
            planner.run(st.source_entries(iter(manifest), private_root=True), st.walk(dest_fd))
        with open(wanted_path, "wb") as f:
            f.write(b"".join(p + b"\0" for p in wanted))
        packed = [e.path for e in manifest if e.path != st.ROOT] if hostile else wanted
        with open(tar_path, "wb") as f:
            st.tar_selected(src_fd, iter(packed), f)
        args = {"preserve_setid": False}
        try:
            check_archive(tar_path, dest)
            sync_action.ActionModule._apply_local(dest_fd, tar_path, ops_path, None, dest, args, wanted_path)
        except (st.SyncError, ArchiveRefused, sync_action.SyncFailed):
            pass  # a refused pull is an answer too; what matters is what it left outside dest
        return planner
    finally:
        os.close(src_fd)
        os.close(dest_fd)


def push(src, dest, work, delete):
    """A push: the controller's plan and archive (sync._push_tree), then the guest's side (guest_push) on dest,
    with extract_checked standing in for the agent's Upload into the stage."""
    src_fd = os.open(src, st.DIR_FLAGS)
    dest_fd = st.open_root(dest, create=True)
    stage = os.path.join(work, "stage")
    os.mkdir(stage, 0o700)
    stage_fd = os.open(stage, st.DIR_FLAGS)
    try:
        tar_path = os.path.join(work, "push.tar")
        ops = io.BytesIO()
        writer = sync_action.TarWriter(tar_path, src_fd)
        try:
            planner = sp.Planner(writer.add, ops.write, delete=delete)
            local = st.source_entries(st.walk(src_fd, skip_unsafe_links=True))
            planner.run(local, st.walk(dest_fd))
        finally:
            writer.close()
        if writer.members:
            try:
                check_archive(tar_path, "/workspace/stage")
            except ArchiveRefused:
                return planner  # a loop of links, say: refused whole (the task fails), nothing written
            with open(tar_path, "rb") as f:
                st.extract_checked(f, stage_fd)
            st.apply_stage(stage_fd, dest_fd)
        st.run_ops(dest_fd, st.split_stream([ops.getvalue()]))
        return planner
    finally:
        os.close(stage_fd)
        os.close(src_fd)
        os.close(dest_fd)
        st.remove_entry(os.open(work, st.DIR_FLAGS), b"stage", b"stage")


def fresh(path):
    if os.path.lexists(path):
        st.remove_entry(os.open(os.path.dirname(path), st.DIR_FLAGS), os.fsencode(os.path.basename(path)), b"x")
    os.makedirs(path)


# ------------------------------------------------------------------ properties

@hypothesis.settings(max_examples=EXAMPLES, **SETTINGS)
@hypothesis.given(rounds=hst.lists(hst.tuples(TREE, TREE, hst.booleans(), hst.booleans()), min_size=1, max_size=3))
def test_pulls_never_change_anything_outside_dest(resolver, tmp_path_factory, rounds):
    """Random guest trees (honest or hostile) pulled again and again into a dest that already holds random links
    of its own: everything outside dest, the guest's tree included, is as it was."""
    tmp = str(tmp_path_factory.mktemp("pull"))
    outside = arena(tmp)
    dest = os.path.join(tmp, "area", "D")
    work = os.path.join(tmp, "work")
    os.makedirs(work)
    first = True
    for guest_tree, dest_tree, delete, hostile in rounds:
        src = os.path.join(tmp, "guest")
        fresh(src)
        build(src, guest_tree, outside)
        if first:
            build(dest, dest_tree, outside)  # the user's own links, some of them out of dest
            first = False
        before = snapshot(tmp, dest, work)
        pull(src, dest, work, delete, hostile)
        assert snapshot(tmp, dest, work) == before
        assert not [n for n in os.listdir(os.path.join(tmp, "area")) if n.startswith(".microvm-sync")]


@hypothesis.settings(max_examples=EXAMPLES, **SETTINGS)
@hypothesis.given(rounds=hst.lists(hst.tuples(TREE, TREE, hst.booleans()), min_size=1, max_size=3))
def test_pushes_never_change_anything_outside_dest(resolver, tmp_path_factory, rounds):
    """Random controller trees pushed again and again into a guest dest whose user keeps planting links (to the
    outside dir, to `/`, up with `..`, loops): nothing outside dest changes."""
    tmp = str(tmp_path_factory.mktemp("push"))
    outside = arena(tmp)
    dest = os.path.join(tmp, "area", "D")
    work = os.path.join(tmp, "work")
    os.makedirs(work)
    for src_tree, planted, delete in rounds:
        src = os.path.join(tmp, "src")
        fresh(src)
        build(src, src_tree, outside)
        build(dest, planted, outside)
        before = snapshot(tmp, dest, work)
        push(src, dest, work, delete)
        assert snapshot(tmp, dest, work) == before


@hypothesis.settings(max_examples=200, **SETTINGS)
@hypothesis.given(spec=TREE, path=hst.lists(hst.sampled_from(NAMES), min_size=1, max_size=4))
def test_open_beneath_opens_what_a_walk_without_links_reaches(resolver, tmp_path_factory, spec, path):
    """open_beneath(root, path) opens exactly the entry reached by lstat-ing each component with no link among
    them, and fails (ELOOP or ENOTDIR or ENOENT) wherever a link or a missing name is on the way."""
    tmp = str(tmp_path_factory.mktemp("beneath"))
    outside = arena(tmp)
    root = os.path.join(tmp, "area", "D")
    build(root, spec, outside)
    expected = None
    here = root
    for i, part in enumerate(path):
        here = os.path.join(here, part)
        try:
            s = os.lstat(here)
        except (FileNotFoundError, NotADirectoryError):
            break
        if stat.S_ISLNK(s.st_mode) or (i < len(path) - 1 and not stat.S_ISDIR(s.st_mode)):
            break
        if i == len(path) - 1:
            expected = (s.st_dev, s.st_ino)
    root_fd = os.open(root, st.DIR_FLAGS)
    try:
        fd = st.open_beneath(root_fd, "/".join(path).encode(), os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        assert expected is None, "refused an entry reached without links: %s" % e
    else:
        try:
            s = os.fstat(fd)
            assert expected == (s.st_dev, s.st_ino), "opened %s through a link" % "/".join(path)
        finally:
            os.close(fd)
    finally:
        os.close(root_fd)


def test_link_judged_against_dest_on_disk(resolver, tmp_path):
    """`x -> cache/sub` is inside as text; with dest's own `cache -> <outside>` it leads out: refused, nothing moved."""
    outside = arena(str(tmp_path))
    src, dest, work = (str(tmp_path / n) for n in ("guest", "area/D", "work"))
    os.makedirs(work)
    build(src, [(["x"], "l", "cache/sub"), (["a"], "f", "")], outside)
    build(dest, [(["cache"], "l", OUT)], outside)
    before = snapshot(str(tmp_path), dest, work)
    with pytest.raises(sync_action.SyncFailed, match="x .*leaves the target|x .*outside"):
        dest_fd = st.open_root(dest)
        try:
            src_fd = os.open(src, st.DIR_FLAGS)
            tar_path = os.path.join(work, "t.tar")
            with open(tar_path, "wb") as f:
                st.tar_selected(src_fd, iter([b"a", b"x"]), f)
            open(os.path.join(work, "ops"), "wb").close()
            with open(os.path.join(work, "wanted"), "wb") as f:
                f.write(b"a\0x\0")
            sync_action.ActionModule._apply_local(dest_fd, tar_path, os.path.join(work, "ops"), None, dest,
                                                  {"preserve_setid": False}, os.path.join(work, "wanted"))
        finally:
            os.close(dest_fd)
    assert sorted(os.listdir(dest)) == ["cache"] and snapshot(str(tmp_path), dest, work) == before


def test_archive_members_not_asked_for_are_refused(tmp_path):
    tree = str(tmp_path / "t")
    build(tree, [(["a"], "f", ""), (["b"], "f", "")], str(tmp_path))
    fd = os.open(tree, st.DIR_FLAGS)
    buf = io.BytesIO()
    st.tar_selected(fd, iter([b"a", b"b"]), buf)
    os.close(fd)
    os.mkdir(str(tmp_path / "stage"))
    stage = os.open(str(tmp_path / "stage"), st.DIR_FLAGS)
    try:
        with pytest.raises(st.SyncError, match="'b': not asked for"):
            st.extract_checked(io.BytesIO(buf.getvalue()), stage, wanted=iter([b"a"]))
    finally:
        os.close(stage)


def test_setid_bits_are_dropped_unless_kept(tmp_path):
    tree = str(tmp_path / "t")
    build(tree, [(["s"], "f", "")], str(tmp_path))
    os.chmod(os.path.join(tree, "s"), 0o6755)
    fd = os.open(tree, st.DIR_FLAGS)
    buf = io.BytesIO()
    st.tar_selected(fd, iter([b"s"]), buf)
    entries = {e.path: e.mode for e in st.source_entries(st.walk(fd), private_root=True)}
    os.close(fd)
    assert entries[b"s"] == 0o755
    for keep, mode in ((False, 0o755), (True, 0o6755)):
        stage = str(tmp_path / ("stage-%s" % keep))
        os.mkdir(stage)
        sfd = os.open(stage, st.DIR_FLAGS)
        st.extract_checked(io.BytesIO(buf.getvalue()), sfd, keep_setid=keep)
        os.close(sfd)
        assert stat.S_IMODE(os.lstat(os.path.join(stage, "s")).st_mode) == mode
    root = st.Entry(st.ROOT, st.KIND_DIR, 0o2777, 0, 0)
    assert next(st.source_entries(iter([root]), private_root=True)).mode == 0o775


def test_open_root_follows_links_of_the_named_path_but_not_out_of_the_workspace(resolver, tmp_path):
    ws = tmp_path / "ws"
    (ws / "real").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    os.symlink("real", str(ws / "rel"))
    os.symlink(str(ws / "real"), str(ws / "abs"))
    os.symlink(str(tmp_path / "elsewhere"), str(ws / "out"))
    os.symlink("../elsewhere", str(ws / "up"))
    for name in ("real", "rel", "abs"):
        fd = st.open_root(str(ws / name), workspace=str(ws))
        assert os.fstat(fd).st_ino == os.stat(str(ws / "real")).st_ino
        os.close(fd)
    for name in ("out", "up"):
        with pytest.raises(st.SyncError, match="outside"):
            st.open_root(str(ws / name / "new"), create=True, workspace=str(ws))
    assert os.listdir(str(tmp_path / "elsewhere")) == [], "created something outside the workspace"
    fd = st.open_root(str(ws / "rel" / "a" / "b"), create=True, workspace=str(ws))
    os.close(fd)
    assert os.path.isdir(str(ws / "real" / "a" / "b"))
    fd = st.open_root(str(ws / "out"))  # no workspace: the user named it, links are followed (like rsync)
    os.close(fd)


@pytest.mark.parametrize("paths", [
    [b"a"],                      # no root first
    [b".", b"b", b"a"],          # out of order
    [b".", b"a", b"a"],          # twice
    [b".", b"../x"],             # not a plain relative path
    [b".", b"/etc"],
    [b".", b"a//b"],
])
def test_a_manifest_that_is_not_plain_paths_in_order_is_refused(paths):
    entries = [st.Entry(p, st.KIND_DIR if p == st.ROOT else st.KIND_FILE, 0o644, 0, 0) for p in paths]
    with pytest.raises(st.SyncError):
        list(st.source_entries(iter(entries)))


def test_a_malformed_manifest_record_is_a_sync_error():
    reader = sp.ManifestReader(iter([b".\0dzz 0 0\0\0"]))
    with pytest.raises(st.SyncError, match="malformed"):
        list(reader.entries())
