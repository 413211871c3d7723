"""Framing and mux placement: the stdlib-only protocol between worker and mux."""
import os
import socket
import stat
import struct
import threading

import pytest

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


def test_one_process_dir_per_user_and_slot():
    assert mp.process_dir("/b", 0, uid=7) == "/b/mux-7-0"
    assert mp.process_dir("/b", 1, uid=7) != mp.process_dir("/b", 0, uid=7) != mp.process_dir("/b", 0, uid=8)
    keys = [mp.link_key("http://h", "/v2/agents", "s%d" % i, 8443, "t") for i in range(64)]
    assert {mp.pool_slot(k, 4) for k in keys} == {0, 1, 2, 3}
    assert {mp.pool_slot(k, 1) for k in keys} == {0}


def test_private_dir_is_0700_and_fixed_when_loose(tmp_path):
    d = str(tmp_path / "a" / "b")
    mp.private_dir(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    mp.private_dir(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_private_dir_refuses_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(OSError):
        mp.private_dir(str(f))
