"""A guest that prints without end cannot take the controller's memory: the task's output is capped
(option max_output_bytes), the command is stopped in the guest, the error names the option.

Real stack: ansible-playbook -> worker -> mux -> gRPC -> port-forward -> local plane -> guest agent.
"""
import os
import subprocess
import threading

import pytest
from conftest import BIN, ansible_env, run_playbook

from microvm_plane_testing import run_transport, stop_muxes


def _inventory(session, **extra):
    lines = ["[sbx]", "box ansible_host=%s" % session, "", "[sbx:vars]", "ansible_connection=microvm.sandbox.agent",
             "ansible_python_interpreter=/usr/bin/python3"] + ["%s=%s" % kv for kv in extra.items()]
    return "\n".join(lines) + "\n"


def _descendants(root):
    """Pids below root (the ansible-playbook process and its workers)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/%s/stat" % entry) as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _rss_kib(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def run_sampled(playbook, inventory, env, workdir):
    """ansible-playbook, with the largest RSS any of its processes reached (sampled every 50 ms) -> (rc, out, KiB)."""
    with open(os.path.join(workdir, "playbook.yml"), "w") as f:
        f.write(playbook)
    with open(os.path.join(workdir, "inventory.ini"), "w") as f:
        f.write(inventory)
    proc = subprocess.Popen([os.path.join(BIN, "ansible-playbook"), "-i", "inventory.ini", "playbook.yml"],
                            cwd=workdir, env=ansible_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.05):
            peak[0] = max([peak[0]] + [_rss_kib(p) for p in _descendants(proc.pid)])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _err = proc.communicate(timeout=600)
    done.set()
    sampler.join()
    return proc.returncode, out.decode(errors="replace"), peak[0]


FLOOD = """
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.file: {path: /workspace/flood-after, state: absent}
    - name: a guest printing {{ flood }} bytes
      ansible.builtin.{{ module }}: "head -c {{ flood }} /dev/zero | tr '\\\\0' x; sleep 3; touch /workspace/flood-after"
      register: flooded
      ignore_errors: true
    - ansible.builtin.assert:
        that:
          - flooded is failed
          - "'max_output_bytes' in flooded.msg"
    - name: the next task runs as usual
      ansible.builtin.command: echo fine
      register: fine
    - ansible.builtin.assert: {that: ["fine.stdout == 'fine'"]}
    - name: a command whose output streams (raw) was stopped in the guest
      ansible.builtin.stat: {path: /workspace/flood-after}
      register: after
      when: "'{{ module }}' == 'raw'"
    - ansible.builtin.assert: {that: ["not after.stat.exists"]}
      when: "'{{ module }}' == 'raw'"
"""


def flood(size, module):
    return FLOOD.replace("{{ flood }}", str(size)).replace("{{ module }}", module)


@pytest.mark.parametrize("module", ["raw", "shell"])
def test_output_over_the_limit_fails_naming_the_option_and_stops_the_command(plane, sandbox, tmp_path, module):
    """With max_output_bytes at 1 MiB, 5 MB of output fails the task naming the option; a streaming command
    (raw) is stopped in the guest; the next task runs."""
    mux_dir = str(tmp_path / "mux")
    env = dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30")
    try:
        rc, out, _peak = run_sampled(flood(5000000, module),
                                     _inventory(sandbox["name"], ansible_microvm_max_output_bytes=1048576), env,
                                     str(tmp_path))
    finally:
        stop_muxes(mux_dir)
    assert rc == 0, out
    assert "printed more than 1048576 bytes" in out and "max_output_bytes" in out, out


def test_two_hundred_megabytes_of_guest_output_stay_out_of_the_controllers_memory(plane, sandbox, tmp_path):
    """The default limit (64 MiB): a command printing 200 MB fails, and no controller process of the run grows past
    a few hundred MiB (without the limit the task's process reached 838 MB)."""
    mux_dir = str(tmp_path / "mux")
    env = dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30")
    try:
        rc, out, peak_kib = run_sampled(flood(200000000, "raw"), _inventory(sandbox["name"]), env,
                                        str(tmp_path))
    finally:
        stop_muxes(mux_dir)
    assert rc == 0, out
    assert "printed more than 67108864 bytes" in out, out
    assert peak_kib < 400 * 1024, "a controller process reached %d MiB" % (peak_kib // 1024)


ENDLESS = """
- hosts: sbx
  gather_facts: false
  tasks:
    - name: a guest printing without end
      ansible.builtin.raw: "yes FLOOD{{ mark }}"
      register: flooded
      ignore_errors: true
    - ansible.builtin.assert:
        that:
          - flooded is failed
          - "'printed more than 67108864 bytes' in flooded.msg and 'max_output_bytes' in flooded.msg"
    - name: the flood no longer runs in the guest (its process group stopped by the mux; a few seconds at most)
      ansible.builtin.raw: >-
        i=0; while [ $i -lt 100 ]; do
        for p in /proc/[0-9]*; do tr '\\0' ' ' <$p/cmdline 2>/dev/null; echo; done | grep -q "[F]LOOD{{ mark }}" || exit 0;
        sleep 0.1; i=$((i + 1)); done; echo still running; exit 1
    - name: the session's next tasks run as usual
      ansible.builtin.command: echo fine
      register: fine
    - ansible.builtin.assert: {that: ["fine.stdout == 'fine'"]}
"""


def test_an_endless_flood_is_stopped_at_the_limit_and_the_next_task_runs(plane, sandbox, tmp_path):
    """`yes` without end and the default limit (64 MiB): it can only end because it passed the limit. The task fails
    naming the option, the command is gone from the guest, the session's next task runs. On the api road the mux
    stops the job as soon as it has written more than the limit (the job runs ahead of the road up to it), without
    moving those 64 MiB 512 KiB an exec for the worker to drop: the message gives what the job had written."""
    mux_dir = str(tmp_path / "mux")
    env = dict(plane.env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="30")
    try:
        result = run_playbook(ENDLESS.replace("{{ mark }}", os.urandom(4).hex()), _inventory(sandbox["name"]), env,
                              workdir=str(tmp_path), timeout=300)
    finally:
        stop_muxes(mux_dir)
    assert result.rc == 0, result
    if run_transport() == "api":
        assert "when it was stopped" in result.stdout, result  # stopped in the guest, not counted by the worker
