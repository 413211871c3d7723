"""Cut WebSockets mid-upload, mid-download and mid-command, through the real tunnel, gRPC and guest agent."""
import hashlib
import os
import threading
import time

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors

MIB = 1 << 20


def write(path, size, seed):
    block = hashlib.sha256(seed).digest() * (MIB // 32)
    with open(path, "wb") as f:
        for _mib in range(size // MIB):
            f.write(block)
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def guest_sha(direct, path):
    """(sha256 of the guest file or '', names in its directory)."""
    r = direct.exec(["sh", "-c", "if [ -e %s ]; then sha256sum %s | cut -d' ' -f1; else echo; fi; ls -A $(dirname %s)"
                     % (path, path, path)])
    lines = r.stdout.decode().split("\n")
    return lines[0], [n for n in lines[1:] if n]


def eventually(probe, want, timeout=20):
    """The agent notices a cut connection asynchronously: wait (bounded) for its clean-up, then compare."""
    deadline = time.monotonic() + timeout
    got = probe()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.2)
        got = probe()
    return got


@pytest.mark.parametrize("bulk", [False, True], ids=["channel", "bulk"])
@pytest.mark.parametrize("existing", [True, False], ids=["replace", "new"])
def test_upload_cut_midstream_leaves_old_or_nothing(plane, sandbox, proxy, agents, tmp_path, existing, bulk):
    sid = sandbox["session_id"]
    direct = agents(plane.url, plane.token, sid)
    dest = "/workspace/up/target.bin"
    old, new = tmp_path / "old", tmp_path / "new"
    old_sha = write(old, 2 * MIB, b"old")
    write(new, 8 * MIB, b"new")
    if existing:
        direct.upload(str(old), dest)
    else:
        direct.exec(["mkdir", "-p", "/workspace/up"])
    assert guest_sha(direct, dest)[0] == (old_sha if existing else "")

    proxy.cut_ws(up=3 * MIB)
    cut = agents(proxy.url, plane.token, sid, bulk=bulk)
    with pytest.raises(errors.SandboxError) as err:
        cut.upload(str(new), dest)
    assert isinstance(err.value, errors.GuestUnavailable), err.value
    assert proxy.cuts == ["cut-up"]

    assert guest_sha(direct, dest)[0] == (old_sha if existing else ""), "the destination changed after a cut upload"
    # the agent's temporary name goes away once it notices the cut
    names = eventually(lambda: guest_sha(direct, dest)[1], ["target.bin"] if existing else [])
    assert names == (["target.bin"] if existing else []), "a partial or temporary file was left: %r" % names
    assert guest_sha(direct, dest)[0] == (old_sha if existing else "")


@pytest.mark.parametrize("bulk", [False, True], ids=["channel", "bulk"])
def test_download_cut_midstream_leaves_no_partial_file(plane, sandbox, proxy, agents, tmp_path, bulk):
    sid = sandbox["session_id"]
    direct = agents(plane.url, plane.token, sid)
    src = tmp_path / "src"
    write(src, 8 * MIB, b"down")
    direct.upload(str(src), "/workspace/big.bin")
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.bin").write_bytes(b"previous content")

    proxy.cut_ws(down=3 * MIB)
    cut = agents(proxy.url, plane.token, sid, bulk=bulk)
    for name in ("fresh.bin", "kept.bin"):
        with pytest.raises(errors.SandboxError):
            cut.download("/workspace/big.bin", str(out / name))
        proxy.cut_ws(down=3 * MIB)  # the channel redials: cut the next WebSocket too
    assert sorted(os.listdir(out)) == ["kept.bin"], "a partial download was left: %r" % os.listdir(out)
    assert (out / "kept.bin").read_bytes() == b"previous content"
    assert proxy.cuts[:2] == ["cut-down", "cut-down"], proxy.cuts


def test_command_cut_is_lost_and_never_rerun(plane, sandbox, proxy, agents):
    sid = sandbox["session_id"]
    direct = agents(plane.url, plane.token, sid)
    # the command appends one line, then writes output until the WebSocket is cut after 256 KiB
    script = "echo run >> /workspace/runs.txt; head -c 4000000 /dev/zero; sleep 2"
    proxy.cut_ws(down=256 * 1024)
    cut = agents(proxy.url, plane.token, sid)
    with pytest.raises(errors.CommandLost) as err:
        cut.exec(["sh", "-c", script])
    assert "not re-run" in str(err.value)
    # let any (wrong) retry happen before counting: the very next command through the same client works (the lost
    # stream dropped its connection, so the next call dials afresh instead of going down the cut one)
    assert cut.exec(["true"]).exit_code == 0
    assert direct.exec(["cat", "/workspace/runs.txt"]).stdout == b"run\n"


def test_a_slow_fresh_connection_still_carries_the_command(plane, sandbox, proxy, agents):
    """A fresh tunnel whose first bytes take a second (a busy API, a redial after a cut) carries the command:
    gRPC waits for the agent's SETTINGS frame instead of abandoning the attempt and failing the call unsent."""
    sid = sandbox["session_id"]
    direct = agents(plane.url, plane.token, sid)
    slow = agents(proxy.url, plane.token, sid)
    proxy.stall_ws()
    release = threading.Timer(1.0, proxy.release_ws)
    release.start()
    try:
        assert slow.exec(["sh", "-c", "echo slow >> /workspace/slow.txt"]).exit_code == 0
    finally:
        release.join()
    assert direct.exec(["cat", "/workspace/slow.txt"]).stdout == b"slow\n"
