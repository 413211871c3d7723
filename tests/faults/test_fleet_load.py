"""A fleet through the shared multiplexer: 50 sessions x 30 tasks with forks 25, nothing lost, nothing run twice.

The same job as bench/load_bench.py, which reports its time and memory; here only what must hold:
every host-task ran exactly once (checked in each guest over REST, not through the plugin), every
recap is clean, and the whole fleet is served by the pool's processes, not one process per session.
"""
import re

from microvm_load import TASKS, incomplete_sessions, inventory, load_playbook
from microvm_plane_testing import mux_pids, unique_name
import pytest

SESSIONS = 50
FORKS = 25
POOL = 2


@pytest.mark.serial  # a 50-session load: it would starve every other worker
def test_fifty_sessions_thirty_tasks_nothing_lost_nothing_rerun(plane, mux_dir, run_playbook):
    client = plane.client()
    ids = [client.create_session({"name": unique_name("load"), "agent": "custom"})["session_id"]
           for _count in range(SESSIONS)]
    try:
        for sid in ids:
            client.wait_session(sid, timeout=300)
        env = dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="120", MICROVM_MUX_PROCESSES=str(POOL))
        text, n_cmd = load_playbook()
        res = run_playbook(text, inventory(ids), env, extra_args=["--forks", str(FORKS)], timeout=1500)
        assert res.rc == 0, res.stdout[-4000:] + res.stderr[-2000:]
        recaps = re.findall(r"^s\d\d\s+: ok=(\d+)\s+changed=\d+\s+unreachable=(\d+)\s+failed=(\d+)", res.stdout, re.M)
        assert len(recaps) == SESSIONS, res.stdout[-4000:]
        assert all(r == (str(TASKS), "0", "0") for r in recaps), recaps
        assert incomplete_sessions(client, ids, n_cmd) == []
        # one pool for the fleet: its processes, never one per session
        assert 1 <= len(mux_pids(mux_dir)) <= POOL
    finally:
        for sid in ids:
            try:
                client.delete_session(sid)
            except Exception:  # already gone
                pass
