"""microvm.sandbox.sync against a hostile guest, through the real stack (ansible-playbook -> action plugin -> mux ->
gRPC -> local plane -> runc guest): what a guest sends back never writes, deletes or grants anything outside `dest`
on the controller, and the guest's unprivileged user cannot race a root push or pull out of its tree (issue 23)."""
import json
import os
import stat
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_sync import guest, guest_sh, guest_state, make_box, result, sync, write  # noqa: E402

# A guest whose python3 runs the sync program with its own link check switched off: the controller must not care
# what the guest's side decided (root in a guest can replace any program there).
HOSTILE_PYTHON = r"""#!/usr/bin/python3
import sys
src = sys.argv[2].replace("def link_is_safe(rel, target):",
                          "def link_is_safe(rel, target):\n    return True\n\n\ndef _honest(rel, target):")
# ... and packs `logs` into every pull's archive, asked for or not
src = src.replace("tar_selected(root_fd, wanted, f)", "tar_selected(root_fd, list(wanted) + [b'logs'], f)")
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

    guest_sh(plane, sid, "ln -s d/d/../../srv/victim {0}/out/logs && echo n > {0}/out/new.txt".format(base))
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
    if guest_side == "honest":
        assert not second.get("failed") and second["left_out"] == ["logs"], second
    else:  # sent as a link to pull, left out by the controller's own judgement, then slipped into the archive
        assert second.get("failed") and "'logs': not asked for" in second["msg"], second
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


# Builds a tree spec (as tests/unit/plugins/plugin_utils/test_sync_hostile.py makes them) in the guest, as the
# guest's user would: never through a link.
GUEST_BUILD = r"""
import json, os, stat, sys
root, outside, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
os.makedirs(root, exist_ok=True)
for parts, kind, target in spec:
    here = root
    for part in parts[:-1]:
        here = os.path.join(here, part)
        if not os.path.lexists(here):
            os.mkdir(here)
        elif not stat.S_ISDIR(os.lstat(here).st_mode):
            break
    else:
        path = os.path.join(here, parts[-1])
        if os.path.lexists(path):
            continue
        if kind == "f":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            os.write(fd, b"guest %s\n" % "/".join(parts).encode())
            os.close(fd)
        elif kind == "d":
            os.mkdir(path)
        else:
            os.symlink(target.replace("@OUT@", outside), path)
"""


def test_random_trees_of_links_pushed_and_pulled_change_nothing_outside(plane, box, tmp_path):
    """A few random trees of links (the unit property tests run many more) through the real stack: pushed into a
    guest dest where the guest plants its own random links (to /etc/decoy-prop, up with `..`, loops), and pulled
    back into a controller dest holding random links of its own, twice: nothing outside either dest changes."""
    import hypothesis
    from hypothesis import strategies as hst
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "unit", "plugins", "plugin_utils"))
    import test_sync_hostile as props

    sid = box["sid"]
    guest_sh(plane, sid, "rm -rf /etc/decoy-prop && mkdir -p /etc/decoy-prop/sub && echo keep > /etc/decoy-prop/f && "
                         "cat > /workspace/.build.py <<'EOF'\n%sEOF" % GUEST_BUILD)
    etc_before = guest_state(plane, sid, "/etc")
    counter = [0]
    worked = set()

    @hypothesis.settings(max_examples=3, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(rounds=hst.lists(hst.tuples(props.TREE, props.TREE, props.TREE, hst.booleans()),
                                       min_size=2, max_size=2))
    def run(rounds):
        counter[0] += 1
        area = tmp_path / ("arena-%d" % counter[0])
        outside = props.arena(str(area))
        dest = os.path.join(str(area), "area", "D")
        gdest = "/workspace/prop-%d/D" % counter[0]
        guest_sh(plane, sid, "mkdir -p %s && echo sibling > /workspace/prop-%d/sibling" % (gdest, counter[0]))
        for i, (src_tree, planted, local_links, delete) in enumerate(rounds):
            src = os.path.join(str(area), "src-%d" % i)
            props.build(src, src_tree, outside)
            res = guest(plane, sid, ["python3", "/workspace/.build.py", gdest, "/etc/decoy-prop", json.dumps(planted)])
            assert res["exit_code"] == 0, res
            props.build(dest, local_links, outside)
            guest_before = guest_state(plane, sid, "/workspace/prop-%d" % counter[0])
            local_before = props.snapshot(str(area), dest)
            tasks = [{"name": "push", "microvm.sandbox.sync": {"src": src, "dest": gdest, "delete": delete},
                      "ignore_errors": True},
                     {"name": "pull", "microvm.sandbox.sync": {"mode": "pull", "src": gdest, "dest": dest,
                                                               "delete": delete}, "ignore_errors": True}]
            played = sync(plane, box, tmp_path, tasks=tasks)
            assert played.rc == 0, played
            for task in ("push", "pull"):
                res = played.result(task)
                if not res.get("failed") and res.get("changed"):
                    worked.add(task)
            guest_after = guest_state(plane, sid, "/workspace/prop-%d" % counter[0])
            assert {k: v for k, v in guest_after.items() if not k.startswith("D")} == \
                {k: v for k, v in guest_before.items() if not k.startswith("D")}
            assert props.snapshot(str(area), dest) == local_before
            assert guest_state(plane, sid, "/etc") == etc_before

    run()
    assert worked == {"push", "pull"}, "no push or no pull of the random trees went through: the test proved nothing"


def test_guest_names_reach_the_screen_escaped_in_the_warning_and_the_diff(plane, box, tmp_path):
    """A guest chooses its file names: the left-out warning and the --diff show an escape sequence or a bidi override
    in one as visible escapes, never raw on the user's terminal; the task's result keeps the names as they are."""
    root = "/workspace/escaped-names"
    guest_sh(plane, box["sid"], "rm -rf {r} && mkdir -p {r} && cd {r} && mkfifo \"$(printf 'pipe\\033[2J')\" && "
             "printf x > \"$(printf 'clear\\033[2J\\342\\200\\256txt.exe')\"".format(r=root))
    out = str(tmp_path / "out")
    os.makedirs(out)
    run = sync(plane, box, tmp_path, {"mode": "pull", "src": root, "dest": out}, diff=True)
    res = result(run)
    assert res["left_out"] == ["pipe\x1b[2J"] and res["added"] == ["clear\x1b[2J\u202etxt.exe"]
    screen = run.stdout + run.stderr
    assert "1 entry left out" in screen and "pipe\\x1b[2J" in screen, run
    assert "+ clear\\x1b[2J\\u202etxt.exe" in screen, run
    assert "\x1b" not in screen and "\u202e" not in screen, run
