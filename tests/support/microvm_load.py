"""The fleet load job, shared by its test (tests/faults/test_fleet_load.py) and its bench (bench/load_bench.py).

A playbook of TASKS tasks for every host: two `shell` tasks that each append one numbered line to
/workspace/load.txt, then one `copy`, repeated. Afterwards each session must hold exactly the numbered
lines in order (nothing lost, nothing run twice) and every copied file.
"""

TASKS = 30


def load_playbook(tasks=TASKS):
    """(playbook text for `hosts: all`, how many of its tasks append a line)."""
    lines = ["- hosts: all", "  gather_facts: false", "  tasks:"]
    n_cmd = 0
    for n in range(tasks):
        if n % 3 == 2:
            lines.append('    - ansible.builtin.copy: {content: "file %d\\n", dest: /workspace/load/f%d.txt}' % (n, n))
        else:
            lines.append('    - ansible.builtin.shell: "mkdir -p /workspace/load && echo %d >> /workspace/load.txt"' % n_cmd)
            n_cmd += 1
    return "\n".join(lines) + "\n", n_cmd


def incomplete_sessions(client, ids, n_cmd, tasks=TASKS):
    """The sessions (checked over REST, not through the plugin) that lost or repeated a task."""
    want = "".join("%d\n" % i for i in range(n_cmd)) + "%d\n" % (tasks - n_cmd)
    bad = []
    for sid in ids:
        got = client.request("POST", "/sessions/%s/sandbox/exec" % sid,
                             body={"argv": ["sh", "-c", "cat /workspace/load.txt; ls /workspace/load | wc -l"]})
        if got.get("stdout") != want:
            bad.append(sid)
    return bad


def inventory(ids):
    """An inventory of s00, s01... for the sessions, through the agent connection."""
    return ("[all]\n" + "".join("s%02d ansible_host=%s\n" % (i, sid) for i, sid in enumerate(ids))
            + "\n[all:vars]\nansible_connection=microvm.sandbox.agent\nansible_python_interpreter=/usr/bin/python3\n")
