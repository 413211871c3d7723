"""The plane as a process: `up`/`down`, restarts that adopt guests, and nothing left behind."""
import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import requests

from microvm_localplane.sessions import guest_state_dir
from microvm_plane_testing import start_local_plane, stop_local_plane

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def guest_pids(state_dir):
    """Pids of every guest of the plane at state_dir (its guests' cgroups), whatever their command lines."""
    import glob

    from microvm_localplane.hostpaths import scope_of
    scope = scope_of(guest_state_dir(state_dir))
    pids = []
    for procs in glob.glob("/sys/fs/cgroup/pids/microvm/%s/*/cgroup.procs" % scope) + \
            glob.glob("/sys/fs/cgroup/microvm/%s/*/cgroup.procs" % scope):
        with contextlib.suppress(OSError), open(procs) as f:
            pids += [int(line) for line in f if line.strip()]
    return pids


def processes_mentioning(text):
    """Pids whose command line mentions `text` (a state dir): the plane, tools it runs; guests, when text is a
    state dir (their processes are found by their cgroups)."""
    found = [(pid, "guest process") for pid in (guest_pids(text) if os.path.isdir(text) else [])]
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if text in cmd:
            found.append((int(pid), cmd[:200]))
    return found


def cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT] + sys.path))
    return subprocess.run([sys.executable, "-m", "microvm_localplane", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


class Rest:
    def __init__(self, url, token):
        self.url, self.h = url + "/v2/agents", {"Authorization": "Bearer " + token}

    def create(self, name, **extra):
        body = "name: %s\nagent: custom\n" % name + "".join("%s: %s\n" % kv for kv in extra.items())
        r = requests.post(self.url + "/sessions", data=body, headers=dict(self.h, **{"Content-Type": "application/yaml"}))
        assert r.status_code == 201, r.text
        return r.json()["session"]["session_id"]

    def get(self, sid):
        return requests.get(self.url + "/sessions/" + sid, headers=self.h).json()["session"]

    def wait(self, sid, status, timeout=60):
        deadline = time.time() + timeout
        while (s := self.get(sid))["status"] != "SESSION_STATUS_" + status:
            assert time.time() < deadline, s
            time.sleep(0.05)
        return s

    def exec(self, sid, argv):
        r = requests.post(self.url + "/sessions/%s/sandbox/exec" % sid, json={"argv": argv}, headers=self.h, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def post(self, path):
        return requests.post(self.url + path, json={}, headers=self.h)


def test_up_reuses_and_down_leaves_nothing(tmp_path):
    state = str(tmp_path / "plane")
    env_file = str(tmp_path / "env")
    up = cli("up", "--state-dir", state, "--env-file", env_file, "--listen", "127.0.0.1:0")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert stat.S_IMODE(os.stat(env_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.join(state, "token")).st_mode) == 0o600
        values = dict(line.replace("export ", "").split("=", 1) for line in open(env_file).read().splitlines())
        url, token = values["DO_AGENTS_API_URL"], values["DO_AGENTS_API_TOKEN"]
        rest = Rest(url, token)
        sid = rest.create("cli-one")
        rest.wait(sid, "READY")
        again = cli("up", "--state-dir", state, "--env-file", env_file)
        assert again.returncode == 0 and "reusing" in again.stdout
        assert open(env_file).read().count(url) == 1
        with open(os.path.join(state, "plane.log")) as f:
            assert token not in f.read()
    finally:
        down = cli("down", "--state-dir", state)
    assert down.returncode == 0, down.stdout + down.stderr
    assert processes_mentioning(state) == []
    assert "no local control plane" in cli("down", "--state-dir", state).stdout


def port_in_time_wait():
    """A loopback port whose only leftover is a connection in TIME-WAIT (what a crashed plane leaves behind)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the plane's listener (aiohttp) has it
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _addr = listener.accept()
    served.close()  # the server side closes first: its end stays in TIME-WAIT
    client.recv(1)
    client.close()
    listener.close()
    probe = socket.socket()
    with pytest.raises(OSError):  # without SO_REUSEADDR the port looks taken
        probe.bind(("127.0.0.1", port))
    probe.close()
    return port


def test_up_keeps_a_named_port_in_time_wait(tmp_path):
    state, env_file = str(tmp_path / "plane"), str(tmp_path / "env")
    port = port_in_time_wait()
    up = cli("up", "--state-dir", state, "--env-file", env_file, "--listen", "127.0.0.1:%d" % port)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "DO_AGENTS_API_URL=http://127.0.0.1:%d\n" % port in open(env_file).read()
    finally:
        cli("down", "--state-dir", state)


def test_up_never_moves_a_named_port_that_is_taken(tmp_path):
    state, env_file = str(tmp_path / "plane"), str(tmp_path / "env")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = cli("up", "--state-dir", state, "--env-file", env_file, "--listen", "127.0.0.1:%d" % port)
    try:
        assert up.returncode != 0, up.stdout
        assert "port %d is in use" % port in up.stdout and "never replaced" in up.stdout, up.stdout
        assert not os.path.exists(env_file) and processes_mentioning(state) == []
    finally:
        cli("down", "--state-dir", state)


@pytest.mark.parametrize("how", ["graceful", "crash"])
def test_restart_adopts_sessions_and_their_workspace(tmp_path, how):
    state = str(tmp_path / "plane")
    os.makedirs(state)
    handle = start_local_plane(state)
    try:
        rest = Rest(handle.url, handle.token)
        live, paused = rest.create("keep-live"), rest.create("keep-paused")
        for sid in (live, paused):
            rest.wait(sid, "READY")
            assert rest.exec(sid, ["sh", "-c", "echo kept > /workspace/kept.txt"])["exit_code"] == 0
        assert rest.post("/sessions/%s/pause" % paused).status_code == 204
        rest.wait(paused, "PAUSED")
        cp = requests.post(rest.url + "/sessions/%s/checkpoints" % live, json={"label": "x"}, headers=rest.h).json()
        if how == "graceful":
            stop_local_plane(handle)
        else:
            handle.process.send_signal(signal.SIGKILL)
            handle.process.wait(10)
        handle = start_local_plane(state, token=handle.token)
        rest = Rest(handle.url, handle.token)
        assert rest.wait(live, "READY")["name"] == "keep-live"
        assert rest.exec(live, ["cat", "/workspace/kept.txt"])["stdout"] == "kept\n"
        p = rest.get(paused)
        assert p["status"] == "SESSION_STATUS_PAUSED" and p["pause_reason"] == "manual"
        assert rest.post("/sessions/%s/resume" % paused).status_code == 204
        assert rest.exec(paused, ["cat", "/workspace/kept.txt"])["stdout"] == "kept\n"
        got = requests.get(rest.url + "/sessions/%s/checkpoints/%s" % (live, cp["checkpoint"]["checkpoint_id"]),
                           headers=rest.h)
        assert got.status_code == 200
    finally:
        stop_local_plane(handle)
    assert processes_mentioning(state) == []


def test_a_session_that_cannot_boot_again_is_failed_saying_why_in_its_warnings(tmp_path):
    """The session object has no error text (get_session); its documented `warnings` say why it FAILED."""
    state = str(tmp_path / "plane")
    os.makedirs(state)
    handle = start_local_plane(state)
    try:
        rest = Rest(handle.url, handle.token)
        sid = rest.create("doomed")
        rest.wait(sid, "READY")
        stop_local_plane(handle)  # the plane stops its guests: the restart boots them again from their state
        record = os.path.join(state, "sessions", sid + ".json")
        with open(record) as f:
            rec = json.load(f)
        rec["egress"] = "everything"  # a record the guest runtime refuses: the boot after the restart fails
        with open(record, "w") as f:
            json.dump(rec, f)
        handle = start_local_plane(state, token=handle.token)
        rest = Rest(handle.url, handle.token)
        rest.wait(sid, "FAILED")
        failed = rest.get(sid)
        assert any("failed to boot" in w and "egress" in w for w in failed["warnings"]), failed
        assert "error_message" not in failed
    finally:
        stop_local_plane(handle)
    assert processes_mentioning(state) == []


def test_a_guest_that_dies_is_booted_again_with_its_workspace(tmp_path):
    state = str(tmp_path / "plane")
    os.makedirs(state)
    handle = start_local_plane(state)
    try:
        rest = Rest(handle.url, handle.token)
        sid = rest.create("crashy")
        rest.wait(sid, "READY")
        assert rest.exec(sid, ["sh", "-c", "echo survived > /workspace/s.txt"])["exit_code"] == 0
        with open(os.path.join(guest_state_dir(state), "sessions", sid, "host", "meta.json")) as f:
            victims = [(json.load(f)["pid"], "the guest's PID 1")]  # its PID namespace dies with it
        assert victims
        for pid, _cmd in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 60
        while True:
            r = requests.post(rest.url + "/sessions/%s/sandbox/exec" % sid, json={"argv": ["cat", "/workspace/s.txt"]},
                              headers=rest.h, timeout=60)
            if r.status_code == 200:
                break
            assert time.time() < deadline, r.text
            time.sleep(0.2)
        assert r.json()["stdout"] == "survived\n"
        assert rest.get(sid)["status"] == "SESSION_STATUS_READY"
    finally:
        stop_local_plane(handle)
    assert processes_mentioning(state) == []


def test_stopping_the_plane_closes_port_forwards_with_4001(tmp_path):
    import asyncio

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    state = str(tmp_path / "plane")
    os.makedirs(state)
    handle = start_local_plane(state)
    try:
        rest = Rest(handle.url, handle.token)
        sid = rest.create("stopping")
        rest.wait(sid, "READY")

        async def hold():
            async with connect(handle.ws_url(sid, 8443), additional_headers=handle.auth_headers) as ws:
                handle.process.send_signal(signal.SIGTERM)
                try:
                    while True:  # the agent's HTTP/2 server speaks first (SETTINGS); read until the close
                        await asyncio.wait_for(ws.recv(), 30)
                except ConnectionClosed as e:
                    return e.rcvd.code if e.rcvd else None
        assert asyncio.run(hold()) == 4001
        handle.process.wait(60)
    finally:
        stop_local_plane(handle)
    assert processes_mentioning(state) == []


def test_the_planes_archive_bounds_reach_the_agent(tmp_path):
    import io
    import tarfile
    state = str(tmp_path / "plane")
    os.makedirs(state)
    handle = start_local_plane(state, extra_env={"MICROVM_LOCALPLANE_ARCHIVE_MAX_MEMBERS": "2"})
    try:
        rest = Rest(handle.url, handle.token)
        sid = rest.create("bounded")
        rest.wait(sid, "READY")

        def tar(names):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as t:
                for name in names:
                    info = tarfile.TarInfo(name)
                    info.size = 1
                    t.addfile(info, io.BytesIO(b"x"))
            return buf.getvalue()

        def upload(data):
            return requests.post(rest.url + "/sessions/%s/workspace/upload" % sid, data=data, headers=rest.h,
                                 params={"path": "/workspace/bounded", "is_archive": "true"}, timeout=60)

        over = upload(tar(["a", "b", "c"]))
        assert over.status_code == 400 and "archive_max_members" in over.text, over.text
        assert rest.exec(sid, ["sh", "-c", "test -e /workspace/bounded || echo nothing"])["stdout"] == "nothing\n"
        assert upload(tar(["a", "b"])).status_code == 200
    finally:
        stop_local_plane(handle)


@pytest.mark.serial  # sized by the host's free disk, which other workers' guests change
def test_a_session_whose_disk_the_host_cannot_hold_is_refused_and_leaves_nothing(tmp_path):
    """Disk images are sparse: at create (and for each child of a fork) the host must be able to hold the session's
    whole disk with the plane's reserve left over, or the call is a 409 naming the space; nothing is created."""
    from microvm_localplane import contract, limits
    state = str(tmp_path / "plane")
    os.makedirs(state)
    st = os.statvfs(state)
    free = st.f_bavail * st.f_frsize
    disk = limits.for_size(contract.DEFAULT_SIZE).disk
    # room for about two of the default size's disks beyond the reserve: one session fits, a fork of four does not
    handle = start_local_plane(state, extra_env={"MICROVM_LOCALPLANE_DISK_RESERVE": str(free - int(2.5 * disk))})
    try:
        rest = Rest(handle.url, handle.token)
        sid = rest.create("fits")
        rest.wait(sid, "READY")
        fork = requests.post(rest.url + "/sessions/%s/fork" % sid, json={"count": 4}, headers=rest.h, timeout=120)
        assert fork.status_code == 409, fork.text
        assert "not enough disk space for 4 disks" in fork.json()["message"]
        names = [s["name"] for s in requests.get(rest.url + "/sessions", headers=rest.h).json()["sessions"]]
        assert names == ["fits"]
    finally:
        stop_local_plane(handle)
    state2 = str(tmp_path / "plane2")
    os.makedirs(state2)
    handle = start_local_plane(state2, extra_env={"MICROVM_LOCALPLANE_DISK_RESERVE": str(1 << 50)})
    try:
        rest = Rest(handle.url, handle.token)
        body = "name: too-big\nagent: custom\n"
        r = requests.post(rest.url + "/sessions", data=body, headers=dict(rest.h, **{"Content-Type": "application/yaml"}))
        assert r.status_code == 409, r.text
        message = r.json()["message"]
        assert "not enough disk space" in message and "GiB free" in message and "--disk-reserve" in message, message
        assert requests.get(rest.url + "/sessions", headers=rest.h).json()["sessions"] == []
        assert not os.listdir(os.path.join(guest_state_dir(state2), "sessions"))
    finally:
        stop_local_plane(handle)


def test_the_first_base_session_says_the_rootfs_is_being_built(tmp_path):
    """On a fresh cache the first `base` session waits for debootstrap: `up` and the create's warnings say so and
    name the build log. (PATH without debootstrap, so the build fails at once instead of taking a minute: the
    session goes FAILED naming what is missing.)"""
    state, cache = str(tmp_path / "plane"), str(tmp_path / "empty-cache")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT] + sys.path), MICROVM_LOCALPLANE_CACHE=cache,
               PATH="/usr/bin:/bin")
    up = subprocess.run([sys.executable, "-m", "microvm_localplane", "up", "--state-dir", state, "--env-file",
                         str(tmp_path / "env"), "--listen", "127.0.0.1:0"], capture_output=True, text=True, env=env,
                        timeout=120, check=False)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        log = os.path.join(cache, "base-bookworm-")
        assert "note: the local control plane builds the `base` template's Debian bookworm root filesystem" in up.stdout
        assert log in up.stdout and "build.log" in up.stdout
        values = dict(line.replace("export ", "").split("=", 1) for line in open(tmp_path / "env").read().splitlines())
        rest = Rest(values["DO_AGENTS_API_URL"], values["DO_AGENTS_API_TOKEN"])
        body = "name: first-base\nagent: custom\n"
        r = requests.post(rest.url + "/sessions", data=body, headers=dict(rest.h, **{"Content-Type": "application/yaml"}))
        assert r.status_code == 201, r.text
        session = r.json()["session"]
        assert any("before this session boots" in w and "build.log" in w for w in session["warnings"]), session
        failed = rest.wait(session["session_id"], "FAILED")
        assert any("debootstrap" in w for w in failed["warnings"]), failed
    finally:
        down = cli("down", "--state-dir", state)
    assert down.returncode == 0, down.stdout + down.stderr


def test_a_delete_in_flight_when_the_plane_stops_leaves_nothing_mounted(tmp_path):
    """The plane stopped right after answering a DELETE: the destroy finishes, no disk or loop device stays."""
    state = str(tmp_path / "plane")
    os.makedirs(state)
    handle = start_local_plane(state)
    try:
        rest = Rest(handle.url, handle.token)
        sid = rest.create("deleted-then-stopped")
        rest.wait(sid, "READY")
        assert requests.delete(rest.url + "/sessions/%s" % sid, headers=rest.h).status_code in (200, 202, 204)
    finally:
        stop_local_plane(handle)
    with open("/proc/self/mountinfo") as f:
        assert [line.split()[4] for line in f if state in line] == []
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout
    assert state not in loops
    assert processes_mentioning(state) == []


def running_pid(pid):
    """A process that still runs: a killed one whose new parent has not reaped it yet (a container's PID 1 may
    never do so) stays in /proc as a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.serial  # host-wide: a plane of another worker, starting or stopping, must not be swept
def test_sweep_removes_what_a_killed_plane_left_and_nothing_of_a_running_one(tmp_path):
    """A plane SIGKILLed whose state dir is then removed (a killed test run) leaves guests, mounts and loop devices
    nobody will adopt: `sweep` removes them; a running plane's guest and a stopped plane that may be restarted stay."""
    from microvm_localplane.hostpaths import scope_of

    killed, running = str(tmp_path / "killed"), str(tmp_path / "running")
    os.makedirs(killed)
    os.makedirs(running)
    victim, bystander = start_local_plane(killed), start_local_plane(running)
    try:
        sids = []
        for handle in (victim, bystander):
            rest = Rest(handle.url, handle.token)
            sids.append(rest.create("sweep-me"))
            rest.wait(sids[-1], "READY")
        orphans = guest_pids(killed)
        assert orphans and guest_pids(running)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        kept = cli("sweep")  # the killed plane's state dir still has its records: it may be started again
        assert kept.returncode == 0, kept.stderr
        assert all(running_pid(pid) for pid in orphans)
        shutil.rmtree(os.path.join(killed, "sessions"))  # as a test's temporary dir goes
        dry = cli("sweep", "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        assert scope_of(guest_state_dir(killed)) in json.loads(dry.stdout)["scopes"]
        assert all(running_pid(pid) for pid in orphans)  # a dry run touches nothing
        swept = cli("sweep")
        assert swept.returncode == 0, swept.stderr
        assert "no longer running" in swept.stdout
        deadline = time.monotonic() + 30
        while any(running_pid(pid) for pid in orphans) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(running_pid(pid) for pid in orphans), [open("/proc/%d/status" % pid).read()[:300]
                                                              for pid in orphans if running_pid(pid)]
        with open("/proc/self/mountinfo") as f:
            assert [line.split()[4] for line in f if killed in line or scope_of(guest_state_dir(killed)) in line] == []
        assert killed not in subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout
        assert guest_pids(running), "the running plane's guest was touched"
        assert Rest(bystander.url, bystander.token).exec(sids[1], ["true"])["exit_code"] == 0
    finally:
        stop_local_plane(bystander)
        stop_local_plane(victim)
