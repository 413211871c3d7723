"""microvm.sandbox.sync against a hostile guest, through the real stack (ansible-playbook -> action plugin -> mux ->
gRPC -> local plane -> runc guest): what a guest sends back never writes, deletes or grants anything outside `dest`
on the controller, and the guest's unprivileged user cannot race a root push or pull out of its tree (issue 23)."""
import os
import stat
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_sync import guest_sh, guest_state, make_box, result, sync, write  # noqa: E402

# A guest whose python3 runs the sync program with its own link check switched off: the controller must not care
# what the guest's side decided (root in a guest can replace any program there).
HOSTILE_PYTHON = r"""#!/usr/bin/python3
import sys
src = sys.argv[2].replace("def link_is_safe(rel, target):",
                          "def link_is_safe(rel, target):\n    return True\n\n\ndef _honest(rel, target):")
sys.argv = ["-c"] + sys.argv[3:]
exec(compile(src, "<hostile sync>", "exec"), {"__name__": "__main__"})
"""


@pytest.fixture(scope="module")
def box(plane, tmp_path_factory):
    """A session of this module's own (the race tests leave a guest user's processes behind until they end)."""
    yield from make_box(plane, tmp_path_factory)


def snapshot(root):
    """Every entry under root: {path: (kind, mode, content or link target)}, links never followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                out[full] = ("l", 0, os.readlink(full))
            elif stat.S_ISDIR(st.st_mode):
                out[full] = ("d", st.st_mode, "")
            else:
                with open(full, "rb") as f:
                    out[full] = ("f", st.st_mode, f.read())
    return out


def hostile_python(plane, sid):
    path = "/workspace/.hostile-python3"
    guest_sh(plane, sid, "cat > %s <<'EOF'\n%sEOF\nchmod 755 %s" % (path, HOSTILE_PYTHON, path))
    return path


def pull_task(name, src, dest, interpreter=None, **extra):
    task = {"name": name, "microvm.sandbox.sync": dict({"mode": "pull", "src": src, "dest": dest}, **extra),
            "ignore_errors": True}
    if interpreter:
        task["vars"] = {"ansible_python_interpreter": interpreter}
    return task


@pytest.mark.parametrize("guest_side", ["honest", "hostile"])
def test_pull_never_writes_or_deletes_outside_dest_cve_2024_12088(plane, box, tmp_path, guest_side):
    """The issue's repro: `d -> .` pulled, then `logs -> d/d/../../srv/victim` (inside, read as text; outside once
    `d` is the link already in dest), then a pull into dest/logs with delete. On main the file lands in the victim
    dir and the victim's files are deleted."""
    sid = box["sid"]
    base = "/workspace/cve-%s" % guest_side
    victim = tmp_path / "srv" / "victim"
    victim.mkdir(parents=True)
    (victim / "precious.txt").write_text("keep me\n")
    dest = tmp_path / "x" / "D"  # two levels below tmp_path: d/d/../.. from D is tmp_path
    (tmp_path / "x").mkdir()
    before = snapshot(str(tmp_path))
    interpreter = hostile_python(plane, sid) if guest_side == "hostile" else None

    guest_sh(plane, sid, "rm -rf {0} && mkdir -p {0}/out {0}/logs && ln -s . {0}/out/d && "
                         "echo planted > {0}/logs/planted.txt".format(base))
    run = sync(plane, box, tmp_path, tasks=[pull_task("first", base + "/out", str(dest), interpreter)])
    assert not run.result("first").get("failed"), run
    assert os.readlink(str(dest / "d")) == "."

    guest_sh(plane, sid, "ln -s d/d/../../srv/victim %s/out/logs" % base)
    run = sync(plane, box, tmp_path, tasks=[pull_task("second", base + "/out", str(dest), interpreter)])
    second = run.result("second")

    run = sync(plane, box, tmp_path, tasks=[pull_task("third", base + "/logs", str(dest / "logs"), interpreter,
                                                      delete=True)])
    assert not run.result("third").get("failed"), run
    after = snapshot(str(tmp_path))
    changed = {p for p in set(before) | set(after)
               if before.get(p) != after.get(p) and not p.startswith(str(dest)) and "/run-" not in p}
    assert sorted(os.listdir(str(victim))) == ["precious.txt"], "the pull wrote and deleted in the victim dir"
    assert changed == set(), "the pull changed things outside dest: %s" % sorted(changed)
    # the hostile guest sent it as a link to pull: the controller left it out on its own judgement
    assert not second.get("failed") and second["left_out"] == ["logs"], second
    assert (dest / "logs" / "planted.txt").read_text() == "planted\n" and not os.path.islink(str(dest / "logs"))


def test_pulled_links_are_judged_against_dest_on_disk(plane, box, tmp_path):
    """A link that is safe as text (`cache/sub`) but leads out through a link dest already holds (the user's own
    `cache -> <outside>`) is refused before anything moves; a hostile guest's extra archive member too."""
    sid = box["sid"]
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    dest = tmp_path / "D"
    dest.mkdir()
    os.symlink(str(outside), str(dest / "cache"))
    guest_sh(plane, sid, "rm -rf /workspace/ondisk && mkdir -p /workspace/ondisk && echo a > /workspace/ondisk/a && "
                         "ln -s cache/sub /workspace/ondisk/through")
    run = sync(plane, box, tmp_path, tasks=[pull_task("pull", "/workspace/ondisk", str(dest))])
    res = run.result("pull")
    assert res.get("failed") and "through" in res["msg"] and "nothing was changed" in res["msg"], res
    assert not os.path.lexists(str(dest / "through")) and not os.path.exists(str(dest / "a"))
    assert os.listdir(str(outside)) == ["sub"]


def test_pull_drops_setid_bits_and_keeps_dest_private(plane, box, tmp_path):
    """A guest's `chmod 4755` copy of `id` (and a 2775 dir, and a 0777 source root) pulled by root on the
    controller: no set-id bit lands and dest itself is not world-writable, unless preserve_setid asks for the bits."""
    sid = box["sid"]
    assert os.getuid() == 0, "the attack needs the controller's pull to run as root"
    guest_sh(plane, sid, "rm -rf /workspace/suid && mkdir -p /workspace/suid/g && cp /usr/bin/id /workspace/suid/id && "
                         "chmod 4755 /workspace/suid/id && chmod 2775 /workspace/suid/g && chmod 6750 /workspace/suid && "
                         "chmod 0777 /workspace/suid")
    dest = tmp_path / "D"
    res = result(sync(plane, box, tmp_path, {"mode": "pull", "src": "/workspace/suid", "dest": str(dest)}))
    assert res["changed"] is True
    modes = {name: stat.S_IMODE(os.lstat(str(dest / name)).st_mode) for name in ("id", "g")}
    assert modes == {"id": 0o755, "g": 0o775}, {k: oct(v) for k, v in modes.items()}
    assert stat.S_IMODE(os.stat(str(dest)).st_mode) & 0o7002 == 0, oct(os.stat(str(dest)).st_mode)
    # idempotent: the bits left behind are not a change each run
    assert result(sync(plane, box, tmp_path, {"mode": "pull", "src": "/workspace/suid", "dest": str(dest)}))[
        "changed"] is False

    kept = tmp_path / "K"
    result(sync(plane, box, tmp_path, {"mode": "pull", "src": "/workspace/suid", "dest": str(kept),
                                       "preserve_setid": True}))
    assert stat.S_IMODE(os.lstat(str(kept / "id")).st_mode) == 0o4755
    assert stat.S_IMODE(os.lstat(str(kept / "g")).st_mode) == 0o2775
    assert stat.S_IMODE(os.stat(str(kept)).st_mode) & 0o002 == 0


def test_push_drops_setid_bits_unless_asked(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "tool", "#!/bin/sh\n", mode=0o4755)
    result(sync(plane, box, tmp_path, {"src": src, "dest": "/workspace/setid-push"}))
    assert guest_state(plane, sid, "/workspace/setid-push")["tool"][1] == 0o755
    result(sync(plane, box, tmp_path, {"src": src, "dest": "/workspace/setid-push", "preserve_setid": True}))
    assert guest_state(plane, sid, "/workspace/setid-push")["tool"][1] == 0o4755


def test_guest_program_fits_one_argument():
    """The guest side travels as one argv string: Linux refuses one longer than MAX_ARG_STRLEN (128 KiB)."""
    from ansible_collections.microvm.sandbox.plugins.action.sync import guest_program
    assert len(guest_program().encode()) < 128 * 1024 - 4096



# The guest's unprivileged user swaps a directory and a link to /etc/decoy with renameat2(RENAME_EXCHANGE), as fast
# as it can, until the stop file appears (or ten minutes pass).
RACER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": 316, "aarch64": 276}[os.uname().machine]
a, b, stop, count = sys.argv[1].encode(), sys.argv[2].encode(), sys.argv[3], sys.argv[4]
n, end = 0, time.time() + 600
while n % 4096 or not (os.path.exists(stop) or time.time() > end):
    if libc.syscall(nr, -100, a, -100, b, 2) == 0:
        n += 1
with open(count, "w") as f:
    f.write(str(n))
"""
PUSHES = 24


def test_root_push_and_pull_cannot_be_raced_out_of_the_tree_by_the_guest_user(plane, box, tmp_path):
    """The `sandbox` user owns /workspace/race and exchanges its dir `t` with a link `evil -> /etc/decoy` in a loop
    while root pushes (with delete) into /workspace/race/t/sub and pulls it: nothing under /etc changes, nothing of
    /etc/decoy reaches the controller. On main about half the pushes wrote and deleted in /etc/decoy."""
    sid = box["sid"]
    guest_sh(plane, sid, "rm -rf /workspace/race /etc/decoy && mkdir -p /etc/decoy/sub /workspace/race/t/sub && "
                         "echo keep > /etc/decoy/sub/keep.conf && ln -s /etc/decoy /workspace/race/evil && "
                         "chown -hR sandbox:sandbox /workspace/race && cat > /workspace/.racer.py <<'EOF'\n%sEOF" % RACER)
    etc_before = guest_state(plane, sid, "/etc")
    src = str(tmp_path / "src")
    write(src, "pwn.conf", "written by the push\n")
    guest_sh(plane, sid, "setsid -f setpriv --reuid=sandbox --regid=sandbox --init-groups -- python3 /workspace/.racer.py "
                         "/workspace/race/t /workspace/race/evil /workspace/race/stop /workspace/race/count "
                         "</dev/null >/dev/null 2>&1 &")
    try:
        tasks = [{"name": "push", "microvm.sandbox.sync": {"src": src, "dest": "/workspace/race/t/sub",
                                                           "delete": True},
                  "loop": list(range(PUSHES)), "ignore_errors": True},
                 {"name": "pull", "microvm.sandbox.sync": {"mode": "pull", "src": "/workspace/race/t/sub",
                                                           "dest": str(tmp_path / "out-{{ item }}")},
                  "loop": list(range(PUSHES // 2)), "ignore_errors": True}]
        run = sync(plane, box, tmp_path, tasks=tasks)
    finally:
        guest_sh(plane, sid, "touch /workspace/race/stop; for i in $(seq 100); do "
                             "[ -e /workspace/race/count ] && break; sleep 0.1; done")
    swaps = int(guest_sh(plane, sid, "cat /workspace/race/count"))
    assert swaps > 1000, "the racer hardly ran: %d exchanges" % swaps
    assert guest_state(plane, sid, "/etc") == etc_before, "a root push wrote or deleted under /etc"
    for i in range(PUSHES // 2):
        out = tmp_path / ("out-%d" % i)
        assert not (out / "keep.conf").exists(), "a root pull read /etc/decoy"
    pushed = guest_sh(plane, sid, "cat /workspace/race/t/sub/pwn.conf /workspace/race/evil/sub/pwn.conf 2>/dev/null; true")
    assert "written by the push" in pushed, run  # the pushes did land, in the tree
