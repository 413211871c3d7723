"""Staged transfers' bookkeeping (transfers.py), one layer: the sweep of finished and abandoned transfers."""
import os
import time
from types import SimpleNamespace

from microvm_localplane import transfers


def make(tmp_path):
    routes = SimpleNamespace(plane=SimpleNamespace(sessions=None, state_dir=str(tmp_path)))
    return transfers.StagedTransfers(routes)


def add(st, tid, direction="upload", committed=False, finished=0.0, age=0.0):
    t = transfers.Transfer(tid, "s", direction, "/workspace/x", False, None, "", os.path.join(st.root, tid),
                           committed=committed, finished=finished)
    t.created = time.time() - age
    os.makedirs(t.workdir)
    st.transfers[tid] = t
    return t


def test_the_sweep_removes_old_finished_and_abandoned_transfers_and_their_bytes(tmp_path):
    st = make(tmp_path)
    old = time.time() - transfers.KEEP_SECONDS - 1
    gone = [add(st, "tr_done", "download", committed=False, finished=old),
            add(st, "tr_abandoned", age=transfers.KEEP_SECONDS + 1)]
    kept = [add(st, "tr_fresh_done", "download", finished=time.time()),
            add(st, "tr_fresh_upload", age=10),
            add(st, "tr_importing", committed=True, age=transfers.KEEP_SECONDS + 1)]  # a long import is left alone
    st._sweep()
    assert sorted(st.transfers) == sorted(t.transfer_id for t in kept)
    assert not any(os.path.exists(t.workdir) for t in gone)
    assert all(os.path.exists(t.workdir) for t in kept)


def test_a_restarted_plane_has_no_transfer_bytes_left(tmp_path):
    st = make(tmp_path)
    add(st, "tr_left")
    make(tmp_path)
    assert not os.path.exists(os.path.join(str(tmp_path), "transfers", "tr_left"))
