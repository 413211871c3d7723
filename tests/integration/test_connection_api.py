"""The connection over `transport: api` (the documented exec and file API) through the real stack: what only
this road has (its refusals, the team's interactive stdin, staged transfers, a run with the agent port closed).

The agent road's whole suites run over this road too: `make integration-api` (MICROVM_TEST_TRANSPORT=api).
"""
import glob
import os
import re

import pytest
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from test_connection import BIG, inventory, sha1

from microvm_plane_testing import stop_muxes, tail, team


@pytest.fixture
def mux_dir(tmp_path):
    d = str(tmp_path / "mux")
    yield d
    stop_muxes(d)


@pytest.fixture
def env(plane, mux_dir):
    """Every test of this module runs on the api road, for a team with interactive stdin, the agent port closed."""
    with team(plane, interactive_stdin=True, closed_ports=[8443]):
        yield dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30", MICROVM_TRANSPORT="api")


ROAD = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo on the api road
      register: r
    - ansible.builtin.copy: {content: "x\n", dest: /etc/microvm-api-road}
    - ansible.builtin.slurp: {src: /etc/microvm-api-road}
      register: s
    - ansible.builtin.assert:
        that: ["r.stdout == 'on the api road'", "s.content | b64decode == 'x\n'"]
"""


def test_agent_road_is_refused_but_api_and_auto_work(plane, sandbox, env, playbook_runner):
    """With guest port 8443 closed (the plane's team setting), agent fails, api and auto run the play."""
    inv = inventory({"box": sandbox["session_id"]})
    res = playbook_runner(ROAD, inv, dict(env, MICROVM_TRANSPORT="agent", MICROVM_CONNECT_TIMEOUT="5"))
    assert res.rc != 0 and "unreachable=1" in res.stdout, res
    for transport in ("api", "auto"):
        res = playbook_runner(ROAD, inv, dict(env, MICROVM_TRANSPORT=transport), extra_args=["-vvv"])
        assert res.rc == 0 and "failed=0" in res.stdout, res
        # the api road's own warm runner (module_runners.ApiModuleRunner) runs the modules, none cold
        assert "WARM RUNNER ran the module" in res.stdout and "running cold" not in res.stdout, res
        assert API_ROAD_LOG in mux_log(env), transport


BECOME = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: id -un
      become: true
      become_method: "{{ method }}"
      vars: {ansible_become_password: "{{ user_password }}"}
      register: r
    - ansible.builtin.debug: {msg: "BECAME={{ r.stdout }}"}
    - name: a pipelined module through sudo -S gets its whole stdin after the password line
      ansible.builtin.copy: {content: "{{ 'p' * 2000 }}\n", dest: /root/become-one-shot}
      become: true
      become_method: "{{ method }}"
      vars: {ansible_become_password: "{{ user_password }}"}
"""


def test_become_with_a_password_without_interactive_stdin_sudo_works_and_su_names_what_to_use(plane, env, playbook_runner):
    """A team without interactive stdin: sudo takes its password first on the one-shot stdin; su, which cannot,
    fails at once (before anything runs), naming sudo and the team setting; the password is never printed."""
    client = plane.client()
    password = "pw-%s" % os.urandom(6).hex()
    session = client.create_session({"name": "api-become-%s" % os.urandom(4).hex(), "agent": "custom",
                                     "secrets": {"SANDBOX_USER_PASSWORD": password}})
    try:
        client.wait_session(session["session_id"], timeout=120)
        inv = inventory({"box": session["session_id"]}, ansible_user="sandbox")
        with team(plane, interactive_stdin=False, closed_ports=[8443]):
            res = playbook_runner(BECOME, inv, env, extra_args=["-e", "user_password=%s" % password,
                                                                "-e", "method=ansible.builtin.sudo"])
            assert res.rc == 0 and "BECAME=root" in res.stdout, res
            res = playbook_runner(BECOME, inv, env, extra_args=["-e", "user_password=wrong-%s" % password,
                                                                "-e", "method=ansible.builtin.sudo"])
            assert res.rc != 0 and "Incorrect sudo password" in res.stdout, res
            res = playbook_runner(BECOME, inv, env, extra_args=["-e", "user_password=%s" % password,
                                                                "-e", "method=ansible.builtin.su"])
        assert res.rc != 0, res
        assert "interactive stdin (keep_stdin_open)" in res.stdout and "become_method sudo" in res.stdout, res
        assert "Nothing was run" in res.stdout and password not in res.stdout + res.stderr
    finally:
        client.delete_session(session["session_id"])


def test_su_answers_its_prompt_on_interactive_stdin_and_su_from_root_needs_none(plane, env, playbook_runner):
    """A team with interactive stdin, the agent port closed: su from `sandbox` with root's password answers its
    prompt over the documented stdin writes (a wrong one is refused). A team without it: su from root, a become
    password set or not, runs on the buffered exec (su from root asks for none). Passwords never printed."""
    client = plane.client()
    user_password, root_password = "pw-%s" % os.urandom(6).hex(), "root-%s" % os.urandom(6).hex()
    session = client.create_session({"name": "api-su-%s" % os.urandom(4).hex(), "agent": "custom", "secrets": {
        "SANDBOX_USER_PASSWORD": user_password, "SANDBOX_ROOT_PASSWORD": root_password}})
    su = ["-e", "method=ansible.builtin.su"]
    printed = []
    try:
        client.wait_session(session["session_id"], timeout=120)
        as_sandbox = inventory({"box": session["session_id"]}, ansible_user="sandbox")
        res = playbook_runner(BECOME, as_sandbox, env, extra_args=su + ["-e", "user_password=%s" % root_password])
        assert res.rc == 0 and "BECAME=root" in res.stdout, res
        printed.append(res.stdout + res.stderr)
        res = playbook_runner(BECOME, as_sandbox, env, extra_args=su + ["-e", "user_password=wrong-%s" % root_password])
        assert res.rc != 0 and "Incorrect su password" in res.stdout, res
        printed.append(res.stdout + res.stderr)
        with team(plane, interactive_stdin=False, closed_ports=[8443]):
            as_root = inventory({"box": session["session_id"]})
            for password in (root_password, ""):
                res = playbook_runner(BECOME, as_root, env, extra_args=su + ["-e", "user_password=%s" % password])
                assert res.rc == 0 and "BECAME=root" in res.stdout, res
                printed.append(res.stdout + res.stderr)
        assert not any(user_password in text or root_password in text for text in printed)
    finally:
        client.delete_session(session["session_id"])


LONG_STDIN = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - name: a module payload bigger than one request's one-shot stdin is staged, then piped
      ansible.builtin.copy: {content: "{{ lookup('ansible.builtin.file', playbook_dir ~ '/blob.txt') }}", dest: /workspace/blob.txt}
    - ansible.builtin.stat: {path: /workspace/blob.txt, checksum_algorithm: sha1}
      register: st
    - ansible.builtin.debug: {msg: "REMOTE={{ st.stat.checksum }}"}
"""


def test_a_payload_too_big_for_one_shot_stdin_is_staged(plane, sandbox, env, tmp_path, playbook_runner):
    import hashlib
    work = tmp_path / "work"
    work.mkdir()
    text = (os.urandom(600 * 1024).hex()[:900 * 1024])
    (work / "blob.txt").write_text(text)
    with team(plane, interactive_stdin=False, closed_ports=[8443]):
        res = playbook_runner(LONG_STDIN, inventory({"box": sandbox["session_id"]}), env, workdir=str(work))
    assert res.rc == 0, res
    assert "REMOTE=%s" % hashlib.sha1(text.encode()).hexdigest() in res.stdout, res


def test_a_rate_limited_team_runs_its_play_once_the_platform_takes_the_calls(plane, sandbox, env, playbook_runner):
    """The plane answers the next execs 429 with Retry-After (its `throttle` team setting): the api road waits and
    sends them again (a 429 was not taken), and the play passes."""
    with team(plane, interactive_stdin=False, closed_ports=[8443],
              throttle={"id": os.urandom(8).hex(), "calls": 2, "retry_after": 1}):
        res = playbook_runner(ROAD, inventory({"box": sandbox["session_id"]}), env)
    assert res.rc == 0 and "failed=0" in res.stdout, res
    assert re.search(r"answered 429 \(throttle \S+: 2 of 2\)", tail(plane.state_dir, 1 << 20)), "both 429s were met"


def test_a_stdin_too_big_for_the_platform_is_a_413_that_says_what_to_do(plane, sandbox):
    """The plane's documented 1 MiB body bound, met by an exec the road would have staged: the 413 names the bound
    and what to do, and nothing ran."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_road
    client = api_road.ApiRoadClient(plane.url, "/v2/harness-runtime", plane.token, sandbox["session_id"], "box")
    with pytest.raises(errors.SandboxError) as e:
        client.jobs.raw(["sh", "-c", "cat > /workspace/too-big"], stdin=b"x" * (900 * 1024))
    text = str(e.value)
    assert "HTTP 413" in text and "nothing was taken" in text and "smaller stdin or file" in text, text
    assert client.jobs.raw(["test", "-e", "/workspace/too-big"]).exit_code == 1


def test_auto_keeps_the_agent_road_when_the_agent_answers(plane, sandbox, env, playbook_runner):
    """auto with the agent port open: the agent road (its warm runner runs the modules), not the api."""
    with team(plane, interactive_stdin=False, closed_ports=[]):
        res = playbook_runner(ROAD, inventory({"box": sandbox["session_id"]}), dict(env, MICROVM_TRANSPORT="auto"),
                              extra_args=["-vvv"])
    assert res.rc == 0 and "failed=0" in res.stdout, res
    assert "WARM RUNNER ran the module" in res.stdout and API_ROAD_LOG not in mux_log(env), res


API_ROAD_LOG = "using the documented exec and file API"  # what the mux logs when a link takes the api road


def mux_log(env):
    return "".join(open(p).read() for p in glob.glob(os.path.join(env["MICROVM_MUX_DIR"], "*", "mux.log")))


def distinct_mebibytes(path, count):
    """count MiB, each one different (a counter in its first bytes): parts put out of order would show."""
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for i in range(count):
            f.write(i.to_bytes(8, "big") + block[8:])


@pytest.mark.parametrize("mib", [60, 520])
def test_big_files_past_the_streaming_bounds_go_staged_both_ways(plane, sandbox, env, tmp_path, playbook_runner, mib):
    """Past the streaming download's 50 MiB (60 MiB) and the streaming upload's 500 MiB (520 MiB), the documented
    staged transfers carry the file, verified, with the agent port closed; nothing partial is left behind, in the
    plane's object store either."""
    work = tmp_path / "work"
    work.mkdir()
    distinct_mebibytes(work / "big.bin", mib)
    want = sha1(work / "big.bin")
    res = playbook_runner(BIG, inventory({"box": sandbox["session_id"]}), env, workdir=str(work))
    assert res.rc == 0, res
    assert "UP=%s REMOTE=%s DOWN=%s" % (want, want, want) in res.stdout, res
    assert sha1(work / "big.back") == want
    assert not glob.glob(str(work / ".*.part")), "no partial download left behind"
    leftovers = glob.glob(os.path.join(plane.state_dir, "transfers", "*", "part-*"))
    assert not leftovers, "an imported upload's parts are removed from the object store"
    log = tail(plane.state_dir, 1 << 20)
    sid = sandbox["session_id"]
    assert "staged download" in log and re.search(r"staged download \S+ of session %s: completed, %d bytes"
                                                  % (sid, mib << 20), log), "the fetch went staged"
    assert bool(re.search(r"staged upload \S+ of session %s: completed, %d bytes" % (sid, mib << 20), log)) == (mib > 500)


def test_a_staged_download_corrupted_in_object_storage_never_lands(plane, sandbox, env, tmp_path, monkeypatch):
    """The real plane and guest, the object flipped by one byte in the plane's store once the export completed:
    the api road refuses it on its sha256 and leaves nothing at the destination."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import api_road, api_transfer
    client = api_road.ApiRoadClient(plane.url, "/v2/harness-runtime", plane.token, sandbox["session_id"], "box")
    distinct_mebibytes(tmp_path / "src", 3)
    client.upload(str(tmp_path / "src"), "/workspace/corrupt.bin")
    monkeypatch.setattr(api_transfer, "STREAM_DOWNLOAD_MAX", 1 << 20)  # 3 MiB go staged
    real = api_transfer.Transfers._await_transfer

    def corrupt_after(self, tid, remote_path, verb):
        doc = real(self, tid, remote_path, verb)
        with open(os.path.join(plane.state_dir, "transfers", tid, "object"), "r+b") as f:
            f.seek(12345)
            byte = f.read(1)
            f.seek(12345)
            f.write(bytes([byte[0] ^ 1]))
        return doc

    monkeypatch.setattr(api_transfer.Transfers, "_await_transfer", corrupt_after)
    with pytest.raises(errors.ChecksumMismatch, match="sha256"):
        client.download("/workspace/corrupt.bin", str(tmp_path / "dest"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    monkeypatch.setattr(api_transfer.Transfers, "_await_transfer", real)
    assert client.download("/workspace/corrupt.bin", str(tmp_path / "dest")) == 3 << 20
    assert sha1(tmp_path / "dest") == sha1(tmp_path / "src")
