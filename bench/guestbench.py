"""Measure guest boot time and idle memory: `python bench/guestbench.py -n 20` (bench/run.sh sets PYTHONPATH).

Boots N host-rootfs guests one after another in a temporary state dir, prints
the boot time distribution (GuestManager.boot, i.e. until the agent answers
on 8443) and the idle memory of all of them (PSS summed over every guest
process, and the memory cgroups' usage), then destroys them.
"""
import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time

from microvm_localplane.guests import GuestManager, RootfsSpec


def pss_kib(pid):
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


async def bench(count, settle):
    state = tempfile.mkdtemp(prefix="mvlp-guestbench-")
    manager = GuestManager(state)
    guests, times = [], []
    try:
        await asyncio.sleep(settle)  # a quiet moment before measuring
        for i in range(count):
            started = time.monotonic()
            guests.append(await manager.boot("bench-%d" % i, "sb-%d" % i, RootfsSpec("base"), {}, None, "bench-%d" % i))
            times.append(time.monotonic() - started)
        await asyncio.sleep(settle)
        pss = sum(pss_kib(pid) for g in guests for pid in g._cgroup.pids()) / 1024
        memcg = sum(g.memory_bytes() for g in guests) / 2**20
        print("boots: %d  median %.3f s  min %.3f s  max %.3f s" % (count, statistics.median(times), min(times), max(times)))
        print("idle memory: PSS %.1f MiB total, %.1f MiB per guest; memory cgroups %.1f MiB"
              % (pss, pss / count, memcg))
        print("load average: %s" % " ".join(os.getloadavg().__repr__().strip("()").split(", ")))
    finally:
        for g in guests:
            await manager.destroy(g.session_id)
        await manager.shutdown(True)
        shutil.rmtree(state, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--count", type=int, default=20)
    parser.add_argument("--settle", type=float, default=1.0)
    args = parser.parse_args()
    asyncio.run(bench(args.count, args.settle))


if __name__ == "__main__":
    main()
