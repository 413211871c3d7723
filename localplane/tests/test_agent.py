"""The sandbox agent (contract section 3) through the real stack: bwrap guest, Guest.dial, gRPC."""
import hashlib
import io
import os
import json
import signal
import tarfile
import threading

import grpc
import hypothesis
import pytest
from guestkit import Interactive, Plane, download, guests_supported, rpc_error, run, sh, upload, wait_until

from microvm_localplane.pb import pb2

pytestmark = [pytest.mark.skipif(not guests_supported(), reason="needs root, runc and subordinate ids (make system-deps)"),
              pytest.mark.timeout(120)]
CODE = grpc.StatusCode


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(str(tmp_path_factory.mktemp("agent-state")))
    yield p
    p.close()


@pytest.fixture(scope="module")
def guest(plane):
    return plane.boot("agent-test", env={"SESSION_VAR": "from-session", "HOME_OVERRIDE": "x"})


@pytest.fixture(scope="module")
def stub(plane, guest):
    return plane.stub(guest)


# ------------------------------------------------------------------ Exec

def test_stdout_and_stderr_are_separate_frames(stub):
    r = sh(stub, "echo out; echo err >&2; echo out2")
    assert r.stdout == b"out\nout2\n"
    assert r.stderr == b"err\n"
    assert r.code == 0 and r.exit_count == 1 and r.exit_is_last


def test_exit_code_is_reported(stub):
    assert sh(stub, "exit 7").code == 7


def test_argv_has_no_shell(stub):
    r = run(stub, ["echo", "$HOME", "a b", ";", "*"])
    assert r.stdout == b"$HOME a b ; *\n"


def test_stdin_frames_arrive_in_order_and_half_close_is_eof(stub):
    frames = [b"%d\n" % i for i in range(300)]
    r = run(stub, ["cat"], stdin_frames=frames)
    assert r.stdout == b"".join(frames)
    assert r.code == 0


def test_half_close_without_stdin_is_eof(stub):
    r = run(stub, ["cat"])
    assert r.stdout == b"" and r.code == 0


def test_output_is_streamed_as_produced(stub):
    # The command waits for stdin after its first line: the line must arrive before the command ends.
    call = Interactive(stub, ["sh", "-c", "echo first; read reply; echo got:$reply"])
    first = call.next_frame()
    assert first.stdout == b"first\n"
    call.send_stdin(b"yes\n")
    call.half_close()
    rest = call.rest()
    assert b"".join(f.stdout for f in rest) == b"got:yes\n"
    assert rest[-1].exit.exit_code == 0


def test_missing_program_sends_one_exit_frame_127(stub):
    r = run(stub, ["/no/such/program", "arg"])
    assert r.exit_count == 1 and r.exit_is_last
    assert r.code == 127
    assert b"/no/such/program" in r.stderr


def test_program_not_executable_is_126(stub):
    upload(stub, "/workspace/not-exec.sh", b"#!/bin/sh\necho hi\n", mode=0o644)
    r = run(stub, ["/workspace/not-exec.sh"])
    assert r.exit_count == 1 and r.code == 126 and r.stderr


def test_missing_workdir_ends_with_exit_frame(stub):
    r = run(stub, ["true"], workdir="/workspace/no/such/dir")
    assert r.exit_count == 1 and r.code == 126
    assert b"/workspace/no/such/dir" in r.stderr


def test_workdir_defaults_to_workspace_and_home_is_workspace_home(stub):
    r = sh(stub, 'pwd; echo "$HOME"; test -d "$HOME" && echo home-exists')
    assert r.stdout == b"/workspace\n/workspace/home\nhome-exists\n"


def test_env_merges_over_baseline_and_session_env(stub):
    r = sh(stub, 'echo "$PATH|$SESSION_VAR|$REQ|$HOME"', env={"REQ": "from-request", "HOME": "/workspace/h2"})
    path, session_var, req, home = r.stdout.decode().strip().split("|")
    assert "/usr/bin" in path
    assert (session_var, req, home) == ("from-session", "from-request", "/workspace/h2")


def test_workdir_is_honoured(stub):
    assert run(stub, ["pwd"], workdir="/tmp").stdout == b"/tmp\n"


def test_timeout_kills_the_process_group_and_sets_timed_out(stub):
    r = sh(stub, "sleep 300 & echo $! > /workspace/bg.pid; wait", timeout_seconds=1)
    assert r.exit.timed_out is True
    assert r.code == 128 + signal.SIGTERM
    bg = int(download(stub, "/workspace/bg.pid")[1])
    # the background sleep was in the command's process group, so it is gone too
    assert wait_until(lambda: sh(stub, "kill -0 %d" % bg).code != 0)


def test_timeout_escalates_to_sigkill(stub):
    r = sh(stub, "trap '' TERM; echo ready; while :; do sleep 0.05; done", timeout_seconds=1)
    assert r.exit.timed_out is True
    assert r.code == 128 + signal.SIGKILL


def test_timeout_also_kills_group_members_that_ignore_sigterm(stub):
    r = sh(stub, "(trap '' TERM; sleep 300) & echo $! > /workspace/stubborn.pid; wait", timeout_seconds=1)
    assert r.exit.timed_out is True
    stubborn = int(download(stub, "/workspace/stubborn.pid")[1])
    assert wait_until(lambda: sh(stub, "kill -0 %d" % stubborn).code != 0)


def test_no_timeout_means_not_timed_out(stub):
    r = run(stub, ["true"])
    assert r.exit.timed_out is False and r.exit.duration_ms >= 0


def test_signal_goes_to_the_process_group(stub):
    call = Interactive(stub, ["sh", "-c", "trap 'echo got-usr1; exit 3' USR1; echo ready; while :; do sleep 0.05; done"])
    assert call.next_frame().stdout == b"ready\n"
    call.send_signal(signal.SIGUSR1)
    call.half_close()
    frames = call.rest()
    assert b"got-usr1" in b"".join(f.stdout for f in frames)
    assert frames[-1].exit.exit_code == 3


def test_sigterm_reports_signal_exit(stub):
    call = Interactive(stub, ["sh", "-c", "echo ready; exec sleep 300"])
    assert call.next_frame().stdout == b"ready\n"
    call.send_signal(signal.SIGTERM)
    frames = call.rest()
    assert frames[-1].exit.exit_code == 128 + signal.SIGTERM and frames[-1].exit.timed_out is False


def test_cancel_kills_the_process_group(stub):
    call = Interactive(stub, ["sh", "-c", "sleep 300 & echo $!; wait"])
    bg = int(call.next_frame().stdout)
    assert sh(stub, "kill -0 %d" % bg).code == 0
    call.call.cancel()
    assert wait_until(lambda: sh(stub, "kill -0 %d" % bg).code != 0)


def test_first_request_must_be_start(stub):
    code, msg = rpc_error(lambda: list(stub.Exec(iter([pb2.ExecRequest(stdin=b"x")]))))
    assert code == CODE.INVALID_ARGUMENT and "start" in msg
    code, _details = rpc_error(lambda: list(stub.Exec(iter([]))))
    assert code == CODE.INVALID_ARGUMENT


def test_empty_argv_is_invalid(stub):
    code, msg = rpc_error(lambda: list(stub.Exec(iter([pb2.ExecRequest(start=pb2.ExecStart(argv=[]))]))))
    assert code == CODE.INVALID_ARGUMENT and "argv" in msg


def test_exec_is_unconfined_and_writes_tmp(stub):
    r = sh(stub, "echo scratch > /tmp/agent-x && cat /tmp/agent-x && mktemp")
    assert r.code == 0 and r.stdout.startswith(b"scratch\n/tmp/")
    # ...but a transfer of the same path is refused, exactly like the platform
    code, msg = rpc_error(download, stub, "/tmp/agent-x")
    assert code == CODE.PERMISSION_DENIED and msg == 'path outside workspace: "/tmp/agent-x"'


def test_agent_survives_garbage_and_keeps_serving(stub):
    for bad in ([pb2.ExecRequest(signal=pb2.ExecSignal(signal=9999))],
                [pb2.ExecRequest(start=pb2.ExecStart(argv=["x\0y"]))],
                [pb2.ExecRequest(start=pb2.ExecStart(argv=["true"], timeout_seconds=-1))],
                [pb2.ExecRequest(start=pb2.ExecStart(argv=["true"], workdir="relative"))]):
        code, _details = rpc_error(lambda bad=bad: list(stub.Exec(iter(bad))))
        assert code == CODE.INVALID_ARGUMENT
    r = run(stub, ["sh", "-c", "cat >/dev/null; echo alive"],
            stdin_frames=[b"x"], env={})
    assert r.stdout == b"alive\n"


# ------------------------------------------------------------------ Upload / Download

def test_upload_download_round_trip_binary(stub):
    data = bytes(range(256)) * 5000 + b"\0tail"
    resp = upload(stub, "/workspace/bin/blob.bin", data)
    assert resp.path == "/workspace/bin/blob.bin" and resp.bytes_written == len(data)
    header, got, _chunks = download(stub, "/workspace/bin/blob.bin")
    assert got == data and header.size_bytes == len(data) and header.is_archive is False


def test_zero_byte_file(stub):
    assert upload(stub, "/workspace/empty", b"").bytes_written == 0
    header, data, chunks = download(stub, "/workspace/empty")
    assert data == b"" and header.size_bytes == 0 and chunks == []


def test_unicode_and_space_names(stub):
    path = "/workspace/dir with space/ünï cødé ✓.txt"
    upload(stub, path, "grüße\n".encode())
    assert download(stub, path)[1] == "grüße\n".encode()
    assert sh(stub, 'cat "%s"' % path).stdout == "grüße\n".encode()


def test_upload_creates_parents_and_applies_mode(stub):
    upload(stub, "/workspace/deep/a/b/c/file", b"x", mode=0o600)
    upload(stub, "/workspace/deep/default-mode", b"x")
    r = sh(stub, "stat -c %a /workspace/deep/a/b/c/file /workspace/deep/default-mode")
    assert r.stdout == b"600\n644\n"


def test_upload_replaces_existing_file(stub):
    upload(stub, "/workspace/replace.txt", b"old")
    upload(stub, "/workspace/replace.txt", b"new content")
    assert download(stub, "/workspace/replace.txt")[1] == b"new content"


def test_checksum_mismatch_leaves_destination_untouched(stub):
    upload(stub, "/workspace/keep/file.txt", b"original")
    code, msg = rpc_error(upload, stub, "/workspace/keep/file.txt", b"replacement", sha="0" * 64)
    assert code == CODE.INVALID_ARGUMENT and "sha256" in msg
    assert download(stub, "/workspace/keep/file.txt")[1] == b"original"
    assert sh(stub, "ls -A /workspace/keep").stdout == b"file.txt\n"  # no temporary left behind


def test_checksum_mismatch_on_new_file_creates_nothing(stub):
    code, _details = rpc_error(upload, stub, "/workspace/never.txt", b"data", sha="f" * 64)
    assert code == CODE.INVALID_ARGUMENT
    assert rpc_error(download, stub, "/workspace/never.txt")[0] == CODE.NOT_FOUND


def test_empty_sha_skips_the_check(stub):
    assert upload(stub, "/workspace/nosha", b"abc", sha="").bytes_written == 3


def test_upload_without_end_is_refused_and_leaves_nothing(stub):
    upload(stub, "/workspace/noend.txt", b"before")
    code, msg = rpc_error(upload, stub, "/workspace/noend.txt", b"after", end=False)
    assert code == CODE.INVALID_ARGUMENT and "UploadEnd" in msg
    assert download(stub, "/workspace/noend.txt")[1] == b"before"
    assert b".upload-" not in sh(stub, "ls -A /workspace").stdout


def test_upload_header_must_come_first(stub):
    code, msg = rpc_error(lambda: stub.Upload(iter([pb2.UploadRequest(chunk=b"x")])))
    assert code == CODE.INVALID_ARGUMENT and "header" in msg


def test_upload_onto_directory_is_refused(stub):
    sh(stub, "mkdir -p /workspace/adir")
    code, msg = rpc_error(upload, stub, "/workspace/adir", b"x")
    assert code == CODE.FAILED_PRECONDITION and "directory" in msg


def test_download_chunk_sizes(stub):
    data = os.urandom(10 * 1024 + 5)
    upload(stub, "/workspace/chunks.bin", data)
    _header, got, chunks = download(stub, "/workspace/chunks.bin", chunk_size=1024)
    assert got == data and chunks == [1024] * 10 + [5]
    for bad in (512, 4 * 1024 * 1024 + 1):
        code, msg = rpc_error(download, stub, "/workspace/chunks.bin", chunk_size=bad)
        assert code == CODE.INVALID_ARGUMENT and "chunk_size_bytes" in msg
    _header, _got, default_chunks = download(stub, "/workspace/chunks.bin")
    assert default_chunks == [len(data)]  # under the 256 KiB default: one chunk


def test_large_transfer_streams(stub):
    # 64 MiB through the agent both ways; the agent must not hold it in memory.
    rss_before = _agent_rss(stub)
    sh(stub, "head -c 67108864 /dev/urandom > /workspace/big.bin")
    expected = sh(stub, "sha256sum /workspace/big.bin | cut -d' ' -f1").stdout.strip().decode()
    digest, size = hashlib.sha256(), 0
    for frame in stub.Download(pb2.DownloadRequest(path="/workspace/big.bin", chunk_size_bytes=4 << 20)):
        if frame.WhichOneof("output") == "chunk":
            digest.update(frame.chunk)
            size += len(frame.chunk)
        elif frame.WhichOneof("output") == "end":
            assert frame.end.sha256 == expected
    assert size == 64 << 20 and digest.hexdigest() == expected
    assert _agent_rss(stub) - rss_before < 48 << 20


def _agent_rss(stub):
    out = sh(stub, "grep VmRSS /proc/$(cat /run/localplane/agent.pid)/status").stdout.split()
    return int(out[1]) * 1024


def test_download_missing_is_not_found(stub):
    code, msg = rpc_error(download, stub, "/workspace/missing-file")
    assert code == CODE.NOT_FOUND and "/workspace/missing-file" in msg


def test_download_directory_needs_archive(stub):
    code, msg = rpc_error(download, stub, "/workspace/home")
    assert code == CODE.FAILED_PRECONDITION and "as_archive" in msg


def test_archive_download_of_a_directory(stub):
    sh(stub, "mkdir -p /workspace/tree/sub && printf a > /workspace/tree/a.txt && printf bb > /workspace/tree/sub/b.txt"
             " && ln -sfn sub/b.txt /workspace/tree/link")
    header, data, _chunks = download(stub, "/workspace/tree", as_archive=True)
    assert header.is_archive is True and header.size_bytes == -1
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = sorted(tar.getnames())
        assert names == ["a.txt", "link", "sub", "sub/b.txt"]
        assert tar.extractfile("sub/b.txt").read() == b"bb"
        assert tar.getmember("link").linkname == "sub/b.txt"


def _tar(entries):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, kind, payload in entries:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, payload
                tar.addfile(info)
            elif kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, payload
                tar.addfile(info)
    return buf.getvalue()


def test_archive_upload_extracts_under_path(stub):
    data = _tar([("d", "dir", None), ("d/x.txt", "file", b"xx"), ("top.txt", "file", b"t"), ("ln", "symlink", "d/x.txt")])
    resp = upload(stub, "/workspace/unpacked", data, is_archive=True)
    assert resp.bytes_written == len(data)
    assert download(stub, "/workspace/unpacked/d/x.txt")[1] == b"xx"
    assert sh(stub, "readlink /workspace/unpacked/ln; cat /workspace/unpacked/top.txt").stdout == b"d/x.txt\nt"


def test_archive_round_trip(stub):
    sh(stub, "mkdir -p /workspace/rt/s && printf 1 > /workspace/rt/one && printf 2 > /workspace/rt/s/two")
    _header, data, _chunks = download(stub, "/workspace/rt", as_archive=True)
    upload(stub, "/workspace/rt-copy", data, is_archive=True)
    assert sh(stub, "cd /workspace && diff -r rt rt-copy && echo same").stdout == b"same\n"


@pytest.mark.parametrize("entries", [
    [("../escape.txt", "file", b"x")],
    [("/abs-escape.txt", "file", b"x")],
    [("out", "symlink", "/tmp")],
    [("out", "symlink", "../../tmp")],
    [("lnk", "symlink", "."), ("lnk/../../escape.txt", "file", b"x")],
    [("d", "dir", None), ("d/l", "symlink", ".."), ("d/l/m", "symlink", "..")],
    [("hl", "hardlink", "/etc/passwd")],
    [("d", "symlink", "."), ("e", "symlink", "d/d/d/../..")],
    [("d", "symlink", "."), ("ok.txt", "file", b"x"), ("e", "symlink", "d/d/d/../../escape.txt")],
    [("a", "dir", None), ("a/l", "symlink", "/workspace"), ("top", "symlink", "a/l/..")],
], ids=["dotdot", "absolute", "symlink-abs-out", "symlink-rel-out", "through-link", "link-chain", "hardlink-out",
        "symlink-chain", "symlink-chain-after-a-file", "absolute-link-then-dotdot"])
def test_escaping_archive_is_refused_and_writes_nothing(stub, entries):
    target = "/workspace/esc-%d" % abs(hash(str(entries)))
    code, msg = rpc_error(upload, stub, target, _tar(entries), is_archive=True)
    assert code in (CODE.PERMISSION_DENIED, CODE.INVALID_ARGUMENT), msg
    r = sh(stub, "test -e %s || echo no-target; test -e /workspace/escape.txt || echo no-escape;"
                 " test -e /tmp/escape.txt || echo no-tmp" % target)
    assert r.stdout == b"no-target\nno-escape\nno-tmp\n"


def test_archive_through_existing_symlink_out_is_refused(stub):
    sh(stub, "mkdir -p /workspace/arch-link && ln -sfn /tmp /workspace/arch-link/out")
    code, _details = rpc_error(upload, stub, "/workspace/arch-link", _tar([("out/x.txt", "file", b"x")]), is_archive=True)
    assert code == CODE.PERMISSION_DENIED
    assert sh(stub, "test -e /tmp/x.txt || echo clean").stdout == b"clean\n"


@pytest.mark.parametrize("path,limit", [
    ("/workspace/too-long/a/" + "n" * 300 + "/f", "NAME_MAX 255"),
    ("/workspace/too-deep/" + "/".join(["d" * 200] * 21) + "/f", "PATH_MAX 4096"),
], ids=["name", "path"])
@pytest.mark.parametrize("is_archive", [False, True])
def test_a_path_longer_than_the_file_system_allows_is_refused_and_creates_nothing(stub, path, limit, is_archive):
    payload = _tar([("f", "file", b"x")]) if is_archive else b"x"
    code, msg = rpc_error(upload, stub, path, payload, is_archive=is_archive)
    assert code == CODE.INVALID_ARGUMENT and limit in msg, msg
    assert sh(stub, "ls -A /workspace | grep -x -e too-long -e too-deep || echo none").stdout == b"none\n"


def test_an_archive_member_longer_than_the_file_system_allows_is_refused_whole(stub):
    entries = [("first.txt", "file", b"x"), ("sub", "dir", None), ("sub/" + "n" * 300, "file", b"x")]
    code, msg = rpc_error(upload, stub, "/workspace/long-member", _tar(entries), is_archive=True)
    assert code == CODE.INVALID_ARGUMENT and "NAME_MAX 255" in msg, msg
    assert sh(stub, "test -e /workspace/long-member || echo nothing").stdout == b"nothing\n"


@pytest.fixture
def small_archive_limits(guest):
    # The plane writes the guest's bounds into its run dir (`up --archive-max-members/--archive-max-bytes`).
    path = os.path.join(guest._layout.run, "agent-limits.json")
    with open(path, "w") as f:
        json.dump({"archive_max_members": 3, "archive_max_bytes": 100}, f)
    yield
    os.unlink(path)


@pytest.mark.parametrize("entries,limit", [
    ([("a", "file", b"1"), ("b", "file", b"2"), ("c", "file", b"3"), ("d", "file", b"4")], "archive_max_members"),
    ([("a", "file", b"1" * 60), ("b", "file", b"2" * 60)], "archive_max_bytes"),
], ids=["members", "bytes"])
def test_an_archive_over_the_planes_bounds_is_refused_and_writes_nothing(stub, small_archive_limits, entries, limit):
    dest = "/workspace/bounded-" + limit
    code, msg = rpc_error(upload, stub, dest, _tar(entries), is_archive=True)
    assert code == CODE.INVALID_ARGUMENT and limit in msg, msg
    assert sh(stub, "test -e %s || echo nothing" % dest).stdout == b"nothing\n"
    within = entries[:3] if limit == "archive_max_members" else entries[:1]
    upload(stub, dest, _tar(within), is_archive=True)
    assert sh(stub, "ls %s" % dest).stdout.split() == [e[0].encode() for e in within]


# A process in the guest exchanges a directory and a link out of /workspace as fast as it can (renameat2
# RENAME_EXCHANGE: the name always exists, as one or the other).
SWAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
n = 0
while not os.path.exists("stop"):
    if libc.renameat2(-100, b"d", -100, b"alt", 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
    n += 1
print(n)
"""


def test_a_directory_swapped_for_a_link_never_moves_a_transfer_outside(stub):
    sh(stub, "rm -rf /workspace/race /tmp/race-out; mkdir -p /workspace/race/d /tmp/race-out"
             " && echo inside > /workspace/race/d/secret && echo outside > /tmp/race-out/secret"
             " && ln -s /tmp/race-out /workspace/race/alt")
    swapped = {}
    swapper = threading.Thread(target=lambda: swapped.update(
        r=run(stub, ["python3", "-c", SWAPPER, "/workspace/race"], timeout_seconds=300)))
    swapper.start()
    outcomes = {"ok": 0, "refused": 0}
    unexpected = []
    try:
        for i in range(200):
            steps = [lambda i=i: upload(stub, "/workspace/race/d/f%d" % i, b"x"),
                     lambda i=i: upload(stub, "/workspace/race/d/sub%d/f" % i, b"x"),
                     lambda i=i: upload(stub, "/workspace/race/d/arch%d" % i, _tar([("m", "file", b"x")]), is_archive=True),
                     lambda: download(stub, "/workspace/race/d/secret")[1],
                     lambda: download(stub, "/workspace/race/d", as_archive=True)[1]]
            for step in steps:
                try:
                    got = step()
                except grpc.RpcError as e:
                    if e.code() not in (CODE.PERMISSION_DENIED, CODE.FAILED_PRECONDITION, CODE.NOT_FOUND):
                        unexpected.append((e.code(), e.details()))
                    outcomes["refused"] += 1
                    continue
                outcomes["ok"] += 1
                assert not (isinstance(got, bytes) and b"outside" in got), "read a file outside /workspace"
    finally:
        sh(stub, "touch /workspace/race/stop")
        swapper.join()
    assert swapped["r"].code == 0 and int(swapped["r"].stdout) > 0, swapped["r"].stderr
    assert sh(stub, "ls -A /tmp/race-out").stdout == b"secret\n"
    assert outcomes["ok"] and outcomes["refused"], outcomes
    assert not unexpected, unexpected[:5]


def test_not_a_tar_is_invalid(stub):
    code, _details = rpc_error(upload, stub, "/workspace/notar", b"this is not a tar archive" * 40, is_archive=True)
    assert code == CODE.INVALID_ARGUMENT


# ------------------------------------------------------------------ confinement (contract section 3)

OUTSIDE = ["/tmp/x", "/workspace/../tmp/x", "/workspace/out-link/x", "/workspace/out-link", "/etc/passwd",
           "/workspace2/x", "/", "/workspace/./../workspace/../etc/passwd", "/workspace/dangling-out"]


@pytest.fixture(scope="module")
def outside_links(stub):
    sh(stub, "ln -sfn /tmp /workspace/out-link; ln -sfn /nonexistent/outside /workspace/dangling-out;"
             " echo secret > /tmp/x")


@pytest.mark.parametrize("path", OUTSIDE)
def test_download_outside_workspace_is_permission_denied(stub, outside_links, path):
    code, msg = rpc_error(download, stub, path)
    assert code == CODE.PERMISSION_DENIED
    assert msg == 'path outside workspace: "%s"' % path


@pytest.mark.parametrize("path", OUTSIDE)
@pytest.mark.parametrize("is_archive", [False, True])
def test_upload_outside_workspace_is_permission_denied(stub, outside_links, path, is_archive):
    payload = _tar([("f", "file", b"x")]) if is_archive else b"x"
    code, msg = rpc_error(upload, stub, path, payload, is_archive=is_archive)
    assert code == CODE.PERMISSION_DENIED
    assert msg == 'path outside workspace: "%s"' % path
    assert sh(stub, "cat /tmp/x").stdout == b"secret\n"


@pytest.mark.parametrize("path", ["x", "workspace/x", "./x", "../workspace/x", ""])
def test_relative_or_empty_path_is_invalid(stub, path):
    assert rpc_error(download, stub, path)[0] == CODE.INVALID_ARGUMENT
    assert rpc_error(upload, stub, path, b"x")[0] == CODE.INVALID_ARGUMENT


def test_dotdot_that_stays_inside_is_allowed(stub):
    upload(stub, "/workspace/inside/../inside2/f.txt", b"ok")
    assert download(stub, "/workspace/inside2/./f.txt")[1] == b"ok"


def test_symlink_inside_workspace_is_followed(stub):
    sh(stub, "mkdir -p /workspace/real && ln -sfn /workspace/real /workspace/alias")
    upload(stub, "/workspace/alias/through.txt", b"via link")
    assert sh(stub, "cat /workspace/real/through.txt").stdout == b"via link"


# ------------------------------------------------------------------ robustness

def test_garbage_on_the_agent_port_does_not_hurt_it(plane, guest, stub):
    async def send_garbage():
        reader, writer = await guest.dial(8443)
        writer.write(os.urandom(4096) + b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 1000)
        await writer.drain()
        try:
            await reader.read()  # the agent hangs up on a broken HTTP/2 preface
        except ConnectionError:
            pass
        writer.close()
    for _attempt in range(3):
        plane.run(send_garbage())
    assert sh(stub, "echo still-here").stdout == b"still-here\n"


def test_garbage_on_the_port_bridge_gets_errors(plane, guest, stub):
    import asyncio
    import socket

    async def ask(payload):
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX)
        sock.setblocking(False)
        dir_fd = os.open(guest._layout.host, os.O_PATH)
        try:
            await loop.sock_connect(sock, "/proc/self/fd/%d/bridge.sock" % dir_fd)
        finally:
            os.close(dir_fd)
        await loop.sock_sendall(sock, payload)
        sock.shutdown(socket.SHUT_WR)
        answer = await loop.sock_recv(sock, 200)
        sock.close()
        return answer
    for payload in (b"hello\n", b"port 0\n", b"port 99999\n", b"port -1\n", b"\xff" * 70, b"", b"port 8443 extra\n"):
        assert plane.run(ask(payload)).startswith(b"ERR"), payload
    assert sh(stub, "echo bridge-ok").stdout == b"bridge-ok\n"


SEGMENTS = ["workspace", "..", ".", "tmp", "x", "etc", ""]


@hypothesis.settings(max_examples=60, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(parts=hypothesis.strategies.lists(hypothesis.strategies.sampled_from(SEGMENTS), max_size=6))
def test_confinement_matches_the_guests_own_path_resolution(stub, parts):
    # /workspace holds no symlink named like these segments, so the guest's resolution is the lexical one
    path = "/" + "/".join(parts)
    normalized = os.path.normpath("/" + path.lstrip("/"))  # normpath keeps a leading "//"; Linux does not
    inside = normalized == "/workspace" or normalized.startswith("/workspace/")
    try:
        list(stub.Download(pb2.DownloadRequest(path=path)))
        code, msg = None, ""
    except grpc.RpcError as e:
        code, msg = e.code(), e.details()
    if inside:
        assert code in (None, CODE.NOT_FOUND, CODE.FAILED_PRECONDITION), (path, code, msg)
    else:
        assert (code, msg) == (CODE.PERMISSION_DENIED, 'path outside workspace: "%s"' % path)
