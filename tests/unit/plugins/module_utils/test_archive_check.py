"""The controller-side check of a workspace archive (module_utils/archive_check.py)."""
import io
import tarfile

import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils.archive_check import (
    ArchiveRefused, check_archive, sha256_file)


def make_tar(path, members, mode="w:gz"):
    """members: (name, kind, value): kind file (value = bytes), dir, sym / lnk (value = link name), fifo."""
    with tarfile.open(str(path), mode) as tar:
        for name, kind, value in members:
            info = tarfile.TarInfo(name)
            data = None
            if kind == "file":
                info.size = len(value)
                info.mode = 0o644
                data = io.BytesIO(value)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
            elif kind == "sym":
                info.type = tarfile.SYMTYPE
                info.linkname = value
            elif kind == "lnk":
                info.type = tarfile.LNKTYPE
                info.linkname = value
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            elif kind == "chr":
                info.type = tarfile.CHRTYPE
            tar.addfile(info, data)
    return str(path)


GOOD = [("./home", "dir", None), ("./home/a.txt", "file", b"a\n"), ("./home/run.sh", "file", b"#!/bin/sh\n"),
        ("./home/link", "sym", "a.txt"), ("./home/abs", "sym", "/workspace/home/a.txt"),
        ("./home/up", "sym", "../home/a.txt"), ("./home/hard", "lnk", "./home/a.txt")]


def test_a_good_archive_is_summarized(tmp_path):
    path = make_tar(tmp_path / "good.tar.gz", GOOD)
    summary = check_archive(path, "/workspace")
    assert summary == {"members": 7, "files": 2, "dirs": 1, "symlinks": 3, "hardlinks": 1, "size": 12}


def test_a_plain_tar_is_read_too(tmp_path):
    path = make_tar(tmp_path / "good.tar", GOOD, mode="w")
    assert check_archive(path, "/workspace")["members"] == 7


@pytest.mark.parametrize("member, reason", [
    (("../evil", "file", b"x"), "path leaves the target"),
    (("./home/../../evil", "file", b"x"), "path leaves the target"),
    (("/etc/passwd", "file", b"x"), "absolute path"),
    (("./home/esc", "sym", "../../etc/passwd"), "leaves the target"),
    (("./esc", "sym", "/etc"), "outside /workspace"),
    (("./esc", "sym", "/workspace2/x"), "outside /workspace"),
    (("./h", "lnk", "../etc/passwd"), "hard link"),
    (("./h", "lnk", "/etc/passwd"), "hard link"),
    (("./p", "fifo", None), "special file"),
    (("./c", "chr", None), "special file"),
    (("./e", "sym", ""), "empty target"),
])
def test_an_escaping_member_refuses_the_whole_archive(tmp_path, member, reason):
    path = make_tar(tmp_path / "bad.tar.gz", GOOD + [member])
    with pytest.raises(ArchiveRefused) as err:
        check_archive(path, "/workspace")
    assert err.value.offending and err.value.offending[0].startswith(member[0] + " ("), err.value.offending
    assert reason in str(err.value) and member[0] in str(err.value)
    assert "nothing was extracted" in str(err.value)


def test_a_member_through_a_link_of_the_archive_is_refused(tmp_path):
    # the link itself stays inside, but what is written through it lands wherever the link points in the guest
    path = make_tar(tmp_path / "through.tar.gz", [("./d", "sym", "sub"), ("./d/x", "file", b"x")])
    with pytest.raises(ArchiveRefused) as err:
        check_archive(path, "/workspace")
    assert "./d/x" in str(err.value) and "through the link d" in str(err.value)


def test_links_are_judged_against_the_chosen_subfolder(tmp_path):
    path = make_tar(tmp_path / "sub.tar.gz", [("./a", "file", b"a"), ("./l", "sym", "/workspace/other/a")])
    assert check_archive(path, "/workspace")["symlinks"] == 1
    with pytest.raises(ArchiveRefused) as err:
        check_archive(path, "/workspace/restored")
    assert "outside /workspace/restored" in str(err.value)
    rel = make_tar(tmp_path / "rel.tar.gz", [("./l", "sym", "../x")])
    with pytest.raises(ArchiveRefused):
        check_archive(rel, "/workspace/restored")


def test_every_offending_member_is_named(tmp_path):
    path = make_tar(tmp_path / "many.tar.gz", GOOD + [("../a", "file", b"1"), ("/b", "file", b"2"), ("./c", "sym", "/")])
    with pytest.raises(ArchiveRefused) as err:
        check_archive(path, "/workspace")
    assert [o.split(" (")[0] for o in err.value.offending] == ["../a", "/b", "./c"]
    assert "offending members" in str(err.value)


def test_not_a_tar(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not a tar archive" * 40)
    with pytest.raises(ArchiveRefused) as err:
        check_archive(str(junk), "/workspace")
    assert "not a readable tar archive" in str(err.value)


def test_sha256_file(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    assert sha256_file(str(f)) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize("members,offender", [
    ([("d", "sym", "."), ("e", "sym", "d/d/d/../..")], "e"),
    ([("d", "sym", "."), ("ok.txt", "file", b"x"), ("e", "sym", "d/d/d/../../escape.txt")], "e"),
    ([("sub", "dir", None), ("sub/up", "sym", ".."), ("x", "sym", "sub/up/..")], "x"),
    ([("a", "sym", "/workspace/d/.."), ("d", "sym", ".")], "a"),
    ([("a", "sym", "b"), ("b", "sym", "a")], "a"),
    # the link read first is fine alone; the one after changes where it leads
    ([("e", "sym", "d/../x"), ("d", "sym", "..")], "d"),
    # lexically d/../../x leaves; through d -> sub/inner it lands on x, inside
    ([("d", "sym", "sub/inner"), ("sub", "dir", None), ("e", "sym", "d/../../x")], None),
], ids=["chain", "chain-after-a-file", "up-then-up", "absolute-through-a-link", "loop", "later-link", "inside-chain"])
def test_symbolic_links_are_resolved_through_the_archives_own_links(tmp_path, members, offender):
    path = make_tar(tmp_path / "links.tar", members, mode="w")
    if offender is None:
        assert check_archive(path, "/workspace")["symlinks"] == 2
        return
    with pytest.raises(ArchiveRefused) as err:
        check_archive(path, "/workspace")
    assert offender in [o.split(" (")[0] for o in err.value.offending], err.value.offending


def test_names_longer_than_the_file_system_allows_are_refused(tmp_path):
    path = make_tar(tmp_path / "long.tar", [("ok.txt", "file", b"x"), ("d/" + "n" * 256, "file", b"x"),
                                            ("/".join(["p" * 200] * 21), "file", b"x")], mode="w")
    with pytest.raises(ArchiveRefused) as err:
        check_archive(path, "/workspace")
    assert [o.split(" (")[1].split(",")[0] for o in err.value.offending] == ["a name of 256 bytes",
                                                                             "a path of 4231 bytes once extracted"]


def test_checking_keeps_no_header_per_member(tmp_path):
    """A tar of 5,000 files is checked without keeping its headers (tarfile would keep every one)."""
    import tracemalloc
    path = tmp_path / "many.tar"
    with tarfile.open(str(path), mode="w") as tar:
        for i in range(5_000):
            info = tarfile.TarInfo("d/f%05d" % i)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    tracemalloc.start()
    try:
        summary = check_archive(str(path), "/workspace/x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert summary["files"] == 5_000
    assert peak < 1024 * 1024, "checking 5,000 members peaked at %d bytes" % peak
