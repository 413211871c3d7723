"""Framing and mux placement: the stdlib-only protocol between worker and mux."""
import dataclasses
import os
import socket
import stat
import struct
import threading

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import config, errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_json_and_bytes_round_trip(pair):
    a, b = pair
    mp.send_frame(a, mp.REQUEST, {"op": "exec", "argv": ["echo", "ünï ☃"]})
    mp.send_frame(a, mp.STDIN, b"\x00\xffbinary")
    mp.send_frame(a, mp.STDIN_EOF)
    assert mp.recv_frame(b) == (mp.REQUEST, {"op": "exec", "argv": ["echo", "ünï ☃"]})
    assert mp.recv_frame(b) == (mp.STDIN, b"\x00\xffbinary")
    assert mp.recv_frame(b) == (mp.STDIN_EOF, b"")


def test_big_frame_round_trip(pair):
    a, b = pair
    data = os.urandom(3 * 1024 * 1024)
    t = threading.Thread(target=mp.send_frame, args=(a, mp.STDOUT, data))
    t.start()
    assert mp.recv_frame(b) == (mp.STDOUT, data)
    t.join()


def test_clean_eof_is_none_and_eof_mid_frame_is_an_error(pair):
    a, b = pair
    a.sendall(mp.HEADER.pack(10, mp.STDOUT) + b"abc")
    a.close()
    with pytest.raises(mp.ProtocolError, match="after 3 of 10 bytes"):
        mp.recv_frame(b)
    c, d = socket.socketpair()
    c.close()
    assert mp.recv_frame(d) is None
    d.close()


def test_oversized_frame_and_bad_json_are_refused(pair):
    a, b = pair
    a.sendall(struct.pack("!IB", mp.MAX_FRAME + 1, mp.STDOUT))
    with pytest.raises(mp.ProtocolError, match="larger than the limit"):
        mp.recv_frame(b)
    c, d = socket.socketpair()
    c.sendall(mp.HEADER.pack(3, mp.RESULT) + b"{x]")
    with pytest.raises(mp.ProtocolError, match="bad JSON"):
        mp.recv_frame(d)
    c.close()
    d.close()


def test_encode_matches_send_frame(pair):
    a, b = pair
    a.sendall(mp.encode(mp.EXIT, {"rc": 3}))
    assert mp.recv_frame(b) == (mp.EXIT, {"rc": 3})


def test_session_key_is_per_url_prefix_session_port_and_token():
    base = mp.link_key("http://h:1/", "/v2/agents", "s1", 8443, "t")
    assert base == mp.link_key("http://h:1", "/v2/agents", "s1", 8443, "t")
    others = {mp.link_key("http://h:2", "/v2/agents", "s1", 8443, "t"),
              mp.link_key("http://h:1", "/v2/harness-runtime", "s1", 8443, "t"),
              mp.link_key("http://h:1", "/v2/agents", "s2", 8443, "t"),
              mp.link_key("http://h:1", "/v2/agents", "s1", 9000, "t"),
              mp.link_key("http://h:1", "/v2/agents", "s1", 8443, "another token")}
    assert base not in others and len(others) == 5
    assert len(base) == 24 and "token" not in mp.link_key("http://h:1", "/v2/agents", "s1", 8443, "token")


def test_one_process_dir_per_user_slot_and_protocol():
    digest = config.PROTOCOL_DIGEST
    assert config.process_dir("/b", 0, uid=7) == "/b/mux-7-0-p" + digest
    assert config.process_dir("/b", 1, uid=7) != config.process_dir("/b", 0, uid=7) != config.process_dir("/b", 0, uid=8)
    assert config.PROCESS_DIR_NAME.match("mux-7-0-p" + digest).groups() == ("7", "0", digest)
    assert config.PROCESS_DIR_NAME.match("mux-7-0").groups() == ("7", "0", None)  # a mux of an older collection
    keys = [mp.link_key("http://h", "/v2/agents", "s%d" % i, 8443, "t") for i in range(64)]
    assert {mp.pool_slot(k, 4) for k in keys} == {0, 1, 2, 3}
    assert {mp.pool_slot(k, 1) for k in keys} == {0}


def test_the_protocol_digest_changes_with_the_version_and_the_session_settings():
    """A collection that adds a LinkConfig field, or bumps the version, gets its own mux dir (an older mux would
    refuse the new attach request), without anyone remembering to bump anything."""
    fields = [f.name for f in dataclasses.fields(config.LinkConfig)]
    assert config.protocol_digest() == config.protocol_digest(mp.PROTOCOL_VERSION, reversed(fields)) == config.PROTOCOL_DIGEST
    assert config.protocol_digest(fields=fields + ["new_setting"]) != config.PROTOCOL_DIGEST
    assert config.protocol_digest(fields=fields[:-1]) != config.PROTOCOL_DIGEST
    assert config.protocol_digest(mp.PROTOCOL_VERSION + 1) != config.PROTOCOL_DIGEST
    assert config.process_dir("/b", 0, digest=config.protocol_digest(fields=fields + ["x"])) != config.process_dir("/b", 0)


def test_private_dir_is_0700_and_fixed_when_loose(tmp_path):
    d = str(tmp_path / "a" / "b")
    mp.private_dir(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    mp.private_dir(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def _refused(path, *words):
    with pytest.raises(errors.UnusableDirectory) as e:
        mp.private_dir(path)
    text = str(e.value)
    assert path in text and "MICROVM_MUX_DIR" in text and all(w in text for w in words), text
    assert e.value.kind == errors.ERR_UNREACHABLE  # the task says it; never "the mux hung up"
    return text


def test_private_dir_refuses_a_file_and_a_symlink(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    _refused(str(f), "not a directory")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    _refused(str(link), "symbolic link")
    with pytest.raises(errors.UnusableDirectory, match="cannot be opened as a directory of its own"):
        mp.SocketDir(str(link))  # O_NOFOLLOW: a symlink swapped in after the check is refused too


def test_a_dir_of_another_user_is_refused_naming_the_fix(tmp_path, monkeypatch):
    """Another local user made the dir first (a name it could guess): refused with the path, the cause and the fix."""
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(d, 12345, 12345)
    else:  # not root: we are "another user" to our own dir
        monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 1)
    text = _refused(str(d), "owned by uid")
    assert "set the connection option mux_dir" in text
    with pytest.raises(errors.UnusableDirectory, match="owned by uid"):
        mp.connect_in(str(d))  # a worker never connects into it either
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700  # and it is not touched


def test_a_mode_that_cannot_be_fixed_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "loose"
    d.mkdir()
    os.chmod(d, 0o755)

    def no_chmod(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "chmod", no_chmod)
    _refused(str(d), "0755", "cannot be made 0700")


def test_a_socket_in_a_very_long_dir_is_bound_and_reached_through_the_dir(tmp_path):
    """sun_path holds 108 bytes: a long dir is reached through its descriptor, never a shared short name in /tmp."""
    long_dir = str(tmp_path / ("h" * 120) / ("i" * 120))
    mp.private_dir(long_dir)
    with mp.SocketDir(long_dir) as d:
        address = d.address(mp.SOCKET_NAME)
        assert address.startswith(mp.PROC_FD + "/") and len(address.encode()) <= mp.SUN_PATH_MAX
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(1)
    try:
        assert os.path.exists(os.path.join(long_dir, mp.SOCKET_NAME))
        peer = mp.connect_in(long_dir, timeout=5)
        conn = listener.accept()[0]
        peer.sendall(b"x")
        assert conn.recv(1) == b"x"
        peer.close()
        conn.close()
    finally:
        listener.close()
