"""microvm.sandbox.sync through the real stack: ansible-playbook -> action plugin -> mux -> gRPC -> port-forward
WebSocket -> local control plane -> guest agent and the guest's python3, both ways."""
import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import run_playbook  # noqa: E402
from microvm_plane_testing import stop_muxes, unique_name  # noqa: E402

# The state of a tree as {relative path: [kind, mode, mtime, sha256 or link target]}, the same on both sides.
STATE_SCRIPT = r"""
import hashlib, json, os, stat, sys
root = sys.argv[1]
out = {}
if os.path.isdir(root):
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ["l", 0, 0, os.readlink(full)]
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ["d", stat.S_IMODE(st.st_mode), int(st.st_mtime), ""]
            else:
                with open(full, "rb") as f:
                    out[rel] = ["f", stat.S_IMODE(st.st_mode), int(st.st_mtime), hashlib.sha256(f.read()).hexdigest()]
print(json.dumps(out, sort_keys=True))
"""


def local_state(root):
    out = subprocess.run([sys.executable, "-c", STATE_SCRIPT, root], capture_output=True, check=True, text=True)
    return json.loads(out.stdout)


def guest(plane, sid, argv):
    res = plane.client().request("POST", "/sessions/%s/sandbox/exec" % sid, body={"argv": argv})
    return res


def guest_sh(plane, sid, script):
    res = guest(plane, sid, ["sh", "-c", script])
    assert res["exit_code"] == 0, res
    return res["stdout"]


def guest_state(plane, sid, root):
    res = guest(plane, sid, ["python3", "-c", STATE_SCRIPT, root])
    assert res["exit_code"] == 0, res
    return json.loads(res["stdout"])


def without(state, *prefixes):
    return {k: v for k, v in state.items() if not any(k == p or k.startswith(p + "/") for p in prefixes)}


def write(root, rel, data=b"", mode=0o644, mtime=None):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    os.chmod(path, mode)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture(scope="module")
def box(plane, tmp_path_factory):
    """One session for the module's tests (each uses its own directories), a private mux dir and an inventory."""
    yield from make_box(plane, tmp_path_factory)


def make_box(plane, tmp_path_factory):
    client = plane.client()
    session = client.wait_session(client.create_session({"name": unique_name("sync"), "agent": "custom"})["session_id"],
                                  timeout=120)
    base = tmp_path_factory.mktemp("sync")
    mux = str(base / "mux")
    inv = base / "inventory.ini"
    inv.write_text("[sbx]\nbox ansible_host=%s\n\n[sbx:vars]\nansible_connection=microvm.sandbox.agent\n"
                   "ansible_python_interpreter=/usr/bin/python3\n" % session["session_id"])
    # no team switch on the api road: sync needs no interactive stdin there (the team's default, off, applies)
    try:
        yield {"sid": session["session_id"], "inventory": str(inv), "env": {"MICROVM_MUX_DIR": mux, "MICROVM_PERSIST": "30"}}
    finally:
        stop_muxes(mux)
        client.delete_session(session["session_id"])


def sync(plane, box, tmp_path, args=None, check=False, diff=False, tasks=None, env=None, **play_keywords):
    """Run microvm.sandbox.sync once (or the given task list) against the box; -> the PlaybookRun."""
    if tasks is None:
        tasks = [{"name": "sync", "microvm.sandbox.sync": args}]
    play = [dict({"hosts": "sbx", "gather_facts": False, "tasks": tasks}, **play_keywords)]
    extra = []
    if check:
        extra.append("--check")
    if diff:
        extra.append("--diff")
    run_dir = tmp_path / ("run-%s" % os.urandom(3).hex())
    run_dir.mkdir()
    return run_playbook(plane, run_dir, json.dumps(play), args=extra, env=dict(box["env"], **(env or {})),
                        inventory=box["inventory"])


def result(run, task="sync"):
    res = run.result(task)
    assert not res.get("failed"), run
    return res


def sample_tree(root):
    write(root, "a.txt", "alpha\n", mtime=1_600_000_000)
    write(root, "dir one/b.txt", "bravo\n", mtime=1_600_000_100)
    write(root, "dir one/deeper/c.bin", os.urandom(300_000), mtime=1_600_000_200)
    write(root, "üñï cödé ☃.txt", "unicode\n", mode=0o600, mtime=1_600_000_300)
    write(root, "run.sh", "#!/bin/sh\necho hi\n", mode=0o755, mtime=1_600_000_400)
    write(root, "shared.txt", "group writable\n", mode=0o664, mtime=1_600_000_500)
    os.makedirs(os.path.join(root, "empty dir"))
    os.makedirs(os.path.join(root, "private"), mode=0o700)
    os.chmod(os.path.join(root, "private"), 0o700)
    write(root, "private/secret.txt", "s\n", mode=0o640, mtime=1_600_000_600)
    os.symlink("dir one/b.txt", os.path.join(root, "link-to-b"))
    os.symlink("deeper", os.path.join(root, "dir one", "link-to-deeper"))
    os.symlink("../../a.txt", os.path.join(root, "dir one", "deeper", "up-to-a"))
    for d in ("dir one/deeper", "dir one", "empty dir", "private"):
        os.utime(os.path.join(root, d), (1_600_001_000, 1_600_001_000))


def test_push_incremental_delete_and_pull(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    sample_tree(src)
    dest = "/workspace/push1"

    first = result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert first["changed"] is True
    assert "a.txt" in first["added"] and "dir one/deeper/c.bin" in first["added"] and "empty dir" in first["added"]
    assert guest_state(plane, sid, dest) == local_state(src)

    again = result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert again["changed"] is False, again
    assert again["counts"] == {"added": 0, "updated": 0, "deleted": 0, "left_out": 0}

    # one file changed (same size, new mtime), one new, one gone
    write(src, "dir one/b.txt", "BRAVO\n", mtime=1_700_000_000)
    write(src, "dir one/new.txt", "new\n", mtime=1_700_000_001)
    os.unlink(os.path.join(src, "a.txt"))
    keep = result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert keep["changed"] is True
    # a directory whose mtime moved (a new entry in it) is updated too, like rsync -a's ".d..t"
    assert keep["updated"] == ["dir one", "dir one/b.txt"] and keep["added"] == ["dir one/new.txt"]
    assert keep["deleted"] == []
    assert "a.txt" in guest_state(plane, sid, dest), "without delete nothing is removed"
    assert without(guest_state(plane, sid, dest), "a.txt", ".") == without(local_state(src), ".")

    deleted = result(sync(plane, box, tmp_path, {"src": src, "dest": dest, "delete": True}))
    assert deleted["deleted"] == ["a.txt"] and deleted["added"] == [] and deleted["updated"] == []
    assert guest_state(plane, sid, dest) == local_state(src)
    assert result(sync(plane, box, tmp_path, {"src": src, "dest": dest, "delete": True}))["changed"] is False

    # pull the same tree back into a fresh directory, then incrementally
    out = str(tmp_path / "out")
    pulled = result(sync(plane, box, tmp_path, {"mode": "pull", "src": dest, "dest": out}))
    assert pulled["changed"] is True
    assert local_state(out) == local_state(src)
    assert result(sync(plane, box, tmp_path, {"mode": "pull", "src": dest, "dest": out}))["changed"] is False
    guest_sh(plane, sid, "cd %s && echo more >> 'dir one/new.txt' && rm -r 'dir one/deeper' && mkdir -p results/x "
                         "&& echo r > results/x/r.txt" % dest)
    write(out, "local-only.txt", "mine\n")
    inc = result(sync(plane, box, tmp_path, {"mode": "pull", "src": dest, "dest": out, "delete": True}))
    assert inc["updated"] == ["dir one", "dir one/new.txt"]
    assert inc["added"] == ["results", "results/x", "results/x/r.txt"]
    assert sorted(inc["deleted"]) == ["dir one/deeper", "local-only.txt"]
    assert local_state(out) == guest_state(plane, sid, dest)


def test_excludes_gitignore_and_protected_destination(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "keep.py", "k\n")
    write(src, "mod/__pycache__/x.pyc", "c\n")
    write(src, "mod/y.pyc", "c\n")
    write(src, "mod/keep.pyc", "c\n")
    write(src, "build/out.o", "o\n")
    write(src, "sub/build/kept.txt", "anchored patterns only match at the root\n")
    write(src, "node_modules/pkg/index.js", "js\n")
    write(src, "logs/today.log", "l\n")
    ignore = write(str(tmp_path), "gitignore", "# comment\n\n*.pyc\n!keep.pyc\n/build/\nnode_modules\n")
    dest = "/workspace/excl"
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": dest, "exclude_from": [ignore],
                                             "exclude": ["__pycache__/", "logs/*.log"]}))
    assert sorted(guest_state(plane, sid, dest)) == sorted(["keep.py", "mod", "mod/keep.pyc", "sub", "sub/build",
                                                            "sub/build/kept.txt", "logs"]), res
    # excluded entries of the destination are never deleted, not even with delete
    guest_sh(plane, sid, "mkdir -p %s/node_modules/cache && echo z > %s/node_modules/cache/z && echo p > %s/mod/p.pyc"
             % (dest, dest, dest))
    os.unlink(os.path.join(src, "keep.py"))
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": dest, "exclude_from": [ignore], "delete": True,
                                             "exclude": ["__pycache__/", "logs/*.log"]}))
    assert res["deleted"] == ["keep.py"]
    state = guest_state(plane, sid, dest)
    assert "node_modules/cache/z" in state and "mod/p.pyc" in state and "keep.py" not in state


def test_check_mode_and_diff_change_nothing(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "same.txt", "same\n", mtime=1_600_000_000)
    write(src, "changed.txt", "new content\n", mtime=1_600_000_000)
    write(src, "added/file.txt", "added\n")
    dest = "/workspace/checkmode"
    guest_sh(plane, sid, "mkdir -p {d} && cd {d} && printf 'same\\n' > same.txt && touch -d @1600000000 same.txt && "
                         "echo old > changed.txt && echo gone > gone.txt".format(d=dest))
    before = guest_state(plane, sid, dest)
    run = sync(plane, box, tmp_path, {"src": src, "dest": dest, "delete": True}, check=True, diff=True)
    res = result(run)
    assert res["changed"] is True
    assert res["added"] == ["added", "added/file.txt"] and res["updated"] == ["changed.txt"]
    assert res["deleted"] == ["gone.txt"]
    assert "+ added/file.txt" in run.stdout and "~ changed.txt" in run.stdout and "- gone.txt" in run.stdout, run
    assert guest_state(plane, sid, dest) == before, "check mode changed the sandbox"
    # pull in check mode creates nothing locally
    out = tmp_path / "never"
    res = result(sync(plane, box, tmp_path, {"mode": "pull", "src": dest, "dest": str(out)}, check=True))
    assert res["changed"] is True and not out.exists()


def test_type_changes_and_modes(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    dest = "/workspace/types"
    write(src, "thing", "a file\n")
    write(src, "other/inner.txt", "inner\n")
    os.chmod(os.path.join(src, "other"), 0o750)
    result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert guest_state(plane, sid, dest) == local_state(src)

    os.unlink(os.path.join(src, "thing"))
    write(src, "thing/now-a-dir.txt", "x\n")
    shutil.rmtree(os.path.join(src, "other"))
    write(src, "other", "now a file\n", mode=0o600)
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert sorted(res["updated"]) == ["other", "thing"] and res["added"] == ["thing/now-a-dir.txt"]
    assert guest_state(plane, sid, dest) == local_state(src)

    shutil.rmtree(os.path.join(src, "thing"))
    write(src, "thing", "a file again\n", mode=0o700)
    os.chmod(os.path.join(src, "other"), 0o644)
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert sorted(res["updated"]) == ["other", "thing"], res
    assert guest_state(plane, sid, dest) == local_state(src)

    out = str(tmp_path / "out")
    result(sync(plane, box, tmp_path, {"mode": "pull", "src": dest, "dest": out}))
    assert local_state(out) == local_state(src)


def test_links_never_followed_out_of_either_tree(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("controller secret\n")
    write(src, "in.txt", "in\n")
    os.symlink(str(outside), os.path.join(src, "abs-out"))
    os.symlink("../outside/secret.txt", os.path.join(src, "rel-out"))
    os.symlink("in.txt", os.path.join(src, "inside"))
    dest = "/workspace/links"
    run = sync(plane, box, tmp_path, {"src": src, "dest": dest})
    res = result(run)
    assert sorted(res["left_out"]) == ["abs-out", "rel-out"] and res["counts"]["left_out"] == 2
    state = guest_state(plane, sid, dest)
    assert state["inside"] == ["l", 0, 0, "in.txt"] and "abs-out" not in state and "rel-out" not in state
    assert "controller secret" not in guest_sh(plane, sid, "cat %s/* 2>/dev/null || true" % dest)

    # in the guest: a link out of the tree is not pulled, and a local link is replaced, never written through
    guest_sh(plane, sid, "cd %s && ln -s /etc guest-etc && mkdir -p through && echo t > through/t.txt" % dest)
    out = str(tmp_path / "out")
    os.makedirs(out)
    os.symlink(str(outside), os.path.join(out, "through"))
    res = result(sync(plane, box, tmp_path, {"mode": "pull", "src": dest, "dest": out}))
    assert "guest-etc" in res["left_out"] and not os.path.lexists(os.path.join(out, "guest-etc"))
    assert sorted(os.listdir(outside)) == ["secret.txt"], "the pull wrote through a local link"
    assert os.path.isdir(os.path.join(out, "through")) and not os.path.islink(os.path.join(out, "through"))
    assert open(os.path.join(out, "through", "t.txt")).read() == "t\n"

    # a guest directory that holds a link where the source has a directory: replaced, not followed
    guest_sh(plane, sid, "mkdir -p /workspace/victim && ln -s /workspace/victim %s/sub" % dest)
    write(src, "sub/planted.txt", "p\n")
    result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert guest_sh(plane, sid, "ls -A /workspace/victim") == ""
    assert guest_state(plane, sid, dest)["sub/planted.txt"][0] == "f"


def test_destination_through_a_link_out_of_the_workspace_is_refused(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "evil.txt", "x\n")
    guest_sh(plane, sid, "mkdir -p /opt/target && ln -sfn /opt/target /workspace/escape")
    run = sync(plane, box, tmp_path, {"src": src, "dest": "/workspace/escape/sub"})
    res = run.result("sync")
    assert res["failed"], run
    assert "outside /workspace" in res["msg"] and "/opt/target" in res["msg"], res["msg"]
    assert guest_sh(plane, sid, "ls -A /opt/target") == ""
    run = sync(plane, box, tmp_path, {"mode": "pull", "src": "/workspace/escape", "dest": str(tmp_path / "o")})
    assert run.result("sync")["failed"], run


def test_destination_outside_the_workspace_is_staged(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "app/main.py", "print('hi')\n", mode=0o755, mtime=1_600_000_000)
    write(src, "README", "r\n", mtime=1_600_000_000)
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": "/opt/app-sync"}))
    assert res["changed"] is True
    assert guest_state(plane, sid, "/opt/app-sync") == local_state(src)
    assert result(sync(plane, box, tmp_path, {"src": src, "dest": "/opt/app-sync"}))["changed"] is False
    out = str(tmp_path / "out")
    result(sync(plane, box, tmp_path, {"mode": "pull", "src": "/opt/app-sync", "dest": out}))
    assert local_state(out) == local_state(src)
    # nothing left in the scratch dir by the runs
    assert "sync-" not in guest_sh(plane, sid, "ls -A /workspace/.scratch/*/ 2>/dev/null || true")


def test_workspace_root_keeps_the_scratch_dir(plane, box, tmp_path):
    src = str(tmp_path / "src")
    write(src, "only.txt", "o\n")
    run = sync(plane, box, tmp_path, {"src": src, "dest": "/workspace", "delete": True}, check=True)
    res = result(run)
    assert not any(p == ".scratch" or p.startswith(".scratch/") for p in res["deleted"]), res["deleted"]
    assert "home" in res["deleted"], res  # the rest of /workspace would go, the scratch dir would not


def test_paused_session_between_runs(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "f.txt", "one\n", mtime=1_600_000_000)
    dest = "/workspace/paused"
    result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    # paused the moment the run ended: the mux's housekeeping leaves it paused (run_dirs.RunDirs)
    client = plane.client()
    client.pause_session(sid)
    client.wait_session(sid, until={"PAUSED", "SESSION_STATUS_PAUSED"}, timeout=60)
    write(src, "f.txt", "two\n", mtime=1_600_000_100)
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert res["updated"] == ["f.txt"]
    assert guest_state(plane, sid, dest) == local_state(src)
    assert result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))["changed"] is False


def test_checksum_mode_sees_same_size_same_mtime_changes(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "f.txt", "aaaa\n", mtime=1_600_000_000)
    dest = "/workspace/checksum"
    result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    guest_sh(plane, sid, "printf 'bbbb\\n' > %s/f.txt && touch -d @1600000000 %s/f.txt" % (dest, dest))
    assert result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))["changed"] is False
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": dest, "checksum": True}))
    assert res["updated"] == ["f.txt"]
    assert guest_state(plane, sid, dest) == local_state(src)
    assert result(sync(plane, box, tmp_path, {"src": src, "dest": dest, "checksum": True}))["changed"] is False


def test_bad_input_is_named(plane, box, tmp_path):
    run = sync(plane, box, tmp_path, {"src": str(tmp_path / "missing"), "dest": "/workspace/x"})
    assert "is not a directory on the controller" in run.result("sync")["msg"]
    run = sync(plane, box, tmp_path, {"mode": "pull", "src": "/workspace/does-not-exist", "dest": str(tmp_path / "o")})
    assert "does not exist" in run.result("sync")["msg"]
    run = sync(plane, box, tmp_path, {"src": str(tmp_path), "dest": "/workspace/x", "exclude_from": ["/nonexistent"]})
    assert "exclude_from" in run.result("sync")["msg"]


@pytest.fixture
def proxy(plane):
    """The fault proxy of tests/faults in front of the local plane."""
    if plane.live:
        pytest.skip("the fault proxy sits in front of the local control plane only")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults"))
    from faultproxy import FaultProxy
    p = FaultProxy(plane.url).start()
    try:
        yield p
    finally:
        p.stop()


def files_only(state):
    return {k: v[3] for k, v in state.items() if v[0] != "d"}


@pytest.mark.agent_road("the fault proxy cuts the port-forward WebSocket, which the api road does not use")
@pytest.mark.parametrize("fraction", [0.3, 0.95], ids=["mid-archive", "end-of-archive"])
def test_cut_connection_leaves_each_file_old_or_new(plane, box, tmp_path, proxy, fraction):
    sid = box["sid"]
    src = str(tmp_path / "src")
    dest = "/workspace/cut-%s" % int(fraction * 100)
    for i in range(4):
        write(src, "big/%d.bin" % i, os.urandom(1 << 20) * 2, mtime=1_600_000_000)
    for i in range(40):
        write(src, "small/%02d.txt" % i, "old %d\n" % i, mtime=1_600_000_000)
    result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    old = files_only(guest_state(plane, sid, dest))

    for i in range(4):
        write(src, "big/%d.bin" % i, os.urandom(1 << 20) * 2, mtime=1_700_000_000)
    for i in range(40):
        write(src, "small/%02d.txt" % i, "new content %d\n" % i, mtime=1_700_000_000)
    write(src, "small/added.txt", "added\n")
    new = files_only(local_state(src))

    mux = str(tmp_path / "cut-mux")
    proxy.cut_ws(up=int(8 * (1 << 20) * fraction))
    run = sync(plane, box, tmp_path, {"src": src, "dest": dest},
               env={"DO_AGENTS_API_URL": proxy.url, "MICROVM_MUX_DIR": mux, "MICROVM_CONNECT_TIMEOUT": "20"})
    stop_muxes(mux)
    assert run.rc != 0, run
    assert proxy.cuts == ["cut-up"], (proxy.cuts, run.result("sync"))
    after = files_only(guest_state(plane, sid, dest))
    assert set(after) <= set(old) | set(new), "stray names after the cut: %s" % (set(after) - set(old) - set(new))
    for path, sha in after.items():
        assert sha in (old.get(path), new.get(path)), "%s is neither the old nor the new file after the cut" % path

    result(sync(plane, box, tmp_path, {"src": src, "dest": dest}))
    assert files_only(guest_state(plane, sid, dest)) == new


def test_roles_restore_from_and_export_to_a_directory(plane, box, tmp_path):
    sid = box["sid"]
    src = str(tmp_path / "src")
    write(src, "project/main.py", "print(1)\n", mtime=1_600_000_000)
    write(src, "project/__pycache__/main.cpython.pyc", "c\n")
    write(src, "notes.txt", "n\n", mtime=1_600_000_000)
    guest_sh(plane, sid, "mkdir -p /workspace/restored && echo stale > /workspace/restored/stale.txt")
    exported = str(tmp_path / "exported")
    tasks = [
        {"name": "restore", "ansible.builtin.include_role": {"name": "microvm.sandbox.workspace_restore"},
         "vars": {"workspace_restore_src": src, "workspace_restore_dest": "/workspace/restored",
                  "workspace_restore_clean": True}},
        {"name": "restored", "ansible.builtin.debug": {"var": "workspace_restore_result"}},
        {"name": "export", "ansible.builtin.include_role": {"name": "microvm.sandbox.workspace_export"},
         "vars": {"workspace_export_paths": ["restored"], "workspace_export_dest_dir": exported}},
        {"name": "exported", "ansible.builtin.debug": {"var": "workspace_export_result"}},
    ]
    run = sync(plane, box, tmp_path, tasks=tasks)
    assert run.rc == 0, run
    assert run.result("restored")["workspace_restore_result"]["synced"]["deleted"] == 1
    assert "stale.txt" not in guest_state(plane, sid, "/workspace/restored")
    assert without(guest_state(plane, sid, "/workspace/restored"), ".") == without(local_state(src), ".")
    # the export leaves the default excludes (__pycache__) out
    assert without(local_state(os.path.join(exported, "restored")), ".") == \
        without(local_state(src), ".", "project/__pycache__")
    assert run.result("exported")["workspace_export_result"]["paths"] == ["restored"]


def test_remote_user_owns_what_is_pushed_and_pulls_as_itself(plane, box, tmp_path):
    sid = box["sid"]
    guest_sh(plane, sid, "id mvsync >/dev/null 2>&1 || useradd -m -s /bin/sh mvsync; mkdir -p /root/private && "
                         "echo r > /root/private/r.txt")
    src = str(tmp_path / "src")
    write(src, "sub/own.txt", "mine\n", mtime=1_600_000_000)
    res = result(sync(plane, box, tmp_path, {"src": src, "dest": "/home/mvsync/tree"}, remote_user="mvsync"))
    assert res["changed"] is True
    owners = guest_sh(plane, sid, "stat -c '%U %n' /home/mvsync/tree /home/mvsync/tree/sub /home/mvsync/tree/sub/own.txt")
    assert [line.split()[0] for line in owners.splitlines()] == ["mvsync"] * 3, owners
    out = str(tmp_path / "out")
    result(sync(plane, box, tmp_path, {"mode": "pull", "src": "/home/mvsync/tree", "dest": out}, remote_user="mvsync"))
    assert local_state(out) == local_state(src)
    # the pull reads as the user: root's private files stay out of reach
    run = sync(plane, box, tmp_path, {"mode": "pull", "src": "/root/private", "dest": str(tmp_path / "o")},
               remote_user="mvsync")
    assert run.result("sync")["failed"], run
    assert not os.path.exists(os.path.join(str(tmp_path / "o"), "r.txt"))
