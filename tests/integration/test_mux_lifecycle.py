"""The shared mux's own life (issue 34): where its sockets live, which mux a worker picks after an upgrade, and
what an idle one costs. Each test drives a MuxClient directly (no ansible-playbook), to stay fast."""
import glob
import json
import os
import subprocess
import sys
import time

import pytest

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import config, errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import mux_client as mc
from microvm_plane_testing import mux_pids, stop_muxes

GRPC_THREADS = ("grpc", "event_engine", "lifeguard", "default-executo", "resolver-execut", "timer")


@pytest.fixture
def muxes(tmp_path):
    """A factory of mux dirs under tmp_path; every mux started in one is stopped after the test."""
    made = []

    def make(name="mux"):
        made.append(str(tmp_path / name))
        return made[-1]
    yield make
    for d in made:
        stop_muxes(d)


def _cost(pid):
    """(context switches of the mux's own threads, of gRPC core's threads, CPU ticks, thread count), from /proc."""
    own = core = ticks = threads = 0
    for tid in os.listdir("/proc/%d/task" % pid):
        base = "/proc/%d/task/%s/" % (pid, tid)
        try:
            with open(base + "comm") as f:
                name = f.read().strip()
            with open(base + "status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
            with open(base + "stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that just ended
            continue
        threads += 1
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
        if name.startswith(GRPC_THREADS):
            core += switches
        else:
            own += switches
    return own, core, ticks, threads


def test_an_idle_mux_sleeps(plane, sandbox, muxes):
    """One open link, no task: the mux wakes on events, not on polls. Before, its own threads woke ~270 times in
    3 s (a connectivity poll 5 times a second per channel, a one-second watch loop and accept timeout)."""
    cfg = LinkConfig(session=sandbox["name"], token=plane.token, api_url=plane.url, persist=60, transport="agent")
    client = mc.MuxClient(muxes(), cfg).connect()
    assert client.exec(["true"])[0] == 0
    pid = client.attached["pid"]
    client.close()
    time.sleep(1.5)  # the request's own threads wind down
    before = _cost(pid)
    time.sleep(3)
    after = _cost(pid)
    own, core, ticks = (a - b for a, b in zip(after[:3], before[:3]))
    print("idle mux over 3 s: %d context switches of its own threads, %d of gRPC's, %d CPU ticks, %d -> %d threads"
          % (own, core, ticks, before[3], after[3]))
    assert own <= 25  # measured 0 (a session check every 10 s may fall in the window: about 10)
    assert core <= 150  # gRPC core's own timers: measured 25 to 50
    assert ticks <= 20  # measured 0-2
    assert after[3] <= before[3]


def _unix_paths_bound_by(pid):
    """The paths of the unix sockets process `pid` has bound (as it gave them to bind), from /proc/net/unix."""
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    with open("/proc/%d/net/unix" % pid) as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {row[7] for row in rows if len(row) > 7 and row[6] in inodes}


def test_a_very_long_mux_dir_works_and_its_sockets_stay_in_it(plane, sandbox, tmp_path, muxes):
    """A mux dir far beyond sun_path's 108 bytes: the mux's socket and the tunnel's are bound in their own dirs
    (through the dirs' descriptors), never under a short shared name in /tmp another user could take first."""
    base = muxes(os.path.join("d" * 100, "e" * 100, "mux"))
    cfg = LinkConfig(session=sandbox["name"], token=plane.token, api_url=plane.url, persist=30, transport="agent")
    client = mc.MuxClient(base, cfg, pool_size=1).connect()
    try:
        assert len(os.fsencode(client.socket_path)) > 200
        rc, out, _err, _info = client.exec(["echo", "through the long dir"])
        assert (rc, out) == (0, b"through the long dir\n")
        pid = client.attached["pid"]
    finally:
        client.close()
    assert os.path.exists(client.socket_path)
    assert len(glob.glob(os.path.join(client.dir, "t-*", "*.sock"))) == 1  # the tunnel's, in its link's dir
    bound = _unix_paths_bound_by(pid)
    assert len(bound) == 2 and all(p.startswith(mp.PROC_FD + "/") for p in bound), bound


def test_a_dir_of_another_user_fails_the_task_with_the_fix(plane, tmp_path, muxes):
    """Another user created the mux dir first: the worker says which dir, why and what to do (not "the mux hung
    up"), and starts nothing in it."""
    base = muxes()
    os.makedirs(base, mode=0o700)
    if os.getuid() != 0:
        pytest.skip("needs root to give the dir to another uid")
    os.chown(base, 12345, 12345)
    cfg = LinkConfig(session="any", token=plane.token, api_url=plane.url)
    with pytest.raises(errors.UnusableDirectory) as e:
        mc.MuxClient(base, cfg, pool_size=1).connect()
    assert base in str(e.value) and "owned by uid 12345" in str(e.value) and "MICROVM_MUX_DIR" in str(e.value)
    assert os.listdir(base) == []


# An older collection's mux: it does not know the attach setting host_tag, and (protocol 4 and on) lives in the
# dir of its own protocol digest.
OLD_MUX = r"""
import dataclasses, sys
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import config, errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import server
KNOWN = {f.name for f in dataclasses.fields(config.LinkConfig)} - {"host_tag"}
new_from_wire = config.LinkConfig.from_wire.__func__

def old_from_wire(cls, data):
    unknown = sorted(set(data) - KNOWN)
    if unknown:
        raise errors.ProtocolMismatch("unknown session settings %s (worker and mux versions differ?)" % ", ".join(unknown))
    return new_from_wire(cls, data)

config.LinkConfig.from_wire = classmethod(old_from_wire)
sys.exit(server.main())
"""


def _start_old_mux(base):
    fields = [f for f in config.LinkConfig.__dataclass_fields__ if f != "host_tag"]
    old_dir = mp.private_dir(config.process_dir(mp.private_dir(base), 0, digest=config.protocol_digest(fields=fields)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([mc.collections_root()] + sys.path))
    with open(os.path.join(old_dir, mp.LOG_NAME), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", OLD_MUX, mc.MUX_MODULE], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, cwd=old_dir, env=env, start_new_session=True)
    proc.stdin.write((json.dumps(config.ProcessConfig(dir=old_dir).to_wire()) + "\n").encode())
    proc.stdin.close()
    reply = json.loads(proc.stdout.readline())
    assert reply["ok"], reply
    return old_dir, reply["pid"]


def test_an_upgraded_collection_starts_its_own_mux_next_to_an_old_one(plane, sandbox, muxes):
    """After an upgrade, an older mux still running would refuse the new attach settings (every task UNREACHABLE
    until it idled out). The mux dir carries the protocol: the new worker starts its own, the old one is left be."""
    base = muxes()
    old_dir, old_pid = _start_old_mux(base)
    cfg = LinkConfig(session=sandbox["name"], token=plane.token, api_url=plane.url, persist=30, host_tag="new")
    stale = mc.MuxClient(base, cfg, pool_size=1)
    stale.dir = old_dir  # what a worker reaching the old mux would get
    with pytest.raises(errors.ProtocolMismatch, match="unknown session settings host_tag"):
        stale.connect()
    client = mc.MuxClient(base, cfg, pool_size=1).connect()
    try:
        new_pid = client.attached["pid"]
        assert client.dir != old_dir and new_pid != old_pid
        assert client.exec(["echo", "new"])[:2] == (0, b"new\n")
    finally:
        client.close()
    assert old_pid in mux_pids(base)  # left alone: it idles out by itself
    listed = mc.pool_status(base)  # the status listing shows both
    assert {(s["pid"], s["current"]) for s in listed.values()} == {(old_pid, False), (new_pid, True)}
