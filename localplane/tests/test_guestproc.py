"""A guest sees its size: /proc/meminfo and /proc/cpuinfo from its limits (guestproc.py), PID 1 named guest_init."""
import re

import pytest
from guestkit import Plane, guests_supported, sh, wait_until

from microvm_localplane import guestproc, limits

SIZE = "mars-4vcpu-8gb"


def kib(text, key):
    return int(re.search(r"^%s:\s+(\d+) kB$" % key, text, re.M).group(1))


def test_meminfo_from_the_limit_and_the_cgroup():
    lim = limits.for_size(SIZE)
    mib = 1 << 20
    text = guestproc.meminfo(lim, {"usage": 300 * mib, "file": 120 * mib, "shmem": 20 * mib})
    assert kib(text, "MemTotal") == 8192 * 1024
    assert kib(text, "MemFree") == (8192 - 300) * 1024
    assert kib(text, "MemAvailable") == (8192 - 300 + 100) * 1024  # page cache is reclaimable, tmpfs is not
    assert kib(text, "SwapTotal") == 0 and kib(text, "Shmem") == 20 * 1024
    # a usage above the limit (a racy read) never gives negative or impossible figures
    over = guestproc.meminfo(lim, {"usage": lim.memory * 2, "file": 0, "shmem": 0})
    assert kib(over, "MemFree") == 0 and kib(over, "MemAvailable") == 0
    # every rewrite has the same length, so an in-place refresh never leaves a reader a cut file
    assert len(text) == len(over) == len(guestproc.meminfo(lim, {}))


def test_cpuinfo_has_one_block_per_vcpu():
    host = "processor\t: 0\nmodel name\t: Some CPU\ncore id\t\t: 0\ncpu cores\t: 8\n\nprocessor\t: 1\n"
    text = guestproc.cpuinfo(limits.for_size(SIZE), host)
    assert re.findall(r"^processor\s*: (\d+)$", text, re.M) == ["0", "1", "2", "3"]
    assert re.findall(r"^cpu cores\s*: (\d+)$", text, re.M) == ["4"] * 4
    assert text.count("model name\t: Some CPU") == 4
    assert guestproc.vcpus(limits.SIZES["small"]) == 1


@pytest.mark.skipif(not guests_supported(), reason="needs root, runc and subordinate ids (make system-deps)")
@pytest.mark.timeout(180)
def test_a_guest_reads_its_size_and_pid1_is_named(tmp_path):
    plane = Plane(str(tmp_path / "state"))
    try:
        guest = plane.boot("procview", size=SIZE)
        stub = plane.stub(guest)
        meminfo = sh(stub, "cat /proc/meminfo").stdout.decode()
        assert kib(meminfo, "MemTotal") == 8192 * 1024
        assert 0 < kib(meminfo, "MemFree") <= kib(meminfo, "MemTotal")
        cpus = sh(stub, "grep -c ^processor /proc/cpuinfo").stdout.decode().strip()
        assert cpus == "4"
        assert sh(stub, "cat /proc/1/comm").stdout == b"guest_init\n"
        # the guest's root cannot change what it is told, nor reach the file behind it
        denied = sh(stub, "echo 'MemTotal: 1 kB' > /proc/meminfo 2>&1; echo rc=$?").stdout.decode()
        assert "rc=0" not in denied
        # the free figures follow the guest's own use: 256 MiB more in its /tmp (tmpfs) is 256 MiB less free
        before = kib(sh(stub, "cat /proc/meminfo").stdout.decode(), "MemFree")
        sh(stub, "head -c 268435456 /dev/zero > /tmp/fill")

        def dropped():
            now = kib(sh(stub, "cat /proc/meminfo").stdout.decode(), "MemFree")
            return before - now > 200 * 1024
        assert wait_until(dropped, limit=10)
    finally:
        plane.close()
