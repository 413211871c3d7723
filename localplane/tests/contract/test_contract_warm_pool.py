"""keep_warm and the local plane's pool of pre-booted guests (warmpool.py).

Behaviour, not timings: a keep_warm create of a warm template and size is served from the pool (the
plane counts it in warm-pool.json), a claimed guest is the session's alone and looks freshly booted (its
hostname, an empty /workspace and /tmp), and specs a pooled guest was not booted for boot as usual.
"""
import json
import os
import time

import pytest

from contract_support import error_message, local_only, run_exec, unique

pytestmark = local_only


def pool_state(plane):
    with open(os.path.join(plane.state_dir, "warm-pool.json")) as f:
        return json.load(f)


def wait_pool(plane, ready, key="base/mars-2vcpu-4gb", timeout=180):
    deadline = time.time() + timeout
    while True:
        try:
            state = pool_state(plane)
            if state["ready"].get(key, 0) >= ready:
                return state
        except (OSError, ValueError):
            pass
        assert time.time() < deadline, "the warm pool never held %d guests" % ready
        time.sleep(0.2)


def create(api, **spec):
    spec.setdefault("name", unique("warm"))
    spec.setdefault("agent", "custom")
    resp = api.create(spec)
    assert resp.status_code == 201, resp.text
    return resp.json()["session"]


def sh(agent, sid, script):
    code, out, err = run_exec(agent(sid), ["sh", "-c", script])
    assert code == 0, err
    return out.decode()


@pytest.fixture
def sessions(api):
    made = []
    yield made
    for sid in made:
        api.call("DELETE", "/sessions/%s" % sid)


def test_keep_warm_is_a_boolean_reported_on_the_session(api, sessions):
    bad = api.create({"name": unique(), "agent": "custom", "keep_warm": "yes"})
    assert bad.status_code == 400 and "keep_warm" in error_message(bad)
    s = create(api, keep_warm=True)
    sessions.append(s["session_id"])
    assert s["keep_warm"] is True
    assert api.wait(s["session_id"], ("READY",))["keep_warm"] is True


def test_a_keep_warm_create_is_served_from_the_pool_and_looks_freshly_booted(plane, api, agent, sessions):
    cold = create(api, keep_warm=True)   # asks the plane to keep this template and size warm
    sessions.append(cold["session_id"])
    api.wait(cold["session_id"], ("READY",))
    before = wait_pool(plane, 2)
    b, c = create(api, keep_warm=True), create(api, keep_warm=True)
    sessions += [b["session_id"], c["session_id"]]
    after = pool_state(plane)
    assert after["claimed"] == before["claimed"] + 2
    assert {b["session_id"], c["session_id"]} <= set(before["members"])
    assert not {b["session_id"], c["session_id"]} & set(after["members"])  # taken out of the pool for good
    for s in (b, c):
        assert api.wait(s["session_id"], ("READY",))["sandbox_id"]

    fresh = "hostname; cat /etc/hostname; grep -c %s /etc/hosts; ls -A /workspace | wc -l; ls -A /tmp | wc -l"
    assert sh(agent, cold["session_id"], fresh % cold["name"]).split()[3:] == \
        sh(agent, b["session_id"], fresh % b["name"]).split()[3:]
    assert sh(agent, b["session_id"], fresh % b["name"]).split()[:3] == [b["name"], b["name"], "1"]
    # Two claimed guests share nothing.
    sh(agent, b["session_id"], "echo mine > /workspace/b.txt; echo mine > /tmp/b.txt")
    assert sh(agent, c["session_id"], "ls /workspace/b.txt /tmp/b.txt 2>&1 || true").count("No such file") == 2
    assert sh(agent, b["session_id"], "hostname") != sh(agent, c["session_id"], "hostname")
    # The pool refills in the background, bounded.
    refilled = wait_pool(plane, 2)
    assert sum(refilled["ready"].values()) <= 8


def test_specs_a_pooled_guest_was_not_booted_for_boot_as_usual(plane, api, agent, sessions):
    warm = create(api, keep_warm=True)
    sessions.append(warm["session_id"])
    api.wait(warm["session_id"], ("READY",))
    before = wait_pool(plane, 1)
    with_env = create(api, keep_warm=True, env={"GREETING": "hello"})
    plain = create(api)  # no keep_warm
    sessions += [with_env["session_id"], plain["session_id"]]
    assert pool_state(plane)["claimed"] == before["claimed"]
    assert with_env["session_id"] not in before["members"] and plain["session_id"] not in before["members"]
    api.wait(with_env["session_id"], ("READY",))
    assert sh(agent, with_env["session_id"], "echo $GREETING").strip() == "hello"
