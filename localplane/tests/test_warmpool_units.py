"""The warm pool's rules with a stand-in guest manager: bounded, never shared, stale guests dropped, leftovers swept."""
import asyncio
import json
import os

from microvm_localplane.warmpool import WarmPool

BASE = {"kind": "base", "path": None}


class FakeGuest:
    def __init__(self, sid):
        self.session_id = sid
        self.pid = 1
        self.hostname = "sandbox"
        self.dead = False

    def alive(self):
        return not self.dead


class FakeGuests:
    def __init__(self):
        self.guests, self.destroyed, self.booted = {}, [], []

    def get(self, sid):
        return self.guests.get(sid)

    def admit(self, sizes):
        pass

    async def boot(self, sid, sandbox_id, rootfs, env, egress, hostname, size=None):
        assert env == {} and egress is None
        self.booted.append(sid)
        self.guests[sid] = FakeGuest(sid)

    async def destroy(self, sid):
        self.destroyed.append(sid)
        self.guests.pop(sid, None)


async def settle(pool, rounds=20):
    for _round in range(rounds):
        await pool._refill()
        await asyncio.sleep(0)


def test_bounded_claimed_once_and_never_returned(tmp_path):
    async def run():
        guests = FakeGuests()
        pool = WarmPool(str(tmp_path), guests, size=2, max_total=3)
        pool.want("base", "small", BASE)
        pool.want("other", "small", BASE)
        await settle(pool)
        assert sum(len(v) for v in pool.ready.values()) == 3  # max_total bounds both keys together
        first = pool.claim("BASE", "small", BASE)
        second = pool.claim("base", "small", BASE)
        assert first and second and first.session_id != second.session_id
        assert pool.claim("base", "small", BASE) is None and pool.stats["claimed"] == 2
        state = json.load(open(os.path.join(str(tmp_path), "warm-pool.json")))
        assert first.session_id not in state["members"] and second.session_id not in state["members"]
        await settle(pool)
        assert first.session_id not in [m.session_id for m in pool._members()]  # never back in the pool
        await pool.shutdown()
        assert set(guests.destroyed) >= set(m for m in guests.booted if m not in (first.session_id, second.session_id))
    asyncio.run(run())


def test_stale_and_dead_guests_are_never_handed_out(tmp_path):
    async def run():
        guests = FakeGuests()
        pool = WarmPool(str(tmp_path), guests, size=1, max_total=4)
        pool.want("base", "small", BASE)
        await settle(pool)
        rebuilt = {"kind": "dir", "path": "/new"}
        assert pool.claim("base", "small", rebuilt) is None  # built from another rootfs: discarded
        await settle(pool)
        member = pool.ready[("base", "small")][0]
        guests.guests[member.session_id].dead = True
        assert pool.claim("base", "small", BASE) is None
        await asyncio.sleep(0)
        assert member.session_id in guests.destroyed
        await pool.shutdown()
    asyncio.run(run())


def test_only_specs_a_pooled_guest_was_booted_for(tmp_path):
    ok = {"keep_warm": True, "env": {}, "secrets": {}, "egress": None}
    assert WarmPool.eligible(ok)
    for change in ({"keep_warm": False}, {"env": {"A": "1"}}, {"secrets": {"S": "x"}}, {"egress": ["a.example"]},
                   {"workspace_id": "w"}, {"persistent_workspace": True}):
        assert not WarmPool.eligible(dict(ok, **change)), change


def test_leftovers_of_a_crashed_plane_are_destroyed_at_start(tmp_path):
    with open(os.path.join(str(tmp_path), "warm-pool.json"), "w") as f:
        json.dump({"members": ["left-1", "left-2"]}, f)

    async def run():
        guests = FakeGuests()
        pool = WarmPool(str(tmp_path), guests, size=0)
        pool.start()
        await asyncio.sleep(0.05)
        assert sorted(guests.destroyed) == ["left-1", "left-2"]
        assert json.load(open(os.path.join(str(tmp_path), "warm-pool.json")))["members"] == []
    asyncio.run(run())


def test_an_idle_pool_rewrites_nothing(tmp_path):
    async def run():
        guests = FakeGuests()
        pool = WarmPool(str(tmp_path), guests, size=1, max_total=2)
        path = os.path.join(str(tmp_path), "warm-pool.json")
        pool.want("base", "small", BASE)
        await settle(pool)
        assert len(pool.ready[("base", "small")]) == 1
        os.unlink(path)   # a rewrite would bring it back
        await settle(pool)
        assert not os.path.exists(path), "an unchanged pool rewrote warm-pool.json"
        assert pool.claim("base", "small", BASE) is not None   # a change is written at once
        assert json.load(open(path))["claimed"] == 1

    asyncio.run(run())


def test_the_refill_loop_sleeps_until_something_is_wanted(tmp_path):
    async def run():
        pool = WarmPool(str(tmp_path), FakeGuests(), size=1, max_total=2)
        refills = []
        real = pool._refill

        async def counted():
            refills.append(1)
            await real()

        pool._refill = counted
        task = asyncio.get_running_loop().create_task(pool._loop())
        await asyncio.sleep(1.0)          # four intervals: an idle pool is not woken
        assert refills == []
        pool.want("base", "small", BASE)  # a keep_warm create wakes it at once
        await asyncio.sleep(0.05)
        assert len(refills) == 1
        task.cancel()

    asyncio.run(run())
