"""beneath.open_beneath, on the host: one name below a held directory, never through a link, with openat2 and
without it (unit: the guest tests run the same code in real guests)."""
import errno
import os

import pytest

from microvm_localplane import beneath


@pytest.fixture(params=["openat2", "openat-nofollow"])
def mode(request, monkeypatch):
    if request.param == "openat2":
        if not beneath._probe_openat2():
            pytest.skip("this kernel has no openat2")
    else:
        monkeypatch.setattr(beneath, "_openat2", False)
    return request.param


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("inside")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "secret").write_text("outside")
    (tmp_path / "d" / "link").symlink_to(tmp_path / "out")
    (tmp_path / "d" / "flink").symlink_to(tmp_path / "out" / "secret")
    fd = os.open(tmp_path / "d", os.O_PATH | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def test_a_plain_name_opens_and_creates(mode, tree):
    root, d = tree
    fd = beneath.open_beneath("new", os.O_WRONLY | os.O_CREAT | os.O_EXCL, d, 0o640)
    os.write(fd, b"x")
    os.close(fd)
    assert (root / "d" / "new").read_bytes() == b"x"
    assert os.stat(root / "d" / "new").st_mode & 0o777 == 0o640 & ~_umask()


@pytest.mark.parametrize("name", ["link", "flink"])
def test_a_link_is_never_followed(mode, tree, name):
    _root, d = tree
    with pytest.raises(OSError) as e:
        beneath.open_beneath(name, os.O_RDONLY, d)
    assert e.value.errno == errno.ELOOP
    with pytest.raises(OSError) as e:  # a directory step refuses it too: the walk then reads the link itself
        beneath.open_beneath(name, beneath.DIR_FLAGS, d)
    assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)


@pytest.mark.parametrize("name", ["..", "link/secret", "../f", "/etc/passwd", ""])
def test_a_name_that_is_not_one_step_below_is_refused(mode, tree, name):
    _root, d = tree
    with pytest.raises(OSError) as e:
        beneath.open_beneath(name, os.O_RDONLY, d)
    assert e.value.errno == errno.EXDEV


def _umask():
    old = os.umask(0)
    os.umask(old)
    return old
