"""A guest attacked from inside, as untrusted code would: every attempt fails inside that guest only.

Each test acts through the guest's own agent (real runc guests, real gRPC) and
checks the host afterwards: its sysctls, its files, its processes' owners,
and that another guest and the plane still answer. See
docs/localplane-guests.md for the promises and docs/guarantees.md for the map.
"""
import contextlib
import glob
import hashlib
import os
import subprocess

import pytest
import requests
from guestkit import GATEWAY, Plane, connect, guests_supported, host_addresses, outside_peer, run, sh
from microvm_plane_testing import start_local_plane, stop_local_plane, unique_name

from microvm_localplane import contract, guests, idmap, limits, netns

pytestmark = [pytest.mark.skipif(not guests_supported(), reason="needs root, runc and subordinate ids (make system-deps)"),
              pytest.mark.timeout(300)]

HOST_SYSCTLS = ("kernel/core_pattern", "kernel/hostname", "vm/swappiness", "kernel/panic", "net/ipv4/ip_forward")
SMALL = limits.SIZES["small"]


def host_sysctls():
    out = {}
    for name in HOST_SYSCTLS:
        with open("/proc/sys/" + name) as f:
            out[name] = f.read()
    return out


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """The attacked guests' manager, plus a real control plane (`serve`, its own state dir, the same host) whose
    REST API and guests must carry on whatever the attacker does."""
    p = Plane(str(tmp_path_factory.mktemp("isolation-state")))
    p.api = start_local_plane(str(tmp_path_factory.mktemp("isolation-plane")))
    try:
        yield p
    finally:
        stop_local_plane(p.api)
        p.close()


@pytest.fixture(scope="module")
def attacker(plane):
    g = plane.boot("attacker", hostname="attacker", size="small")
    return g, plane.stub(g)


@pytest.fixture(scope="module")
def bystander(plane):
    g = plane.boot("bystander", hostname="bystander")
    return g, plane.stub(g)


def still_fine(plane, bystander, attacker):
    """After an attack: the other guest and the attacker's own agent answer, and the plane's REST API answers and
    boots a guest that runs a command."""
    assert sh(bystander[1], "echo ok").stdout == b"ok\n"
    assert sh(attacker[1], "echo ok").stdout == b"ok\n"
    api = plane.api.client()
    assert isinstance(api.list_sessions(), list)
    session = api.create_session({"name": unique_name("after"), "agent": "custom"})
    try:
        api.wait_session(session["session_id"], timeout=120)
        r = requests.post(plane.api.url + contract.PREFIXES[0] + "/sessions/%s/sandbox/exec" % session["session_id"],
                          json={"argv": ["echo", "ok"]}, headers=plane.api.auth_headers, timeout=120)
        assert r.status_code == 200 and r.json()["stdout"] == "ok\n", r.text
    finally:
        api.delete_session(session["session_id"])


def py(stub, code, **kw):
    """Run Python code with the guest's own interpreter."""
    return run(stub, ["python3", "-c", code], **kw)


# ------------------------------------------------------------------ the kernel's global state

def test_proc_sys_is_read_only_and_host_sysctls_unchanged(attacker):
    _g, stub = attacker
    before = host_sysctls()
    # Writing the current value back: the attempt itself is what must fail (and the host is never changed).
    script = "; ".join("cat /proc/sys/%s > /tmp/v && cat /tmp/v > /proc/sys/%s 2>/dev/null; echo %s=$?" % (n, n, n)
                       for n in HOST_SYSCTLS)
    script += "; echo '|/bin/sh -c id' > /proc/sys/kernel/core_pattern 2>/dev/null; echo core=$?"
    script += "; echo 1 > /proc/sysrq-trigger 2>/dev/null; echo sysrq=$?; sysctl -w vm.swappiness=1 >/dev/null 2>&1; echo sysctl=$?"
    out = sh(stub, script).stdout.decode()
    for line in out.split():
        name, rc = line.split("=")
        assert rc != "0", "%s was writable from a guest" % name
    assert host_sysctls() == before


def test_kernel_interfaces_are_refused(attacker):
    """Modules, kexec, bpf, perf, keyrings, userfaultfd, io_uring, new user namespaces: all EPERM (seccomp)."""
    _g, stub = attacker
    code = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
calls = {"init_module": (175, 0, 0, b""), "finit_module": (313, 0, b"", 0), "delete_module": (176, b"x", 0),
         "kexec_load": (246, 0, 0, 0, 0), "bpf": (321, 0, 0, 0), "perf_event_open": (298, 0, 0, -1, -1, 0),
         "keyctl": (250, 0, 0, 0, 0, 0), "add_key": (248, b"user", b"k", b"v", 1, -2),
         "userfaultfd": (323, 0), "io_uring_setup": (425, 1, 0), "unshare_user": (272, 0x10000000),
         "mount": (165, b"none", b"/mnt", b"tmpfs", 0, 0), "swapoff": (168, b"/x"), "reboot": (169, 0, 0, 0, 0),
         "settimeofday": (164, 0, 0), "acct": (163, 0), "open_by_handle_at": (304, 0, 0, 0),
         "iopl": (172, 3), "ioperm": (173, 0, 1, 1)}
for name, (nr, *args) in calls.items():
    rc = libc.syscall(nr, *args)
    print(name, "allowed" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
"""
    out = dict(line.split() for line in py(stub, code).stdout.decode().splitlines())
    assert len(out) == 19
    allowed = sorted(n for n, result in out.items() if result == "allowed")
    assert not allowed
    # refused by the guest's filter or capabilities, never by a lucky argument
    assert all(result in ("EPERM", "EACCES") for result in out.values()), out


# Calls that succeed for an unprivileged process on this kernel unless the guest's filter refuses them (each with
# arguments that would work: an O_PATH tree of "/", the guest's own files, its own memory policy), and the
# mount API calls that reach past it.
FILTERED = r"""
import ctypes, errno, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
buf = mmap.mmap(-1, 4096)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
calls = {"open_tree": (428, AT_FDCWD, b"/", 0), "open_tree_attr_clone": (467, AT_FDCWD, b"/", 1, 0, 0),
         "fsopen": (430, b"tmpfs", 0), "fspick": (433, AT_FDCWD, b"/", 0), "fsconfig": (431, -1, 0, 0, 0, 0),
         "fsmount": (432, -1, 0, 0), "move_mount": (429, -1, b"", AT_FDCWD, b"/mnt", 4),
         "mount_setattr": (442, AT_FDCWD, b"/", 0, 0, 0),
         "kcmp": (312, os.getpid(), os.getpid(), 0, 0, 0), "setns": (308, os.open("/proc/self/ns/uts", os.O_RDONLY), 0),
         "fanotify_init": (300, 0x200, 0), "vhangup": (153,),
         "get_mempolicy": (239, 0, 0, 0, 0, 0), "set_mempolicy": (238, 0, 0, 0), "mbind": (237, addr, 4096, 0, 0, 0, 0),
         "move_pages": (279, 0, 0, 0, 0, 0, 0)}
for name, (nr, *args) in calls.items():
    rc = libc.syscall(nr, *args)
    print(name, "allowed" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?"))
"""


def test_the_new_mount_api_and_the_calls_moby_gates_are_refused(attacker):
    """The new mount API and what moby's default profile allows only with a capability a guest lacks (kcmp, setns,
    fanotify_init, vhangup, the NUMA calls) are EPERM. open_tree_attr, which the host's libseccomp 2.5 cannot name
    (so runc cannot filter it), cannot clone a tree either: that needs CAP_SYS_ADMIN, which a guest never has."""
    _g, stub = attacker
    out = dict(line.split() for line in py(stub, FILTERED).stdout.decode().splitlines())
    assert len(out) == 16, out
    assert not [n for n, result in out.items() if result == "allowed"], out
    assert set(out.values()) == {"EPERM"}, out


def test_personality_and_clone3(attacker):
    """personality may set harmless personas, never weaken memory protections (nor query with 0xffffffff, which
    carries every flag); clone3 answers ENOSYS (so libc falls back to clone, whose flags the filter checks) and fork
    still works."""
    _g, stub = attacker
    code = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    rc = libc.syscall(nr, *[ctypes.c_ulong(a) for a in args])  # as libc passes them: unsigned long
    return str(rc) if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
current = call(135, 0xffffffff)
print("query", "ok" if current.isdigit() else current)
for name, flag in (("READ_IMPLIES_EXEC", 0x0400000), ("ADDR_NO_RANDOMIZE", 0x0040000), ("MMAP_PAGE_ZERO", 0x0100000),
                   ("ADDR_COMPAT_LAYOUT", 0x0200000)):
    print(name, call(135, flag))
print("PER_LINUX", "ok" if call(135, 0).isdigit() else "refused")
print("PER_LINUX32", "ok" if call(135, 0x0008).isdigit() and call(135, 0).isdigit() else "refused")
print("clone3", call(435, 0, 0))
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    out = dict(line.split() for line in py(stub, code).stdout.decode().splitlines())
    assert out == {"query": "EPERM", "READ_IMPLIES_EXEC": "EPERM", "ADDR_NO_RANDOMIZE": "EPERM", "MMAP_PAGE_ZERO": "EPERM",
                   "ADDR_COMPAT_LAYOUT": "EPERM", "PER_LINUX": "ok", "PER_LINUX32": "ok", "clone3": "ENOSYS", "fork": "7"}, out


def test_masked_and_read_only_kernel_paths(attacker):
    """/proc/kcore, /proc/keys, /proc/timer_list, /proc/asound, /sys/firmware and the like show nothing; /sys,
    /proc/sys, /proc/irq, /proc/bus, /proc/fs and /proc/sysrq-trigger are read-only mounts; no device nodes."""
    _g, stub = attacker
    code = r"""
import json, os
out = {}
for p in ("/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/latency_stats",
          "/proc/asound", "/proc/acpi", "/proc/scsi", "/sys/firmware", "/sys/kernel/debug", "/sys/kernel/security"):
    try:
        if os.path.isdir(p):
            out[p] = "entries" if os.listdir(p) else "empty"
        else:
            with open(p, "rb") as f:
                out[p] = "data" if f.read(4096) else "empty"
    except FileNotFoundError:
        out[p] = "absent"
    except OSError as e:
        out[p] = e.strerror
ro = {}
with open("/proc/self/mountinfo") as f:
    for line in f:
        fields = line.split()
        ro[fields[4]] = "ro" in fields[5].split(",")
out["ro"] = {p: ro.get(p) if os.path.exists(p) else "absent"
             for p in ("/sys", "/proc/sys", "/proc/irq", "/proc/bus", "/proc/fs", "/proc/sysrq-trigger")}
writes = {}
for p in ("/sys/kernel/mm/transparent_hugepage/enabled", "/proc/irq/default_smp_affinity", "/sys/fs/cgroup/x"):
    try:
        if p.endswith("/x"):
            os.mkdir(p)
        else:
            with open(p, "w") as f:
                f.write(f.read() if False else "x")
        writes[p] = "written"
    except OSError as e:
        writes[p] = e.strerror
out["writes"] = writes
try:
    os.mknod("/tmp/null", 0o20666, os.makedev(1, 3))
    out["mknod"] = "made"
except OSError as e:
    out["mknod"] = e.strerror
print(json.dumps(out))
"""
    import json
    out = json.loads(py(stub, code).stdout)
    ro, writes, mknod = out.pop("ro"), out.pop("writes"), out.pop("mknod")
    assert not [p for p, seen in out.items() if seen in ("data", "entries")], out
    # a path this kernel lacks (no /proc/sysrq-trigger without CONFIG_MAGIC_SYSRQ) is fine; /sys and /proc/sys never are
    assert all(v is True or v == "absent" for v in ro.values()) and ro["/sys"] is True and ro["/proc/sys"] is True, ro
    assert "written" not in writes.values(), writes
    assert mknod == "Operation not permitted", mknod


def test_no_mount_even_in_a_new_user_namespace(attacker):
    _g, stub = attacker
    r = sh(stub, "unshare -Urm mount -t tmpfs none /mnt 2>&1; echo rc=$?; mount -t tmpfs none /mnt 2>&1; echo rc=$?")
    assert r.stdout.count(b"rc=0") == 0, r.stdout


def test_no_raw_sockets(attacker):
    _g, stub = attacker
    code = ("import socket\nfor family in (socket.AF_INET, socket.AF_PACKET):\n    try:\n"
            "        socket.socket(family, socket.SOCK_RAW, 1)\n"
            "        print('opened')\n    except PermissionError:\n        print('refused')\n")
    assert py(stub, code).stdout == b"refused\nrefused\n"


# ------------------------------------------------------------------ users and processes

def test_guest_root_is_an_unprivileged_host_user(plane, attacker):
    g, stub = attacker
    start, _gid, _slots = idmap.plane_ranges()
    uid_map = sh(stub, "cat /proc/self/uid_map").stdout.split()
    assert uid_map[0] == b"0" and int(uid_map[1]) >= start
    for pid in g._cgroup.pids():  # every guest process, seen from the host
        with open("/proc/%d/status" % pid) as f:
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        assert all(int(u) >= start for u in uids), (pid, uids)


def test_guests_never_share_host_ids(attacker, bystander):
    maps = [sh(s, "cat /proc/self/uid_map").stdout.split()[1] for _g, s in (attacker, bystander)]
    assert maps[0] != maps[1]


def test_cannot_ptrace_or_signal_the_host(attacker):
    """The guest sees only its own processes; host pids (the plane's) do not exist for it."""
    _g, stub = attacker
    code = ("import ctypes, errno, os, signal\nlibc = ctypes.CDLL(None, use_errno=True)\npid = %d\n"
            "rc = libc.ptrace(16, pid, 0, 0)\nprint('ptrace', errno.errorcode.get(ctypes.get_errno()) if rc else 'ok')\n"
            "try:\n    os.kill(pid, 0)\n    print('kill ok')\nexcept ProcessLookupError:\n    print('kill ESRCH')\n"
            % os.getpid())
    out = py(stub, code).stdout.decode()
    assert "ptrace ESRCH" in out and "kill ESRCH" in out, out


# ------------------------------------------------------------------ the host's files

def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_host_files_are_not_there(attacker):
    _g, stub = attacker
    secrets = [p for p in ("/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_rsa_key", "/root/.bash_history",
                           "/root/.ssh", "/work") if os.path.exists(p)]
    r = run(stub, ["sh", "-c", 'for p in "$@"; do test -e "$p" && echo "visible $p"; done;'
                               ' sha256sum /etc/shadow /etc/passwd', "sh"] + secrets)
    assert b"visible" not in r.stdout
    sums = dict(reversed(line.split()) for line in r.stdout.decode().splitlines())
    assert sums["/etc/shadow"] != _sha("/etc/shadow")  # the guest's own, not the host's
    assert sums["/etc/passwd"] != _sha("/etc/passwd")


def test_host_usr_and_etc_are_not_the_guests(attacker):
    _g, stub = attacker
    r = sh(stub, "cat /etc/debian_version; ls /usr/bin | wc -l; cat /proc/1/mountinfo | grep -c ' /usr ' || true")
    lines = r.stdout.decode().split()
    host_bins = len(os.listdir("/usr/bin"))
    assert int(lines[1]) != host_bins  # a minimal Debian of its own, not the host's /usr


# The guest's view of /opt/localplane-agent: every mount there (its source path on the host: mountinfo's root,
# and a listing of what the guest sees.
AGENT_VIEW = r"""
import json, os
top = "/opt/localplane-agent"
mounts = []
with open("/proc/self/mountinfo") as f:
    for line in f:
        fields = line.split()
        if fields[4] == top or fields[4].startswith(top + "/"):
            mounts.append([fields[4], fields[3], fields[fields.index("-") + 1]])
listing = {}
for d in (top, top + "/python", top + "/python/bin", top + "/python/lib", top + "/lib", top + "/lib/google"):
    listing[d] = sorted(os.listdir(d))
stdlib = [n for n in listing[top + "/python/lib"] if n.startswith("python")][0]
for sub in ("site-packages", "dist-packages"):
    p = "%s/python/lib/%s/%s" % (top, stdlib, sub)
    if os.path.isdir(p):
        listing[p] = sorted(os.listdir(p))
print(json.dumps({"mounts": mounts, "listing": listing}))
"""


def test_only_the_agent_runtime_of_the_host_is_visible(plane, attacker):
    """H3: of the host, the guest sees at /opt/localplane-agent only what the agent runs on: the interpreter binary,
    its standard library (without the host's installed packages), the C libraries it needs (a copy in the state
    dir), this package and the site-packages entries it imports. Never a whole prefix such as /usr or the host's
    home."""
    import json
    import sys
    _g, stub = attacker
    code = plane.manager.code
    view = json.loads(py(stub, AGENT_VIEW).stdout)
    listing = view["listing"]
    top = "/opt/localplane-agent"
    version = "python%d.%d" % sys.version_info[:2]
    assert listing[top] == ["hostlib", "lib", "python"]
    assert listing[top + "/python"] == ["bin", "lib"]
    assert listing[top + "/python/bin"] == [version]         # no pip, no other tool of the host's prefix
    assert listing[top + "/python/lib"] == [version]         # no other Python, no libpython, no pkgconfig
    assert listing[top + "/lib/google"] == ["_upb", "protobuf"]
    for sub in ("site-packages", "dist-packages"):
        assert listing.get("%s/python/lib/%s/%s" % (top, version, sub), []) == []  # the host's installed packages
    # every mount there is exactly one of the runtime's own binds, each from a read-only overlay of its source
    # (agentfs.py): its root in that file system is "/" (a directory) or the bound file's name, never a host path
    binds = code.binds(plane.manager._hostlib)
    expected = {g: "/" if os.path.isdir(h) else "/" + os.path.basename(h) for h, g in binds}
    mounted = {dst: src for dst, src, fstype in view["mounts"] if fstype != "tmpfs"}
    assert mounted == expected, view["mounts"]
    assert all(fstype in ("overlay", "tmpfs") for _dst, _src, fstype in view["mounts"]), view["mounts"]
    masks = [dst for dst, _src, fstype in view["mounts"] if fstype == "tmpfs"]
    assert all(dst.endswith(("/site-packages", "/dist-packages")) for dst in masks), masks
    # and no source is a whole prefix: each is a path of the runtime itself
    home = os.path.expanduser("~")
    for h, _g in binds:
        assert os.path.realpath(h) not in ("/usr", "/usr/lib", "/usr/local", home, os.path.realpath(sys.base_prefix)), h


# ------------------------------------------------------------------ the host's disk, through PID 1's output

FLOOD = 64 << 20

# Guest root takes PID 1's own stdout and stderr (pidfd_getfd, as ptrace could; /proc/1/fd/N as well when it
# may open it) and writes FLOOD bytes to each, with escapes that would forge the plane's messages.
GRAB_PID1_OUTPUT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(1)
flood = int(sys.argv[1])
for n in (1, 2):
    fd = libc.syscall(438, pidfd, n, 0)  # pidfd_getfd
    if fd < 0:
        print("getfd", n, os.strerror(ctypes.get_errno()))
        continue
    os.write(fd, "\x1b[2J\x1b]0;owned\x07\nlocalplane: forged plane message\n\u202e".encode())
    chunk = b"x" * (1 << 20)
    written = 0
    try:
        while written < flood:
            written += os.write(fd, chunk)
    except OSError as e:
        print("stopped", n, e.strerror)
    print("wrote", n, written)
for n in (1, 2):
    try:
        with open("/proc/1/fd/%d" % n, "ab") as f:
            f.write(b"y" * 4096)
        print("proc-open", n, "ok")
    except OSError as e:
        print("proc-open", n, e.strerror)
"""


def _host_bytes(path):
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def test_pid1_output_lands_on_the_guests_own_disk_never_a_host_file(plane, attacker, bystander):
    """H1: PID 1's stdout and stderr (inherited by the agent) are a file on the guest's own disk: guest root taking
    and flooding them fills its own disk, never a host file, and what the plane shows of them is sanitized."""
    _g, stub = attacker
    layout = plane.manager._layout("attacker")
    before = _host_bytes(layout.host)
    out = run(stub, ["python3", "-c", GRAB_PID1_OUTPUT, str(FLOOD)])
    assert out.stdout.count(b"wrote") == 2, out.stdout + out.stderr  # the attack itself worked: PID 1's fds taken
    assert _host_bytes(layout.host) - before < (1 << 20), "a host file grew with what the guest wrote"
    # it went where the guest's writes go: its own disk, visible to it
    size = sh(stub, "stat -c %s /run/localplane/console.log").stdout
    assert int(size) >= 2 * FLOOD, size
    shown = guests._log_tail(layout)
    assert len(shown) < 4000
    assert "\n" not in shown and "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown
    assert shown.startswith("guest console")  # never passed off as the plane's own words
    assert sh(stub, ": > /run/localplane/console.log").code == 0
    still_fine(plane, bystander, attacker)


# ------------------------------------------------------------------ resources

def test_pids_are_bounded_inside_the_guest_only(plane, attacker, bystander):
    _g, stub = attacker
    code = r"""
import os, signal, time
kids = []
err = None
try:
    for _ in range(%d):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    err = e.errno
for pid in kids:
    os.kill(pid, signal.SIGKILL)
for pid in kids:
    os.waitpid(pid, 0)
print(len(kids), err)
""" % (SMALL.pids + 200)
    made, err = py(stub, code).stdout.split()
    assert int(made) < SMALL.pids and err == b"11"  # EAGAIN at the guest's limit
    still_fine(plane, bystander, attacker)


def test_memory_is_bounded_inside_the_guest_only(plane, attacker, bystander):
    _g, stub = attacker
    r = py(stub, "b = b'x' * %d\nprint('allocated', len(b))" % (SMALL.memory + (256 << 20)))
    assert b"allocated" not in r.stdout
    assert r.code != 0
    still_fine(plane, bystander, attacker)


# Real writes until the disk refuses one: -> bytes written and the error (dd's own message).
FILL = r"""
import os, sys
path, chunk, written = sys.argv[1], b"\x5a" * (1 << 20), 0
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
try:
    while True:
        written += os.write(fd, chunk)
except OSError as e:
    err = e.strerror
try:
    os.fsync(fd)   # what the page cache took must reach the disk too
except OSError as e:
    err = e.strerror
os.close(fd)
print(written, err.replace(" ", "_"))
"""


def test_disk_is_bounded_inside_the_guest_only(plane, attacker, bystander):
    """Real writes to /workspace fill the session's disk to its size and then get ENOSPC; the root filesystem's
    changes share that disk (a write to /var then fails at once); the host's free space drops by no more than the
    size's disk."""
    _g, stub = attacker
    free_before = os.statvfs(plane.state_dir)
    try:
        written, err = run(stub, ["python3", "-c", FILL, "/workspace/fill"], timeout_seconds=600).stdout.split()
        assert err == b"No_space_left_on_device", err
        # filled up to the limit: all of it but ext4's own metadata and what the guest held already
        assert SMALL.disk * 0.85 < int(written) <= SMALL.disk, written
        more, err2 = run(stub, ["python3", "-c", FILL, "/var/fill"], timeout_seconds=600).stdout.split()
        assert err2 == b"No_space_left_on_device" and int(more) < (8 << 20), (more, err2)
        free_full = os.statvfs(plane.state_dir)
        dropped = free_before.f_bavail * free_before.f_frsize - free_full.f_bavail * free_full.f_frsize
        # the disk image is sparse: it may now hold its whole size, never more (other users of this file system
        # add their own noise, hence the margin)
        assert dropped < SMALL.disk + (512 << 20), "the host lost %d bytes to a guest whose disk is %d" % (
            dropped, SMALL.disk)
        still_fine(plane, bystander, attacker)
    finally:
        sh(stub, "rm -f /workspace/fill /var/fill")
    assert sh(stub, "head -c 1048576 /dev/zero > /workspace/after && echo written").stdout == b"written\n"


# N processes that each burn `work` seconds of CPU (by their own clock, however long the host makes that take).
BUSY = r"""
import os, sys, time
procs, work = int(sys.argv[1]), float(sys.argv[2])
start = time.monotonic()
kids = []
for _ in range(procs):
    pid = os.fork()
    if pid == 0:
        while time.process_time() < work:
            pass
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print(time.monotonic() - start)
"""


def cpu_quota(cgroup):
    """The guest's CPU bandwidth as the host set it: (quota, period) in microseconds (cgroup v1 or v2)."""
    if cgroup.v2:
        with open(os.path.join(cgroup.path("cpu"), "cpu.max")) as f:
            quota, period = f.read().split()
        return int(quota), int(period)
    with open(os.path.join(cgroup.path("cpu"), "cpu.cfs_quota_us")) as q, \
            open(os.path.join(cgroup.path("cpu"), "cpu.cfs_period_us")) as p:
        return int(q.read()), int(p.read())


def test_cpu_is_bounded_by_the_size(plane, attacker, bystander):
    """More busy processes than the size has CPUs get, together, at most the size's CPUs of time: the CPU time the
    host counts on the guest's cgroup over the wall time the work took (a ratio, not a speed: a loaded host only
    makes it smaller)."""
    g, stub = attacker
    quota, period = cpu_quota(g._cgroup)
    assert quota / period == SMALL.cpus
    procs, work = int(SMALL.cpus) + 2, 1.0     # more runnable processes than the size allows CPUs
    used0, _throttled = g._cgroup.cpu()
    wall = float(run(stub, ["python3", "-c", BUSY, str(procs), str(work)], timeout_seconds=300).stdout)
    used1, _throttled = g._cgroup.cpu()
    assert used1 - used0 >= procs * work * 0.95        # the host counted the work the guest did
    ratio = (used1 - used0) / wall
    assert ratio <= SMALL.cpus * 1.2, "the guest used %.2f CPUs; its size allows %s" % (ratio, SMALL.cpus)
    still_fine(plane, bystander, attacker)


def test_tmp_is_bounded(attacker):
    _g, stub = attacker
    r = sh(stub, "head -c %d /dev/zero 2>&1 > /tmp/fill; echo rc=$?; rm -f /tmp/fill" % (SMALL.tmp + (16 << 20)))
    assert b"No space left" in r.stdout and b"rc=0" not in r.stdout


# ------------------------------------------------------------------ network

def test_guest_has_no_ipv6_on_its_link(plane):
    g = plane.boot("v6", egress="unrestricted")
    stub = plane.stub(g)
    try:
        r = sh(stub, "cat /proc/net/if_inet6; grep -c eth0 /proc/net/dev")
        assert b"eth0" not in r.stdout.split(b"\n", 1)[0] and b" eth0" not in r.stdout.rsplit(b"\n", 2)[0]
        assert r.stdout.strip().endswith(b"1")  # it has an eth0, without an IPv6 (link-local) address
    finally:
        plane.run(plane.manager.stop("v6"))


def test_link_local_and_loopback_destinations_are_dropped():
    netns.ensure_host_setup()
    forward = subprocess.run([netns.TOOLS["nft"], "list", "chain", "ip", netns.TABLE, "forward"],
                             capture_output=True, text=True, check=True).stdout
    assert "169.254.0.0/16" in forward and "127.0.0.0/8" in forward
    guard = subprocess.run([netns.TOOLS["nft"], "list", "table", "ip6", netns.TABLE],
                           capture_output=True, text=True, check=True).stdout
    assert "drop" in guard


@pytest.fixture(scope="module")
def link_local_peer():
    """A listener outside the host on a link-local address (as a cloud's metadata service at 169.254.169.254 is),
    also reachable at a routable one (TEST-NET-3, RFC 5737); the host's side of its link has a link-local address
    of its own."""
    import random
    third, fourth = random.randrange(1, 255), 4 * random.randrange(64)
    with outside_peer(["169.254.%d.%d/30" % (third, fourth), "203.0.113.%d/30" % (4 * random.randrange(64))]) as pairs:
        yield pairs


def test_link_local_the_hosts_loopback_and_the_plane_are_unreachable(plane, attacker, bystander, link_local_peer):
    """Packets a guest sends to a link-local address (beyond the host, or the host's own), to the host's loopback
    services and to the plane's real listening address go nowhere; the same peer at a routable address answers the
    guest, the host reaches the link-local peer, and the plane and the other guest carry on."""
    import socket
    from urllib.parse import urlparse
    _g, stub = attacker
    (host_ll, peer_ll), (_host_routable, peer_routable) = link_local_peer
    assert connect(stub, peer_routable, 8080) == "connected"   # the guest's egress works: the drop is specific
    with socket.create_connection((peer_ll, 8080), timeout=5):
        pass                                                   # the path to the link-local peer is there
    assert connect(stub, peer_ll, 8080).startswith("failed")    # forwarded by the host: dropped
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    try:
        # the host's own link-local address and its loopback listeners (a guest's 127.0.0.1 is its own)
        assert connect(stub, host_ll, listener.getsockname()[1]).startswith("failed")
        assert connect(stub, "127.0.0.1", listener.getsockname()[1]).startswith("failed")
    finally:
        listener.close()
    plane_port = urlparse(plane.api.url).port
    gateway = sh(stub, GATEWAY).stdout.decode().strip()
    assert gateway.startswith("10.213.")
    for addr in ["127.0.0.1", gateway, host_ll] + host_addresses():
        assert connect(stub, addr, plane_port).startswith("failed"), addr
    still_fine(plane, bystander, attacker)


def session_cgroup(session_id, controller):
    """The directory of a REST-created session's cgroup for one controller (v1 or v2), found by its id."""
    v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
    pattern = "/sys/fs/cgroup/microvm/*/%s" if v2 else "/sys/fs/cgroup/%s/microvm/*/%%s" % controller
    found = glob.glob(pattern % session_id)
    assert len(found) == 1, found
    return found[0], v2


@pytest.mark.parametrize("size", contract.SIZES, ids=lambda s: s["slug"])
def test_a_sessions_size_slug_sets_its_cpu_and_memory(plane, size):
    """A session created over REST with a catalog slug gets the vCPUs and memory the size catalog lists for it."""
    api = plane.api.client()
    session = api.create_session({"name": unique_name("size"), "agent": "custom", "size": size["slug"]})
    try:
        api.wait_session(session["session_id"], timeout=120)
        cpu_dir, v2 = session_cgroup(session["session_id"], "cpu")
        memory_dir, _v2 = session_cgroup(session["session_id"], "memory")
        if v2:
            with open(os.path.join(cpu_dir, "cpu.max")) as f:
                quota, period = (int(x) for x in f.read().split())
            with open(os.path.join(memory_dir, "memory.max")) as f:
                memory = int(f.read())
        else:
            with open(os.path.join(cpu_dir, "cpu.cfs_quota_us")) as q, open(os.path.join(cpu_dir, "cpu.cfs_period_us")) as p:
                quota, period = int(q.read()), int(p.read())
            with open(os.path.join(memory_dir, "memory.limit_in_bytes")) as f:
                memory = int(f.read())
        assert quota / period == size["vcpus"]
        assert memory == size["memory_mb"] << 20
    finally:
        api.delete_session(session["session_id"])
