"""Workspace snapshots that outlive their session: workspace_export to object storage, workspace_restore
(and the snapshot and restore playbooks) through the real stack, with a real S3 API on loopback (moto's
server mode) and the local control plane.
"""
import contextlib
import hashlib
import io
import json
import os
import socket
import sys
import tarfile
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roles_util import LOCALHOST, inventory, markers, unique  # noqa: E402

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

ACCESS_KEY = "AKIAMOTOTEST0000"
SECRET_KEY = "s3-secret-" + uuid.uuid4().hex  # never allowed in any output


def free_port():
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1, a bucket in it, and a boto3 client for the tests' own look-ups."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = "http://127.0.0.1:%d" % port
    try:
        client = boto3.session.Session(aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                                       region_name="us-east-1").client("s3", endpoint_url=endpoint)
        bucket = "snap-" + uuid.uuid4().hex[:8]
        client.create_bucket(Bucket=bucket)
        yield {"endpoint": endpoint, "bucket": bucket, "client": client}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def env(plane, s3, tmp_path_factory):
    """The plane, a private mux dir, and S3 credentials from the usual AWS variables (no secret on any command line)."""
    mux = tmp_path_factory.mktemp("restore-mux")
    return dict(plane.env, MICROVM_MUX_DIR=str(mux), MICROVM_PERSIST="20", AWS_ACCESS_KEY_ID=ACCESS_KEY,
                AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_ENDPOINT_URL_S3=s3["endpoint"], AWS_DEFAULT_REGION="us-east-1")


def put_archive(s3, key, members, sidecar=None):
    """Build a tar.gz from (name, kind, value) members and store it with a correct sidecar (or the given one)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, kind, value in members:
            info = tarfile.TarInfo(name)
            data = None
            if kind == "file":
                info.size, info.mode, data = len(value), 0o644, io.BytesIO(value)
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, value
            tar.addfile(info, data)
    body = buf.getvalue()
    digest = hashlib.sha256(body).hexdigest()
    s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=body, Metadata={"sha256": digest})
    s3["client"].put_object(Bucket=s3["bucket"], Key=key + ".sha256",
                            Body=(sidecar or "%s  %s\n" % (digest, key.rsplit("/", 1)[-1])).encode())
    return digest


SEED_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: Seed the workspace
      ansible.builtin.shell: |
        set -e
        mkdir -p /workspace/home/proj/sub /workspace/home/proj/.cache /workspace/data
        echo "hello {{ tag }}" > /workspace/home/proj/a.txt
        printf '#!/bin/sh\\necho run\\n' > /workspace/home/proj/run.sh && chmod 0755 /workspace/home/proj/run.sh
        echo private > /workspace/home/proj/sub/private && chmod 0600 /workspace/home/proj/sub/private
        ln -s a.txt /workspace/home/proj/link
        ln -s /workspace/home/proj/sub /workspace/home/proj/abslink
        echo junk > /workspace/home/proj/.cache/junk
        echo data > /workspace/data/d.txt
      changed_when: true
"""

INSPECT_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: Describe the workspace
      ansible.builtin.command:
        argv:
          - python3
          - -c
          - |
            import json, os, stat
            out = {}
            for root, dirs, files in os.walk("/workspace"):
                dirs[:] = [d for d in dirs if d != ".scratch"]
                for n in dirs + files:
                    p = os.path.join(root, n)
                    st = os.lstat(p)
                    if stat.S_ISLNK(st.st_mode):
                        out[p] = {"link": os.readlink(p)}
                    elif stat.S_ISDIR(st.st_mode):
                        out[p] = {"dir": True}
                    else:
                        out[p] = {"mode": oct(stat.S_IMODE(st.st_mode)), "text": open(p, errors="replace").read()[:200]}
            out["/tmp-evil"] = os.path.exists("/tmp/evil") or os.path.exists("/workspace/../evil")
            out["/scratch-kept"] = os.path.isdir("/workspace/.scratch")
            print(json.dumps(out, sort_keys=True))
      register: tree
      changed_when: false
    - name: Report
      ansible.builtin.debug:
        msg: "TREE={{ tree.stdout }}"
"""


def run(playbook_runner, text, inv, env, tmp_path, *extra):
    return playbook_runner(text, inv, env, workdir=str(tmp_path), extra_args=list(extra))


def tree(playbook_runner, session_id, env, tmp_path):
    res = run(playbook_runner, INSPECT_PLAY, inventory("sbx", session_id), env, tmp_path)
    assert res.rc == 0, res
    return markers(res.stdout, "TREE")[0]


def restore(playbook_runner, session_name, env, tmp_path, *extra):
    return run(playbook_runner, "- ansible.builtin.import_playbook: microvm.sandbox.restore\n", LOCALHOST, env, tmp_path,
               "-e", "session_name=%s" % session_name, "-e", "session_template=base", *extra)


def wait_gone(client, session_id, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [s for s in client.list_sessions() if s["session_id"] == session_id
                 and not s["status"].endswith(("DESTROYING", "DESTROYED"))]
        if not found:
            return
        time.sleep(0.5)
    raise AssertionError("session %s still live" % session_id)


@pytest.fixture
def new_session_name(plane):
    """A name for a session the restore playbook creates; the session is deleted after the test."""
    name = unique("restored")
    yield name
    client = plane.client()
    found = client.find_session(name)
    if found:
        with contextlib.suppress(Exception):
            client.delete_session(found["session_id"])


def test_round_trip_through_object_storage(plane, sandbox, s3, env, tmp_path, playbook_runner, new_session_name):
    """Snapshot a session to the bucket, delete the session, restore into a new one: files, modes, links are back."""
    tag = uuid.uuid4().hex[:8]
    seed = run(playbook_runner, SEED_PLAY, inventory("sbx", sandbox["session_id"]), env, tmp_path, "-e", "tag=%s" % tag)
    assert seed.rc == 0, seed
    key = "snapshots/%s/workspace.tar.gz" % sandbox["name"]
    secrets = tmp_path / "secrets.json"  # a vars file: -vvvv prints -e arguments
    secrets.write_text(json.dumps({"s3_secret_key": SECRET_KEY, "s3_access_key": ACCESS_KEY}))
    snap = run(playbook_runner, "- ansible.builtin.import_playbook: microvm.sandbox.snapshot\n", LOCALHOST,
               env, tmp_path, "-vvvv",
               "-e", "session_name=%s" % sandbox["name"], "-e", "snapshot_bucket=%s" % s3["bucket"],
               "-e", "snapshot_key=%s" % key, "-e", "snapshot_dest=%s" % (tmp_path / "snap.tar.gz"),
               "-e", "@%s" % secrets)
    assert snap.rc == 0, snap
    assert SECRET_KEY not in snap.output, "the S3 secret leaked into the output"
    assert "stored as s3://%s/%s" % (s3["bucket"], key) in snap.output
    body = s3["client"].get_object(Bucket=s3["bucket"], Key=key)["Body"].read()
    digest = hashlib.sha256(body).hexdigest()
    side = s3["client"].get_object(Bucket=s3["bucket"], Key=key + ".sha256")["Body"].read().decode()
    assert side.split()[0] == digest
    assert (tmp_path / "snap.tar.gz.sha256").read_text().split()[0] == digest
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        names = tar.getnames()
    assert not [n for n in names if ".cache" in n or ".scratch" in n], names

    client = plane.client()
    client.delete_session(sandbox["session_id"])
    wait_gone(client, sandbox["session_id"])

    res = restore(playbook_runner, new_session_name, env, tmp_path, "-vvvv", "-e", "restore_bucket=%s" % s3["bucket"],
                  "-e", "restore_key=%s" % key, "-e", "@%s" % secrets)
    assert res.rc == 0, res
    assert SECRET_KEY not in res.output, "the S3 secret leaked into the output"
    assert "Restored s3://%s/%s (sha256 %s, verified" % (s3["bucket"], key, digest) in res.output
    new = client.find_session(new_session_name)
    assert new and new["session_id"] != sandbox["session_id"]
    got = tree(playbook_runner, new["session_id"], env, tmp_path)
    p = "/workspace/home/proj/"
    assert got[p + "a.txt"]["text"] == "hello %s\n" % tag
    assert got[p + "run.sh"]["mode"] == "0o755"
    assert got[p + "sub/private"]["mode"] == "0o600"
    assert got[p + "link"] == {"link": "a.txt"}
    assert got[p + "abslink"] == {"link": "/workspace/home/proj/sub"}
    assert got["/workspace/data/d.txt"]["text"] == "data\n"
    assert p + ".cache/junk" not in got


def test_checksum_mismatch_writes_nothing(sandbox, s3, env, tmp_path, playbook_runner):
    key = "tampered/%s.tar.gz" % uuid.uuid4().hex[:6]
    put_archive(s3, key, [("home/tampered.txt", "file", b"should never arrive\n")])
    s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=b"not what was stored", Metadata={})  # object replaced
    res = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_bucket=%s" % s3["bucket"],
                  "-e", "restore_key=%s" % key)
    assert res.rc != 0
    assert "sha256" in res.output and "was changed or damaged" in res.output, res
    key2 = "tampered/%s.tar.gz" % uuid.uuid4().hex[:6]
    put_archive(s3, key2, [("home/tampered2.txt", "file", b"should never arrive\n")], sidecar="0" * 64 + "  x\n")
    res2 = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_bucket=%s" % s3["bucket"],
                   "-e", "restore_key=%s" % key2)
    assert res2.rc != 0
    assert "sidecar" in res2.output or "was changed or damaged" in res2.output, res2
    got = tree(playbook_runner, sandbox["session_id"], env, tmp_path)
    assert "/workspace/home/tampered.txt" not in got and "/workspace/home/tampered2.txt" not in got


def test_missing_object_fails_clearly(sandbox, s3, env, tmp_path, playbook_runner):
    res = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_bucket=%s" % s3["bucket"],
                  "-e", "restore_key=nope/missing.tar.gz")
    assert res.rc != 0
    assert "s3://%s/nope/missing.tar.gz" % s3["bucket"] in res.output and "does not exist" in res.output, res


@pytest.mark.parametrize("bad", [("../evil", "file", b"escaped\n"), ("home/esc", "sym", "/etc"),
                                 ("home/up", "sym", "../../tmp/evil")])
def test_escaping_archive_is_refused_and_nothing_written(sandbox, s3, env, tmp_path, playbook_runner, bad):
    key = "escape/%s.tar.gz" % uuid.uuid4().hex[:6]
    put_archive(s3, key, [("home", "dir", None), ("home/innocent.txt", "file", b"harmless\n"), bad])
    res = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_bucket=%s" % s3["bucket"],
                  "-e", "restore_key=%s" % key)
    assert res.rc != 0
    assert "would write outside /workspace" in res.output and bad[0] in res.output, res
    got = tree(playbook_runner, sandbox["session_id"], env, tmp_path)
    assert "/workspace/home/innocent.txt" not in got and "/workspace/home/esc" not in got
    assert "/workspace/home/up" not in got and got["/tmp-evil"] is False


EXISTING_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: Files already in the session
      ansible.builtin.shell: |
        set -e
        mkdir -p /workspace/home/proj /workspace/restored/old
        echo "old a" > /workspace/home/proj/a.txt
        echo "only here" > /workspace/home/proj/extra.txt
        echo "old" > /workspace/restored/old/file
      changed_when: true
"""


def test_restore_into_a_session_with_files(sandbox, s3, env, tmp_path, playbook_runner):
    """Merge by default (archive files replace, others stay); clean empties the target first; a subfolder works."""
    seed = run(playbook_runner, EXISTING_PLAY, inventory("sbx", sandbox["session_id"]), env, tmp_path)
    assert seed.rc == 0, seed
    archive = tmp_path / "ws.tar.gz"
    with tarfile.open(str(archive), "w:gz") as tar:
        for name, data in (("home/proj/a.txt", b"new a\n"), ("home/proj/b.txt", b"new b\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o640
            tar.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()

    unverified = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_src=%s" % archive)
    assert unverified.rc != 0 and "no sha256 to verify it against" in unverified.output, unverified

    (tmp_path / "ws.tar.gz.sha256").write_text("%s  ws.tar.gz\n" % digest)
    merged = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_src=%s" % archive)
    assert merged.rc == 0, merged
    got = tree(playbook_runner, sandbox["session_id"], env, tmp_path)
    assert got["/workspace/home/proj/a.txt"]["text"] == "new a\n"
    assert got["/workspace/home/proj/a.txt"]["mode"] == "0o640"
    assert got["/workspace/home/proj/b.txt"]["text"] == "new b\n"
    assert got["/workspace/home/proj/extra.txt"]["text"] == "only here\n"

    clean = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_src=%s" % archive,
                    "-e", "restore_dest=/workspace/restored", "-e", "restore_clean=true", "-e", "restore_sha256=%s" % digest)
    assert clean.rc == 0, clean
    assert "after emptying it" in clean.output
    got = tree(playbook_runner, sandbox["session_id"], env, tmp_path)
    assert got["/workspace/restored/home/proj/a.txt"]["text"] == "new a\n"
    assert "/workspace/restored/old/file" not in got and "/workspace/restored/old" not in got
    assert got["/workspace/home/proj/extra.txt"]["text"] == "only here\n", "clean reached outside its target"

    wrong = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_src=%s" % archive,
                    "-e", "restore_clean=true", "-e", "restore_sha256=%s" % ("f" * 64))
    assert wrong.rc != 0 and "not the expected" in wrong.output, wrong
    got = tree(playbook_runner, sandbox["session_id"], env, tmp_path)
    assert got["/workspace/home/proj/extra.txt"]["text"] == "only here\n", "a refused restore still cleaned the target"

    whole = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_src=%s" % archive,
                    "-e", "restore_clean=true")
    assert whole.rc == 0, whole
    got = tree(playbook_runner, sandbox["session_id"], env, tmp_path)
    assert got["/scratch-kept"] is True, "clean removed the scratch dir"
    assert sorted(p for p in got if p.startswith("/workspace/")) == [
        "/workspace/home", "/workspace/home/proj", "/workspace/home/proj/a.txt", "/workspace/home/proj/b.txt"], got


def test_restore_dest_outside_workspace_is_refused(sandbox, s3, env, tmp_path, playbook_runner):
    res = restore(playbook_runner, sandbox["name"], env, tmp_path, "-e", "restore_src=%s" % (tmp_path / "x.tgz"),
                  "-e", "restore_dest=/tmp/x")
    assert res.rc != 0 and "inside /workspace" in res.output, res


AGENT_REFUSES_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: A link in the session that points outside the workspace
      ansible.builtin.file:
        src: /etc
        dest: /workspace/home/evil
        state: link
        force: true
    - name: Restore an archive that writes through it (lexically inside, so only the agent can see it)
      microvm.sandbox.workspace_archive:
        src: "{{ archive }}"
      register: through
      ignore_errors: true
    - name: Report
      ansible.builtin.debug:
        msg: "THROUGH={{ through | to_json }}"
    - name: Check mode sends nothing
      microvm.sandbox.workspace_archive:
        src: "{{ good }}"
        dest: /workspace/checkmode
      check_mode: true
      register: checked
    - name: Report check mode
      ansible.builtin.debug:
        msg: "CHECKED={{ checked | to_json }}"
"""


def test_the_agent_refuses_what_only_the_session_shows(sandbox, env, tmp_path, playbook_runner):
    """A link that already exists in the session is invisible to the controller's check: the agent refuses the
    whole archive, the task says why, and no member is written. Check mode sends nothing."""
    archive = tmp_path / "through.tar.gz"
    good = tmp_path / "good.tar.gz"
    for path, names in ((archive, ("home/first.txt", "home/evil/microvm-restore-test")), (good, ("x.txt",))):
        with tarfile.open(str(path), "w:gz") as tar:
            for name in names:
                info = tarfile.TarInfo(name)
                info.size = 3
                tar.addfile(info, io.BytesIO(b"hi\n"))
    res = run(playbook_runner, AGENT_REFUSES_PLAY, inventory("sbx", sandbox["session_id"]), env, tmp_path,
              "-e", "archive=%s" % archive, "-e", "good=%s" % good)
    assert res.rc == 0, res
    through = markers(res.stdout, "THROUGH")[0]
    assert through["failed"] and "refused or failed to extract" in through["msg"], through
    assert "evil" in through["msg"], through
    checked = markers(res.stdout, "CHECKED")[0]
    assert checked["changed"] and checked["archive"]["files"] == 1, checked
    got = tree(playbook_runner, sandbox["session_id"], env, tmp_path)
    assert "/workspace/home/first.txt" not in got, "the agent wrote part of a refused archive"
    assert "/workspace/checkmode" not in got and "/workspace/checkmode/x.txt" not in got


CLEAN_THROUGH_A_LINK_PLAY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: A directory outside the workspace, and a link in the workspace to the root
      ansible.builtin.shell: |
        set -e
        mkdir -p /tmp/victim && echo precious > /tmp/victim/file
        ln -sfn / /workspace/up
      changed_when: true
    - name: Restore with clean into a dest that passes through the link
      microvm.sandbox.workspace_archive:
        src: "{{ archive }}"
        dest: /workspace/up/tmp/victim
        clean: true
      register: through
      ignore_errors: true
    - name: Report
      ansible.builtin.debug:
        msg: "THROUGH={{ through | to_json }}"
    - name: What is left outside
      ansible.builtin.command: ls -A /tmp/victim
      register: left
      changed_when: false
    - name: Report what is left
      ansible.builtin.debug:
        msg: "LEFT={{ left.stdout_lines | to_json }}"
"""


def test_clean_through_a_link_out_of_the_workspace_removes_nothing(sandbox, env, tmp_path, playbook_runner):
    """dest is lexically inside /workspace but resolves outside in the guest: the clean refuses before removing."""
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(str(archive), "w:gz") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"a"))
    res = run(playbook_runner, CLEAN_THROUGH_A_LINK_PLAY, inventory("sbx", sandbox["session_id"]), env, tmp_path,
              "-e", "archive=%s" % archive)
    assert res.rc == 0, res
    through = markers(res.stdout, "THROUGH")[0]
    assert through["failed"] and "resolves to /tmp/victim" in through["msg"], through
    assert through["cleaned"] is False and through["changed"] is False, through
    assert markers(res.stdout, "LEFT")[0] == ["file"]


def test_workspace_archive_needs_the_agent_connection(env, tmp_path, playbook_runner):
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(str(archive), "w:gz") as tar:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"a"))
    play = """
- hosts: localhost
  gather_facts: false
  tasks:
    - microvm.sandbox.workspace_archive:
        src: "%s"
""" % archive
    res = playbook_runner(play, LOCALHOST, env, workdir=str(tmp_path))
    assert res.rc != 0
    assert "needs the microvm.sandbox.agent connection" in res.output and "this host uses local" in res.output, res
