"""Guests: isolation, port bridge, freeze/thaw, stop, adopt, checkpoint/restore, clone (real runc guests)."""
import asyncio
import hashlib
import json
import os
import sys
import uuid

import pytest
from guestkit import (
    GATEWAY, Interactive, Plane, connect, download, guests_supported, host_addresses, outside_peer, pid_alive, run, sh,
    upload, wait_until,
)

from microvm_localplane.guests import DialError, GuestError, GuestManager, RootfsSpec
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.skipif(not guests_supported(), reason="needs root, runc and subordinate ids (make system-deps)"),
              pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    p = Plane(str(tmp_path_factory.mktemp("guest-state")))
    yield p
    p.close()


@pytest.fixture(scope="module")
def pair(plane):
    """Two guests side by side."""
    a, b = plane.boot("iso-a", hostname="alpha"), plane.boot("iso-b", hostname="bravo")
    return (a, plane.stub(a)), (b, plane.stub(b))


# ------------------------------------------------------------------ isolation

def test_hostname_is_the_guests(pair):
    (_a, sa), (_b, sb) = pair
    assert sh(sa, "hostname; cat /etc/hostname").stdout == b"alpha\nalpha\n"
    assert sh(sb, "hostname").stdout == b"bravo\n"


def test_pid_namespace_pid1_is_guest_init(pair):
    (a, sa), _other = pair
    r = sh(sa, "tr '\\0' ' ' < /proc/1/cmdline; echo; ls -d /proc/[0-9]* | wc -l")
    cmdline, count = r.stdout.decode().strip().split("\n")
    assert "guest_init.py" in cmdline
    assert int(count) < 20  # only the guest's own processes, not the host's
    assert a.pid != 1 and pid_alive(a.pid)


def test_tmp_is_separate(pair):
    (_a, sa), (_b, sb) = pair
    sh(sa, "echo mine > /tmp/only-in-a")
    assert sh(sa, "cat /tmp/only-in-a").stdout == b"mine\n"
    assert sh(sb, "test -e /tmp/only-in-a || echo absent").stdout == b"absent\n"


def test_workspace_is_separate_and_persistent_on_host(plane, pair):
    (_a, sa), (_b, sb) = pair
    upload(sa, "/workspace/a-only.txt", b"A")
    assert sh(sb, "test -e /workspace/a-only.txt || echo absent").stdout == b"absent\n"
    host_copy = os.path.join(plane.state_dir, "sessions", "iso-a", "workspace", "a-only.txt")
    with open(host_copy, "rb") as f:
        assert f.read() == b"A"


def test_guest_cannot_see_state_dirs_or_host_home(plane, pair):
    (_a, sa), _other = pair
    other = os.path.join(plane.state_dir, "sessions", "iso-b")
    hidden = [plane.state_dir, other, "/root/.bash_history", os.path.join(REPO_DIR, ".git"),
              os.path.join(REPO_DIR, ".local", "plane"), os.path.join(REPO_DIR, "Makefile"), os.path.join(REPO_DIR, "plugins"),
              "/work/shared"]
    r = run(sa, ["sh", "-c", 'for p in "$@"; do test -e "$p" && echo "visible $p"; done;'
                 ' ls -A /home; ls /run/localplane', "sh"] + hidden)
    assert b"visible" not in r.stdout
    listing = r.stdout.split()
    # /home holds only the base template's own user; /run/localplane only the guest's own run files
    assert b"agent.pid" in listing
    assert set(listing) <= {b"sandbox", b"agent.pid", b"console.log", b"session-env.json"}


def test_host_code_is_read_only_in_guest(pair):
    (_a, sa), _other = pair
    r = sh(sa, "touch /opt/localplane-agent/lib/microvm_localplane/x 2>&1; echo rc=$?; test -e '%s' || echo no-repo"
           % os.path.join(REPO_DIR, "plugins"))
    assert b"rc=1" in r.stdout and b"Read-only" in r.stdout
    assert b"no-repo" in r.stdout  # the agent's code is at a private path; the host's checkout is not there


def test_agent_starts_from_byte_code_without_site(pair):
    """The agent's boot imports byte code the host compiled (the guest can write none) and skips site."""
    (_a, sa), _other = pair
    lib = "/opt/localplane-agent/lib"
    r = sh(sa, "tr '\\0' ' ' < /proc/$(cat /run/localplane/agent.pid)/cmdline; echo;"
               " ls %s/__pycache__ %s/microvm_localplane/__pycache__;"
               " touch %s/__pycache__/typing_extensions.*.pyc 2>&1; echo rc=$?" % (lib, lib, lib))
    cmdline = r.stdout.decode().splitlines()[0].split()
    assert "-S" in cmdline and "-s" not in cmdline
    listing = r.stdout.decode()
    assert "typing_extensions.cpython-%d%d.pyc" % sys.version_info[:2] in listing
    assert "agent.cpython-%d%d.pyc" % sys.version_info[:2] in listing
    assert "rc=1" in listing  # neither writable nor replaceable: a read-only bind of a host file


def test_host_never_follows_a_symlink_the_guest_planted(plane, tmp_path):
    canary = tmp_path / "host-canary"
    canary.write_text("host data\n")
    canary_dir = tmp_path / "host-dir"
    canary_dir.mkdir()
    g = plane.boot("planter")
    stub = plane.stub(g)
    sh(stub, 'ln -sfn "%s" /etc/hostname; rm -f /etc/hosts; ln -s "%s/hosts" /etc/hosts;'
             ' rm -rf /workspace/home; ln -s "%s" /workspace/home;'
             ' ln -sfn "%s" /run/localplane/agent.fallback' % (canary, canary_dir, canary_dir, canary))
    plane.run(plane.manager.stop("planter"))
    g = plane.boot("planter", hostname="planter2")
    assert canary.read_text() == "host data\n"
    assert list(canary_dir.iterdir()) == []
    assert sh(plane.stub(g), "cat /etc/hostname").stdout == b"planter2\n"
    plane.run(plane.manager.stop("planter"))


MEMORY_SCAN = """
import re, sys
pid = int(open('/run/localplane/agent.pid').read())
needle = bytes.fromhex(sys.argv[1])  # hex: the request itself must not carry the needle
found = scanned = 0
with open('/proc/%d/maps' % pid) as maps, open('/proc/%d/mem' % pid, 'rb', 0) as mem:
    for line in maps:
        m = re.match(r'([0-9a-f]+)-([0-9a-f]+) r', line)
        if not m:
            continue
        start, end = int(m.group(1), 16), int(m.group(2), 16)
        try:
            mem.seek(start)
            data = mem.read(end - start)
        except (OSError, ValueError, OverflowError):
            continue
        scanned += len(data)
        found += data.count(needle)
print(scanned, found)
"""


def test_no_session_env_leaks_into_another_guests_agent(plane):
    secret = "s3cr3t-%s" % os.urandom(6).hex()
    a = plane.boot("leak-a", env={"TOKEN": secret})
    assert sh(plane.stub(a), 'echo "$TOKEN"').stdout.decode().strip() == secret
    b = plane.boot("leak-b")
    from guestkit import run
    scanned, found = map(int, run(plane.stub(b), ["python3", "-c", MEMORY_SCAN, secret.encode().hex()]).stdout.split())
    assert scanned > 1 << 20  # the scan really read the agent's memory
    assert found == 0
    for sid in ("leak-a", "leak-b"):
        plane.run(plane.manager.stop(sid))


def test_each_guest_has_its_own_network(plane, pair):
    (a, sa), (b, sb) = pair
    # a listener on port 9000 in guest A is reachable through A only
    server = "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',9000)); s.listen(); " \
             "print('listening',flush=True); c,_=s.accept(); c.sendall(b'hello from a'); c.close()"
    call = Interactive(sa, ["python3", "-c", server])
    assert call.next_frame().stdout == b"listening\n"
    with pytest.raises(DialError, match="refused"):
        plane.run(b.dial(9000))
    reader, writer = plane.run(a.dial(9000))
    assert plane.run(reader.read()) == b"hello from a"
    writer.close()
    assert call.rest()[-1].exit.exit_code == 0


def test_dial_refusal_is_a_dial_error(plane, pair):
    (a, _sa), _other = pair
    with pytest.raises(DialError, match="connection refused"):
        plane.run(a.dial(1))
    with pytest.raises(DialError):
        plane.run(a.dial(70000))


def test_root_changes_stay_in_the_guest(plane, pair):
    (_a, sa), (_b, sb) = pair
    assert sh(sa, "echo changed > /opt/root-change && cat /opt/root-change").stdout == b"changed\n"
    assert sh(sb, "test -e /opt/root-change || echo absent").stdout == b"absent\n"
    assert not os.path.exists("/opt/root-change")  # never the host's filesystem
    upper = os.path.join(plane.state_dir, "sessions", "iso-a", "rootfs", "root", "upper", "opt", "root-change")
    assert os.path.exists(upper)


def test_memory_is_accounted(pair):
    (a, _sa), _other = pair
    assert a.memory_bytes() > 1 << 20


# ------------------------------------------------------------------ freeze / thaw

def test_freeze_stops_every_process_and_thaw_resumes(plane):
    g = plane.boot("freeze")
    stub = plane.stub(g)
    counter = os.path.join(plane.state_dir, "sessions", "freeze", "workspace", "counter")
    sh(stub, "setsid sh -c 'while :; do echo x >> /workspace/counter; sleep 0.01; done' >/dev/null 2>&1 &")
    assert wait_until(lambda: os.path.exists(counter) and os.path.getsize(counter) > 0)
    g.freeze()
    assert g.frozen
    size = os.path.getsize(counter)
    plane.run(asyncio.sleep(0.3))
    assert os.path.getsize(counter) == size  # nothing runs while frozen
    with pytest.raises(DialError):
        plane.run(_dial_quick(g))
    g.thaw()
    assert not g.frozen
    assert wait_until(lambda: os.path.getsize(counter) > size)
    assert sh(stub, "echo back").stdout == b"back\n"
    plane.run(plane.manager.stop("freeze"))


async def _dial_quick(guest):
    from microvm_localplane.portdial import dial_bridge
    sock = await dial_bridge(guest._layout.host, 8443, timeout=0.5)
    sock.close()


# ------------------------------------------------------------------ stop / destroy

def test_stop_leaves_no_process_behind(plane):
    g = plane.boot("stopper")
    stub = plane.stub(g)
    sh(stub, "setsid sleep 1000 >/dev/null 2>&1 & nohup sleep 1000 >/dev/null 2>&1 &")
    cgroup = g._cgroup
    pids = cgroup.pids()
    assert len(pids) >= 4  # init, agent, the sleeps
    plane.run(plane.manager.stop("stopper"))
    assert not any(os.path.exists("/proc/%d" % p) for p in pids)  # not even a zombie
    assert not g.alive()
    assert not os.path.exists(cgroup.path("freezer")) and not os.path.exists(cgroup.path("memory"))
    with pytest.raises(DialError):
        plane.run(g.dial(8443))
    assert plane.manager.get("stopper") is None
    # the state stays
    assert os.path.isdir(os.path.join(plane.state_dir, "sessions", "stopper", "workspace", "home"))


def test_destroy_removes_state(plane):
    plane.boot("doomed")
    plane.run(plane.manager.destroy("doomed"))
    assert not os.path.exists(os.path.join(plane.state_dir, "sessions", "doomed"))


def test_boot_refuses_a_second_guest_for_a_session(plane):
    plane.boot("twice")
    with pytest.raises(GuestError, match="already"):
        plane.boot("twice")
    plane.run(plane.manager.stop("twice"))


@pytest.mark.parametrize("bad", ["../x", "", "a/b", ".hidden"])
def test_invalid_session_id_is_refused(plane, bad):
    with pytest.raises(GuestError):
        plane.boot(bad, hostname="h")


# ------------------------------------------------------------------ adopt

def test_adopt_reattaches_after_the_manager_is_discarded(tmp_path):
    state = str(tmp_path / "state")
    first = Plane(state)
    g = first.boot("adoptee", env={"K": "v"})
    upload(first.stub(g), "/workspace/kept.txt", b"kept")
    sh(first.stub(g), "echo root > /opt/root-kept")
    pid = g.pid
    first.close(stop_guests=False)  # the control plane exits, the guest does not
    assert pid_alive(pid)

    second = Plane(state)
    try:
        again = second.run(second.manager.adopt("adoptee", "sb-adoptee", RootfsSpec("host"), {"K": "v"}, None, "adoptee"))
        assert again.pid == pid and again.alive()
        stub = second.stub(again)
        assert download(stub, "/workspace/kept.txt")[1] == b"kept"
        assert sh(stub, 'echo "$K"').stdout == b"v\n"

        # a stopped guest is booted again from its persistent state: nothing lost
        second.run(second.manager.stop("adoptee"))
        booted = second.run(second.manager.adopt("adoptee", "sb-2", RootfsSpec("host"), {"K": "v"}, None, "adoptee"))
        assert booted.pid != pid and booted.sandbox_id == "sb-2"
        stub = second.stub(booted)
        assert download(stub, "/workspace/kept.txt")[1] == b"kept"
        assert sh(stub, "cat /opt/root-kept").stdout == b"root\n"
    finally:
        second.close()


RESTART_SCRIPT = """
import asyncio, os, sys
from microvm_localplane.guests import GuestManager, RootfsSpec
async def main():
    m = GuestManager(sys.argv[1])
    g = await m.boot("crashy", "sb-1", RootfsSpec("host"), {"K": "crash"}, None, "crashy")
    print(g.pid, flush=True)
    os._exit(0)   # the control plane dies without any shutdown
asyncio.run(main())
"""


def test_adopt_after_the_control_plane_process_dies(tmp_path):
    import subprocess
    import sys
    state = str(tmp_path / "state")
    out = subprocess.run([sys.executable, "-c", RESTART_SCRIPT, state], capture_output=True, check=False, text=True, timeout=120,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[0])
    assert pid_alive(pid)
    p = Plane(state)
    try:
        g = p.run(p.manager.adopt("crashy", "sb-1", RootfsSpec("host"), {"K": "crash"}, None, "crashy"))
        assert g.pid == pid
        stub = p.stub(g)
        assert sh(stub, 'echo "$K"; hostname').stdout == b"crash\ncrashy\n"
        pids = g._cgroup.pids()
        p.run(p.manager.stop("crashy"))
        assert pids and not any(pid_alive(x) for x in pids)
    finally:
        p.close()


def test_shutdown_with_stop_kills_guests(tmp_path):
    p = Plane(str(tmp_path / "state"))
    g = p.boot("bye")
    pids = g._cgroup.pids()
    p.close(stop_guests=True)
    assert pids and not any(pid_alive(x) for x in pids)


# ------------------------------------------------------------------ checkpoint / restore / clone

def _fingerprint(stub):
    return sh(stub, "cd /workspace && find . -path ./home -prune -o -print | sort | xargs -d '\\n' sha256sum 2>/dev/null;"
                    " cat /opt/cp-root 2>&1; test -e /etc/motd && echo motd-present || echo motd-gone").stdout


def test_checkpoint_and_restore_exactly(plane, tmp_path):
    g = plane.boot("cp")
    stub = plane.stub(g)
    payload = os.urandom(300_000)
    upload(stub, "/workspace/data/blob", payload)
    sh(stub, "echo v1 > /workspace/data/text; ln -s text /workspace/data/link; echo root-v1 > /opt/cp-root;"
             " rm -f /etc/motd; mkdir -p /workspace/empty-dir")
    before = _fingerprint(stub)
    dest = str(tmp_path / "cp1")
    size = plane.run(plane.manager.checkpoint("cp", dest))
    assert size >= len(payload)
    assert not g.frozen  # thawed again after the copy

    sh(stub, "echo v2 > /workspace/data/text; rm /workspace/data/blob; echo new > /workspace/after;"
             " echo root-v2 > /opt/cp-root; echo motd > /etc/motd")
    assert _fingerprint(stub) != before

    with pytest.raises(GuestError, match="running"):
        plane.run(plane.manager.restore("cp", dest))
    plane.run(plane.manager.stop("cp"))
    plane.run(plane.manager.restore("cp", dest))
    g2 = plane.boot("cp")
    stub2 = plane.stub(g2)
    assert _fingerprint(stub2) == before
    assert download(stub2, "/workspace/data/blob")[1] == payload
    assert sh(stub2, "test -e /workspace/after || echo gone").stdout == b"gone\n"
    plane.run(plane.manager.stop("cp"))


def test_clone_state_from_running_session_and_from_checkpoint(plane, tmp_path):
    src = plane.boot("clone-src")
    s_stub = plane.stub(src)
    sh(s_stub, "echo original > /workspace/f; echo rootfile > /opt/cloned")
    plane.run(plane.manager.clone_state("clone-src", "clone-dst"))
    dst = plane.boot("clone-dst")
    d_stub = plane.stub(dst)
    assert sh(d_stub, "cat /workspace/f /opt/cloned; hostname").stdout == b"original\nrootfile\nclone-dst\n"
    sh(d_stub, "echo diverged > /workspace/f")
    assert sh(s_stub, "cat /workspace/f").stdout == b"original\n"  # independent copies

    cp = str(tmp_path / "cp")
    plane.run(plane.manager.checkpoint("clone-src", cp))
    plane.run(plane.manager.clone_state("clone-src", "clone-from-cp", cp))
    g3 = plane.boot("clone-from-cp")
    assert sh(plane.stub(g3), "cat /workspace/f").stdout == b"original\n"
    for sid in ("clone-src", "clone-dst", "clone-from-cp"):
        plane.run(plane.manager.stop(sid))


def test_checkpoint_of_stopped_session(plane, tmp_path):
    g = plane.boot("cp-stopped")
    upload(plane.stub(g), "/workspace/x", b"x")
    plane.run(plane.manager.stop("cp-stopped"))
    dest = str(tmp_path / "cp")
    assert plane.run(plane.manager.checkpoint("cp-stopped", dest)) >= 1
    with open(os.path.join(dest, "workspace", "x"), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == hashlib.sha256(b"x").hexdigest()


def test_two_managers_do_not_share_cgroups(tmp_path):
    a, b = GuestManager(str(tmp_path / "a")), GuestManager(str(tmp_path / "b"))
    assert a._cgroup("same").path("freezer") != b._cgroup("same").path("freezer")


# ------------------------------------------------------------------ "dir" rootfs (an unpacked OCI image)

def _mini_rootfs(root):
    """A tiny glibc userland: sh, cat, ls, echo and their libraries, plus an os-release marker."""
    import shutil
    import subprocess
    for tool in ("sh", "cat", "ls", "mkdir", "rm"):
        src = os.path.realpath(shutil.which(tool))
        deps = [src] + [w for w in subprocess.run(["ldd", src], capture_output=True, check=False, text=True).stdout.split()
                        if w.startswith("/")]
        for dep in deps:
            dest = os.path.join(root, "usr", "bin", tool) if dep == src else os.path.join(root, dep.lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy2(os.path.realpath(dep), dest)
    os.symlink("usr/bin", os.path.join(root, "bin"))
    os.makedirs(os.path.join(root, "etc"))
    with open(os.path.join(root, "etc", "os-release"), "w") as f:
        f.write("ID=mini-test-image\n")
    return root


@pytest.fixture(scope="module")
def dir_guest(plane, tmp_path_factory):
    rootfs = _mini_rootfs(str(tmp_path_factory.mktemp("mini-rootfs")))
    g = plane.boot("dir-guest", hostname="dirguest", rootfs=RootfsSpec("dir", rootfs))
    yield g, plane.stub(g), rootfs
    plane.run(plane.manager.stop("dir-guest"))


def test_dir_rootfs_is_the_images_userland(dir_guest):
    _guest, stub, _rootfs = dir_guest
    r = sh(stub, "cat /etc/os-release; ls /usr/bin; cat /etc/hostname")
    assert r.stdout.startswith(b"ID=mini-test-image\n")
    assert b"python3" not in r.stdout and b"apt" not in r.stdout  # not the host's /usr
    assert r.stdout.endswith(b"dirguest\n")


def test_dir_rootfs_changes_go_to_the_session_not_the_image(plane, dir_guest):
    _guest, stub, rootfs = dir_guest
    assert sh(stub, "echo changed > /etc/os-release; mkdir /newdir; rm /usr/bin/ls; cat /etc/os-release").stdout \
        == b"changed\n"
    with open(os.path.join(rootfs, "etc", "os-release")) as f:
        assert f.read() == "ID=mini-test-image\n"  # the template is read-only
    assert os.path.exists(os.path.join(rootfs, "usr", "bin", "ls"))
    upper = os.path.join(plane.state_dir, "sessions", "dir-guest", "rootfs", "root", "upper")
    assert os.path.isdir(os.path.join(upper, "newdir"))


def test_dir_rootfs_transfers_and_workspace(dir_guest):
    _guest, stub, _rootfs = dir_guest
    upload(stub, "/workspace/in-dir-guest.txt", b"hello")
    assert download(stub, "/workspace/in-dir-guest.txt")[1] == b"hello"
    assert sh(stub, "cat /workspace/in-dir-guest.txt").stdout == b"hello"


def test_dir_rootfs_missing_is_refused(plane, tmp_path):
    with pytest.raises(GuestError, match="rootfs"):
        plane.boot("no-rootfs", rootfs=RootfsSpec("dir", str(tmp_path / "missing")))
    with pytest.raises(GuestError, match="kind"):
        plane.boot("bad-kind", rootfs=RootfsSpec("oci", None))


def test_guest_starts_its_own_agent(tmp_path):
    p = Plane(str(tmp_path / "state"))
    try:
        g = p.boot("own-agent", env={"V": "1"})
        stub = p.stub(g)
        assert sh(stub, 'echo "$V"; tr "\\0" " " < /proc/$(cat /run/localplane/agent.pid)/cmdline').stdout.startswith(
            b"1\n")
        assert b"microvm_localplane.agent" in sh(stub, "cat /proc/$(cat /run/localplane/agent.pid)/cmdline").stdout
    finally:
        p.close()


def test_agent_that_dies_is_restarted_by_pid1(plane):
    g = plane.boot("agent-crash")
    stub = plane.stub(g)
    import grpc
    with pytest.raises(grpc.RpcError):
        sh(stub, "kill -9 $(cat /run/localplane/agent.pid); sleep 5")

    def answers():
        try:
            return sh(stub, "echo again").stdout == b"again\n"
        except grpc.RpcError:
            return False
    assert wait_until(answers)
    plane.run(plane.manager.stop("agent-crash"))


# ------------------------------------------------------------------ egress

@pytest.fixture(scope="module")
def egress_peer():
    """A server of the test's own outside the host (TEST-NET-2, RFC 5737), named `<random>.test` (RFC 2606) in
    /etc/hosts so that the allow-list and the guest resolve it by name. No test needs the internet."""
    import random
    name = "egress-peer-%s.test" % uuid.uuid4().hex[:6]
    with outside_peer(["198.51.100.%d/30" % (4 * random.randrange(64))]) as [(_host_ip, peer_ip)]:
        with open("/etc/hosts", "a") as f:
            f.write("%s %s\n" % (peer_ip, name))
        try:
            yield name, peer_ip
        finally:
            with open("/etc/hosts") as f:
                kept = [line for line in f if not line.rstrip().endswith(" " + name)]
            with open("/etc/hosts", "w") as f:
                f.writelines(kept)


@pytest.fixture(scope="module")
def open_guest(plane):
    g = plane.boot("egress-open")
    return g, plane.stub(g)


def test_open_egress_gives_eth0_and_a_default_route(open_guest):
    _guest, stub = open_guest
    r = sh(stub, "grep -c eth0 /proc/net/dev; " + GATEWAY)
    lines = r.stdout.split()
    assert lines[0] == b"1" and lines[1].startswith(b"10.213.")


def _name_in_guest(stub, egress_peer):
    """The guest has its own /etc/hosts: give it the peer's name there, as a real guest would learn it from DNS."""
    name, addr = egress_peer
    assert sh(stub, "echo '%s %s' >> /etc/hosts" % (addr, name)).code == 0
    return name


@pytest.mark.serial  # rewrites the host's /etc/hosts (egress_peer)
def test_open_egress_reaches_an_outside_server_by_name(open_guest, egress_peer):
    name = _name_in_guest(open_guest[1], egress_peer)
    assert connect(open_guest[1], name, 8080) == "connected"


@pytest.mark.serial  # rewrites the host's /etc/hosts (egress_peer)
def test_allow_list_allows_listed_hosts_only(plane, egress_peer):
    name, _addr = egress_peer
    allowed = plane.boot("egress-allow", egress=[name])  # resolved on the host, by name
    assert connect(plane.stub(allowed), _name_in_guest(plane.stub(allowed), egress_peer), 8080) == "connected"
    denied = plane.boot("egress-deny", egress=["192.0.2.123"])
    assert connect(plane.stub(denied), _name_in_guest(plane.stub(denied), egress_peer), 8080).startswith("failed")
    for sid in ("egress-allow", "egress-deny"):
        plane.run(plane.manager.stop(sid))


@pytest.fixture(scope="module")
def shared_address_peer():
    """Two names on one outside address (TEST-NET-3, RFC 5737), in the host's /etc/hosts: a.<tag>.example and
    b.<tag>.example, as two sites served from one address would be."""
    import random
    tag = uuid.uuid4().hex[:6]
    names = ["a.%s.example" % tag, "b.%s.example" % tag]
    with outside_peer(["203.0.113.%d/30" % (4 * random.randrange(64))]) as [(_host_ip, peer_ip)]:
        with open("/etc/hosts", "a") as f:
            f.writelines("%s %s\n" % (peer_ip, name) for name in names)
        try:
            yield names[0], names[1], peer_ip
        finally:
            with open("/etc/hosts") as f:
                kept = [line for line in f if not any(line.rstrip().endswith(" " + n) for n in names)]
            with open("/etc/hosts", "w") as f:
                f.writelines(kept)


LOOKUP = ("import socket,sys\ntry:\n    print(socket.gethostbyname(sys.argv[1]))\nexcept OSError as e:\n"
          "    print('failed', e)\n")
# A raw DNS query (A, IN) for argv[1] to argv[2]:53 -> its rcode, or 'no answer'.
RAW_QUERY = ("import socket,struct,sys\nq = struct.pack('!HHHHHH', 77, 0x100, 1, 0, 0, 0) + b''.join(\n"
             "    bytes([len(l)]) + l.encode() for l in sys.argv[1].split('.')) + b'\\0' + struct.pack('!HH', 1, 1)\n"
             "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(3)\ns.sendto(q, (sys.argv[2], 53))\n"
             "try:\n    print('rcode', s.recv(600)[3] & 15)\nexcept OSError:\n    print('no answer')\n")


def lookup(stub, name):
    return run(stub, ["python3", "-c", LOOKUP, name], timeout_seconds=30).stdout.decode().strip()


@pytest.mark.serial  # rewrites the host's /etc/hosts (shared_address_peer)
def test_allow_list_is_by_name_a_name_sharing_the_address_does_not_resolve(plane, shared_address_peer):
    allowed, other, addr = shared_address_peer
    g = plane.boot("egress-byname", egress=[allowed])
    stub = plane.stub(g)
    try:
        # the guest's own DNS (no /etc/hosts entry in the guest): the allowlisted name, with its address
        assert lookup(stub, allowed) == addr
        assert connect(stub, allowed, 8080) == "connected"
        # the other name on the same address: no answer for it, so no connection by that name
        assert lookup(stub, other).startswith("failed")
        assert connect(stub, other, 8080).startswith("failed")
        # a query sent to any other resolver is answered by the plane's DNS too (NXDOMAIN): no way around it
        for server in ("192.0.2.53", "8.8.8.8"):
            out = run(stub, ["python3", "-c", RAW_QUERY, other, server], timeout_seconds=30).stdout.decode().strip()
            assert out == "rcode 3", (server, out)
        out = run(stub, ["python3", "-c", RAW_QUERY, allowed, "192.0.2.53"], timeout_seconds=30).stdout.decode().strip()
        assert out == "rcode 0"
    finally:
        plane.run(plane.manager.stop("egress-byname"))


@pytest.mark.serial  # rewrites the host's /etc/hosts (shared_address_peer)
def test_a_reattached_guest_gets_its_dns_back(plane, shared_address_peer):
    """As a plane restarted over live guests does (adopt): the responder and the dnsports element are taken over."""
    from microvm_localplane import egressdns, netns
    allowed, _other, addr = shared_address_peer
    g = plane.boot("egress-reattach", egress=[allowed])
    stub = plane.stub(g)
    try:
        with open(os.path.join(plane.state_dir, "sessions", "egress-reattach", "host", "net.json")) as f:
            record = json.load(f)
        egressdns.forget(record["guest_ip"], record["ifindex"])  # what a dead plane's guest has: no responder
        assert lookup(stub, allowed).startswith("failed")
        netns.reattach(record)
        assert lookup(stub, allowed) == addr
    finally:
        plane.run(plane.manager.stop("egress-reattach"))


def test_guest_cannot_reach_the_host_or_another_guest(plane, open_guest):
    import socket
    _guest, stub = open_guest
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        gateway = sh(stub, GATEWAY).stdout.decode().strip()
        assert gateway
        assert connect(stub, gateway, port).startswith("failed")   # the host, through the guest's gateway
        for addr in host_addresses():
            assert connect(stub, addr, port).startswith("failed")  # the host's own addresses
    finally:
        listener.close()
    # another guest's listener
    other = plane.boot("egress-other")
    o_stub = plane.stub(other)
    from guestkit import Interactive
    server = Interactive(o_stub, ["python3", "-c", "import socket,time; s=socket.socket(); s.bind(('0.0.0.0',9100));"
                                  " s.listen(); print('up', flush=True); time.sleep(60)"], timeout_seconds=60)
    assert server.next_frame().stdout == b"up\n"
    with open(os.path.join(plane.state_dir, "sessions", "egress-other", "host", "net.json")) as f:
        other_ip = json.load(f)["guest_ip"]  # the base template has no iproute2: the host's record of it
    assert connect(stub, other_ip, 9100).startswith("failed")
    assert connect(o_stub, "127.0.0.1", 9100) == "connected"  # the listener itself is fine
    server.call.cancel()
    plane.run(plane.manager.stop("egress-other"))


def test_stop_removes_the_guests_network(plane):
    g = plane.boot("egress-stop", egress=["192.0.2.77"])
    net_file = os.path.join(plane.state_dir, "sessions", "egress-stop", "host", "net.json")
    import json
    with open(net_file) as f:
        record = json.load(f)
    assert os.path.exists("/sys/class/net/" + record["host_if"])
    plane.run(plane.manager.stop("egress-stop"))
    assert not os.path.exists("/sys/class/net/" + record["host_if"])
    import subprocess
    listing = subprocess.run(["nft", "list", "table", "ip", "microvm_localplane"], capture_output=True, check=False, text=True).stdout
    assert record["guest_ip"] + " " not in listing and record["guest_ip"] + "," not in listing
    assert not g.alive()


def test_invalid_egress_is_refused(plane):
    with pytest.raises(GuestError, match="egress"):
        plane.boot("egress-bad", egress="sometimes")
