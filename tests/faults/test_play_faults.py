"""Faults under ansible-playbook: the WebSocket cut mid-command and mid-copy, through the worker, the mux,
gRPC and the fault proxy."""
import os
import time

import pytest


@pytest.fixture
def play_env(plane, proxy, mux_dir):
    return {"DO_AGENTS_API_URL": proxy.url, "DO_AGENTS_API_TOKEN": plane.token, "MICROVM_MUX_DIR": mux_dir,
            "MICROVM_PERSIST": "20", "MICROVM_CONNECT_TIMEOUT": "20", "MICROVM_TRANSPORT": "agent"}


def inventory(session):
    return ("[sbx]\nbox ansible_host=%s\n\n[sbx:vars]\nansible_connection=microvm.sandbox.agent\n"
            "ansible_python_interpreter=/usr/bin/python3\n" % session)


def guest(plane, sid, script):
    return plane.client().request("POST", "/sessions/%s/sandbox/exec" % sid, body={"argv": ["sh", "-c", script]})


def task_tmp_dirs(plane, sid, until=lambda left: not left):
    """The ansible-tmp-* dirs in the shared remote_tmp, once the mux had time to reap the ended run."""
    script = "ls -A /workspace/.scratch/ansible-tmp 2>/dev/null | grep '^ansible-tmp-' || true"
    deadline = time.monotonic() + 15
    while True:
        names = guest(plane, sid, script)["stdout"].split()
        if until(names) or time.monotonic() > deadline:
            return names
        time.sleep(0.3)


CUT_COMMAND = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.raw: "echo run >> /workspace/runs.txt; head -c 4000000 /dev/zero; sleep 1"
"""


def test_play_command_cut_is_unreachable_and_ran_once(plane, sandbox, proxy, play_env, run_playbook):
    proxy.cut_ws(down=256 * 1024)   # whichever WebSocket carries the output
    res = run_playbook(CUT_COMMAND, inventory(sandbox["session_id"]), play_env)
    assert res.rc == 4 and "UNREACHABLE!" in res.stdout, res
    assert "not re-run" in res.stdout, res
    assert proxy.cuts == ["cut-down"]
    assert guest(plane, sandbox["session_id"], "cat /workspace/runs.txt")["stdout"] == "run\n"


CUT_COPY = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.copy: {src: "%s", dest: /workspace/dst/big.bin}
"""


@pytest.mark.parametrize("existing", [True, False], ids=["replace", "new"])
def test_play_copy_cut_leaves_old_or_nothing(plane, sandbox, proxy, play_env, run_playbook, tmp_path, existing):
    sid = sandbox["session_id"]
    guest(plane, sid, "mkdir -p /workspace/dst" + (" && echo old > /workspace/dst/big.bin" if existing else ""))
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(1 << 20) * 6)
    proxy.cut_ws(up=3 << 20)
    res = run_playbook(CUT_COPY % src, inventory(sid), play_env)
    assert res.rc != 0, res
    assert proxy.cuts == ["cut-up"], proxy.cuts
    got = guest(plane, sid, "cat /workspace/dst/big.bin 2>/dev/null | head -c 10; echo; ls -A /workspace/dst")
    content, names = got["stdout"].split("\n", 1)
    assert content == ("old" if existing else ""), "the destination changed after a cut copy"
    # the agent removes its temporary name when it sees the cut; the copy's tmp upload is in the run's scratch
    assert all(n == "big.bin" or n.startswith(".big.bin.upload-") for n in names.split()), names
    assert task_tmp_dirs(plane, sid) == []  # the copy's own clean-up ran: after the cut the next command dials afresh


A_TASK = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.raw: "true"
"""


def test_empty_task_dirs_of_gone_workers_are_removed_when_a_run_ends(plane, sandbox, play_env, run_playbook):
    """A task that ended UNREACHABLE leaves its empty ansible-tmp-<time>-<worker pid>-<n> dir behind (Ansible's
    clean-up needs the connection it lost). The mux removes such dirs once their worker is gone; a dir whose
    worker lives, or that holds files, stays."""
    import subprocess
    sid = sandbox["session_id"]
    gone = subprocess.Popen(["true"])
    gone.wait()
    names = {"gone": "ansible-tmp-1764520000.5-%d-11" % gone.pid, "alive": "ansible-tmp-1764520000.5-%d-22" % os.getpid(),
             "files": "ansible-tmp-1764520000.5-%d-33" % gone.pid}
    made = guest(plane, sid, "mkdir -p /workspace/.scratch/ansible-tmp && cd /workspace/.scratch/ansible-tmp && mkdir %s"
                 " && touch %s/x && ls -A" % (" ".join(names.values()), names["files"]))
    assert sorted(made["stdout"].split()) == sorted(names.values()), made
    res = run_playbook(A_TASK, inventory(sid), play_env)
    assert res.rc == 0, res
    assert sorted(task_tmp_dirs(plane, sid, until=lambda left: names["gone"] not in left)) == sorted(
        [names["alive"], names["files"]])
    guest(plane, sid, "cd /workspace/.scratch/ansible-tmp && rm -rf %s %s" % (names["alive"], names["files"]))
