"""Per-hop stamps (_shared/hops.py, issue 45): off by default, the runner's stamps kept within a budget, the mux's and
the worker's lines joined by the request's id."""
import json

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import hops
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr
from microvm_warm_testing import fed_runner


def test_off_unless_the_switch_names_a_file(monkeypatch, tmp_path):
    monkeypatch.delenv(hops.SWITCH, raising=False)
    assert hops.target() is None
    hops.record(None, "worker", t=1)  # nothing to write to: nothing written, no error
    path = str(tmp_path / "stamps")
    monkeypatch.setenv(hops.SWITCH, path)
    assert hops.target() == path
    hops.record(path, "worker", event="call", t=5)
    hops.record(path, "mux", hop="1-1", out=7)
    lines = [json.loads(line) for line in open(path)]
    assert [line["side"] for line in lines] == ["worker", "mux"] and lines[0]["t"] == 5 and "pid" in lines[1]


def test_the_runner_s_stamps_are_kept_within_a_budget():
    assert hops.runner_stamps(None) == {} and hops.runner_stamps(["recv", 1]) == {}
    kept = hops.runner_stamps({"recv": 1, "forked": 2.5, "exit": True, "x" * 17: 3, "ok": "4", "fine": 5})
    assert kept == {"recv": 1, "fine": 5}  # floats, bools, strings and long names dropped
    assert len(hops.runner_stamps({"s%d" % i: i for i in range(100)})) == hops.STAMPS_MAX


def meta_of(frame):
    body = frame[wr.HEADER.size:]
    jlen = int.from_bytes(body[:4], "big")
    return json.loads(body[4:4 + jlen])


def test_the_mux_asks_the_runner_for_stamps_only_when_on():
    r = fed_runner()
    rid, events = r.submit({}, b"print(1)")
    assert "hops" not in meta_of(r.feed.get_nowait())
    r._dispatch(rid, wr.EXIT, json.dumps({"rc": 0, "hops": {"recv": 1}}).encode())
    assert events.get_nowait() == ("exit", 0) and r.stamps_of(rid) == {}  # not asked: not kept

    rid, events = r.submit({}, b"print(1)", stamps=True)
    assert meta_of(r.feed.get_nowait())["hops"] == 1
    r._dispatch(rid, wr.EXIT, json.dumps({"rc": 3, "hops": {"recv": 1, "forked": 2, "exit": 3, "evil": "x"}}).encode())
    assert events.get_nowait() == ("exit", 3)
    assert r.stamps_of(rid) == {"recv": 1, "forked": 2, "exit": 3}
    assert r.stamps_of(rid) == {} and r.stamped == {}  # taken once
