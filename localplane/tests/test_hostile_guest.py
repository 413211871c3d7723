"""The hostile guest, against the plane and the agent: what the guest's unprivileged user, or root, can try.

Real runc guests and the real agent over gRPC (guestkit). The guest's unprivileged user is the base template's
`sandbox`; commands run as it with `runuser` (no password needed from root). See docs/guarantees.md, "Hostile
guest".
"""
import io
import os
import tarfile
import threading

import grpc
import pytest
from guestkit import Plane, download, guests_supported, run, sh, upload

from microvm_localplane import baseimage

pytestmark = [pytest.mark.skipif(not guests_supported(), reason="needs root, runc and subordinate ids (make system-deps)"),
              pytest.mark.timeout(600)]

CODE = grpc.StatusCode
ROOT_PASSWORD = "r00t-Pw-7c1f9e"
USER_PASSWORD = "us3r-Pw-52aa0d"


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(str(tmp_path_factory.mktemp("hostile-state")))
    yield p
    p.close()


@pytest.fixture(scope="module")
def stub(plane):
    """A guest whose session sets both account passwords (as secrets do: the plane writes them to its run dir)."""
    g = plane.boot("hostile", env={"SANDBOX_ROOT_PASSWORD": ROOT_PASSWORD, "SANDBOX_USER_PASSWORD": USER_PASSWORD,
                                   "PLAIN_SETTING": "visible"})
    return plane.stub(g)


def as_user(stub, script, **kw):
    """A shell script run as the guest's unprivileged user."""
    return run(stub, ["runuser", "-u", baseimage.GUEST_USER, "--", "sh", "-c", script], **kw)


# ------------------------------------------------------------------ the account passwords

def test_the_account_passwords_reach_no_command_environment(stub):
    root_env = run(stub, ["env"]).stdout.decode()
    assert "PLAIN_SETTING=visible" in root_env  # the rest of the session env still does
    user = as_user(stub, "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do cat $f 2>/dev/null; echo; done;"
                         " cat /run/localplane/session-env.json 2>&1; true")
    assert user.code == 0, user.stderr
    for text in (root_env, user.stdout.decode(errors="replace")):
        assert "PASSWORD" not in text and ROOT_PASSWORD not in text and USER_PASSWORD not in text
    assert b"Permission denied" in user.stdout  # the run dir's env file is root's alone
    # what root's processes hold: PID 1's and the agent's own environment
    agent = sh(stub, "cat /proc/1/environ /proc/$(cat /run/localplane/agent.pid)/environ").stdout
    assert b"PASSWORD" not in agent and ROOT_PASSWORD.encode() not in agent


def test_su_needs_roots_password_which_the_user_cannot_read(stub):
    # the passwords were set at boot: with root's password, su works...
    ok = as_user(stub, "printf '%s\\n' | su -c 'id -u' root" % ROOT_PASSWORD)
    assert ok.stdout.strip().endswith(b"0"), (ok.stdout, ok.stderr)
    # ...and without it, from what the user can see, it does not
    for guess in ("", "$SANDBOX_ROOT_PASSWORD", USER_PASSWORD):
        r = as_user(stub, "printf '%%s\\n' \"%s\" | su -c 'id -u' root" % guess)
        assert r.code != 0 and not r.stdout.strip().endswith(b"0"), (guess, r.stdout, r.stderr)
    # sudo takes the user's own password (its documented use), never root's from the environment
    r = as_user(stub, "printf '%s\\n' | sudo -S -k id -u" % USER_PASSWORD)
    assert r.stdout.strip() == b"0", r.stderr


# ------------------------------------------------------------------ socket families (seccomp)

# Each way into socket(): the libc call (64-bit), the 32-bit direct syscall and the socketcall multiplexer through
# `int 0x80`, and the x32 ABI. The 32-bit ones run a few bytes of machine code mapped below 4 GiB.
SOCKETS = r"""
import ctypes, errno, mmap, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_32BIT = 0x40
page = libc.mmap(None, 4096, 7, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_32BIT, -1, 0)
args = page + 2048

def int80(nr, ebx, ecx, edx):
    # push rbx; mov eax, nr; mov ebx, ..; mov ecx, ..; mov edx, ..; int 0x80; pop rbx; ret
    code = (b"\x53\xb8" + nr.to_bytes(4, "little") + b"\xbb" + ebx.to_bytes(4, "little") + b"\xb9" +
            ecx.to_bytes(4, "little") + b"\xba" + edx.to_bytes(4, "little") + b"\xcd\x80\x5b\xc3")
    ctypes.memmove(page, code, len(code))
    rc = ctypes.CFUNCTYPE(ctypes.c_int)(page)()
    return "ok" if rc >= 0 else errno.errorcode.get(-rc, str(-rc))

def libc_socket(family, kind):
    try:
        socket.socket(family, kind).close()
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))

def x32(family, kind):
    rc = libc.syscall(0x40000000 | 41, family, kind, 0)
    return "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")

def socketcall(family, kind):
    ctypes.memmove(args, (ctypes.c_uint32 * 3)(family, kind, 0), 12)
    return int80(102, 1, args, 0)

for family, kind in ((40, 1), (38, 5), (30, 5), (2, 1), (10, 2), (1, 1), (16, 3)):
    print(family, libc_socket(family, kind), int80(359, family, kind, 0), socketcall(family, kind), x32(family, kind))
"""


def test_socket_families_are_filtered_on_every_syscall_path(stub):
    """AF_VSOCK (40), AF_ALG (38), AF_TIPC (30) refused; AF_INET, AF_INET6, AF_UNIX and AF_NETLINK work."""
    for runner in (lambda code: run(stub, ["python3", "-c", code]),
                   lambda code: run(stub, ["runuser", "-u", baseimage.GUEST_USER, "--", "python3", "-c", code])):
        r = runner(SOCKETS)
        assert r.code == 0, r.stderr
        got = {int(line.split()[0]): line.split()[1:] for line in r.stdout.decode().splitlines()}
        refused = {"EAFNOSUPPORT", "EPERM"}
        for family in (40, 38, 30):
            libc_call, direct32, socketcall, x32 = got[family]
            assert libc_call in refused and direct32 in refused and socketcall in refused, (family, got[family])
            assert x32 in refused | {"ENOSYS"}, (family, got[family])  # a kernel without x32 answers ENOSYS
        for family in (2, 10, 1, 16):
            assert got[family][:2] == ["ok", "ok"], (family, got[family])


# ------------------------------------------------------------------ the agent's paths, raced by the unprivileged user

SWAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
n = 0
while not os.path.exists("stop"):
    if libc.renameat2(-100, b"d", -100, b"alt", 2) != 0:   # RENAME_EXCHANGE: d <-> alt (a link to /etc)
        raise OSError(ctypes.get_errno(), "renameat2")
    n += 1
print(n)
"""
# What /etc holds, with contents: nothing an Upload, Download or archive does may change it.
ETC_STATE = "cd /etc && find . -xdev \\( -type f -o -type l -o -type d \\) -printf '%p %y %s %m\\n' | sort | sha256sum;" \
            " find . -xdev -type f -exec cat {} + 2>/dev/null | sha256sum"


def _tar(name, data):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_the_unprivileged_user_swapping_a_directory_for_a_link_to_etc_moves_no_transfer(stub):
    """The guest's `sandbox` user swaps /workspace/race/d with a link to /etc (renameat2 RENAME_EXCHANGE) as fast as
    it can while root's agent uploads files, files in new directories and archives into d and downloads from it:
    /etc is unchanged afterwards, nothing of it is read, and each transfer either lands in d or is refused."""
    user = baseimage.GUEST_USER
    sh(stub, "rm -rf /workspace/race && mkdir -p /workspace/race/d && echo inside > /workspace/race/d/secret"
             " && echo outside-etc > /etc/secret && ln -s /etc /workspace/race/alt"
             " && chown -hR %s: /workspace/race" % user)
    etc_before = sh(stub, ETC_STATE).stdout
    swapped = {}
    swapper = threading.Thread(target=lambda: swapped.update(r=run(
        stub, ["runuser", "-u", user, "--", "python3", "-c", SWAPPER, "/workspace/race"], timeout_seconds=500)))
    swapper.start()
    outcomes = {"ok": 0, "refused": 0}
    unexpected = []
    try:
        for i in range(150):
            steps = [lambda i=i: upload(stub, "/workspace/race/d/f%d" % i, b"x"),
                     lambda i=i: upload(stub, "/workspace/race/d/sub%d/f" % i, b"x"),
                     lambda i=i: upload(stub, "/workspace/race/d/arch%d" % i, _tar("m", b"x"), is_archive=True),
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
                if isinstance(got, bytes):
                    assert b"outside-etc" not in got and b"root:x:0:0" not in got, "read a file of /etc"
    finally:
        sh(stub, "touch /workspace/race/stop")
        swapper.join()
    assert swapped["r"].code == 0 and int(swapped["r"].stdout) > 0, swapped["r"].stderr
    assert sh(stub, ETC_STATE).stdout == etc_before, "/etc changed"
    # what landed, landed in d (wherever d is now): only the names the transfers used
    names = set(sh(stub, "cd /workspace/race && for x in d alt; do [ -L $x ] || ls -A $x; done").stdout.split())
    assert names <= {b"secret"} | {b"%s%d" % (p, i) for p in (b"f", b"sub", b"arch") for i in range(150)}, names
    assert outcomes["ok"] and outcomes["refused"], outcomes
    assert not unexpected, unexpected[:5]


# ------------------------------------------------------------------ checkpoint copies on the host

def test_a_checkpoint_copy_holds_no_set_id_file_and_a_restore_puts_the_bits_back(plane, tmp_path):
    """Guest root makes set-uid and set-gid copies of `id` in /workspace and the root filesystem; the checkpoint
    copy on the host (canonical ids: 0 is host root) has no set-id bit anywhere, and a restore gives the guest its
    files back exactly, bits and owners included (the guest's own set-gid `id` still gives its user egid 0)."""
    g = plane.boot("setid")
    stub = plane.stub(g)
    sh(stub, "cp /usr/bin/id /workspace/suid-id && chmod 4755 /workspace/suid-id"
             " && cp /usr/bin/id /opt/sgid-id && chown 0:0 /opt/sgid-id && chmod 2755 /opt/sgid-id"
             " && mkdir -p /workspace/deep/er && cp /usr/bin/id /workspace/deep/er/both && chmod 6750 /workspace/deep/er/both")
    modes = b"4755 0 0\n2755 0 0\n6750 0 0\n"
    listing = "stat -c '%a %u %g' /workspace/suid-id /opt/sgid-id /workspace/deep/er/both"
    assert sh(stub, listing).stdout == modes
    dest = tmp_path / "cp"
    plane.run(plane.manager.checkpoint("setid", str(dest)))
    setid_on_host = [str(p) for p in dest.rglob("*") if not p.is_symlink() and p.lstat().st_mode & 0o6000
                     and p.is_file()]
    assert not setid_on_host, setid_on_host
    assert (dest / "workspace" / "suid-id").lstat().st_uid == 0  # canonical ids: why the bits must not be there

    sh(stub, "rm /workspace/suid-id /opt/sgid-id; rm -r /workspace/deep")
    plane.run(plane.manager.stop("setid"))
    plane.run(plane.manager.restore("setid", str(dest)))
    stub = plane.stub(plane.boot("setid"))
    assert sh(stub, listing).stdout == modes
    assert as_user(stub, "/opt/sgid-id -g").stdout == b"0\n"  # the root filesystem is not nosuid, /workspace is
    plane.run(plane.manager.stop("setid"))


# ------------------------------------------------------------------ what a guest learns of the host's paths

def test_mountinfo_shows_no_host_path(plane, stub):
    """The guest's mount tables (mountinfo, mounts, mountstats; its own and PID 1's) name no path of the host: not
    the state dir, the checkout, the Python runtime the agent runs on, or the plane's mount dir."""
    import sys

    from microvm_localplane import hostpaths, rootfs

    code = hostpaths.code_paths()
    host_paths = {os.path.realpath(plane.state_dir), os.path.realpath(code.package_dir), code.stdlib,
                  os.path.dirname(code.python), os.path.realpath(code.grpc_dir), os.path.realpath(sys.prefix),
                  rootfs.MOUNT_ROOT}
    tables = sh(stub, "cat /proc/self/mountinfo /proc/self/mounts /proc/self/mountstats /proc/1/mountinfo").stdout
    assert b"overlay" in tables and b"/opt/localplane-agent" in tables  # the tables are there: only the host is not
    leaks = sorted(p for p in host_paths if p.encode() in tables)
    assert not leaks, (leaks, tables.decode(errors="replace")[:3000])
    # every mount's root within its file system is "/" or a name the guest already knows, never a host directory
    for line in sh(stub, "cat /proc/self/mountinfo").stdout.decode().splitlines():
        root = line.split()[3]
        assert root.count("/") <= 2, line
