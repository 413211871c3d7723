"""The warm module runner (option warm_runner): the connection battery with it on and off, its fallbacks,
and the runner itself driven locally with hand-made AnsiballZ-like payloads. On either road
(MICROVM_TEST_TRANSPORT)."""
import base64
import io
import json
import re
import struct
import time
import zipfile

from microvm_warm_testing import LocalRunner
from test_connection import BATTERY, env, inventory, mux_dir  # noqa: F401  (fixtures are re-used)

# pytest finds fixtures by name in this module's namespace: referenced so linters keep the imports.
_REUSED_FIXTURES = (env, inventory, mux_dir)

# Both roads: on the api road the runner listens on a socket and each request is one buffered exec of
# _guest/warm_client.py (module_runners.ApiModuleRunner).

HEADER = struct.Struct("!IIB")
RUN, KILL = 1, 2
READY, STARTED, OUT, ERR, EXIT, REFUSE = 10, 11, 12, 13, 14, 15

WARM_RAN = "WARM RUNNER ran the module"


def warm_lines(res):
    return "\n".join(line for line in res.stdout.splitlines() if "WARM RUNNER" in line or "TASK [" in line)


# -- the runner on its own ----------------------------------------------------------------------

def make_zip(basic_source):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in ("ansible/__init__.py", "ansible/module_utils/__init__.py", "ansible/modules/__init__.py",
                     "ansible/module_utils/_internal/__init__.py", "ansible/module_utils/_internal/_ansiballz/__init__.py",
                     "ansible/module_utils/_internal/_ansiballz/_loader.py"):
            z.writestr(name, "")
        z.writestr("ansible/module_utils/basic.py", basic_source)
        z.writestr("ansible/modules/probe.py", "import os\nWHO = 'probe'\n")
    return buf.getvalue()


PAYLOAD = r'''
_ANSIBALLZ_WRAPPER = True
import json, os, sys, tempfile
d = tempfile.mkdtemp()
p = os.path.join(d, "m.zip")
with open(p, "wb") as f:
    f.write(__import__("base64").b64decode(ARGS["zip_data"]))
sys.path.insert(0, p)
import ansible.module_utils.basic as b
import ansible.modules.probe as probe
print(json.dumps({"x": b.X, "state": getattr(b, "STATE", None), "foo": os.environ.get("FOO"),
                  "argv": sys.argv, "cwd": os.getcwd(), "probe": probe.WHO, "tmp": tempfile.gettempdir()}))
sys.stdout.flush()
b.STATE = "mutated"
os.environ["LEAK"] = "1"
ACTION = os.environ.get("ACTION")
if ACTION == "fail":
    raise ValueError("boom")
if ACTION == "exit":
    sys.stderr.write("bye\n")
    sys.exit(3)
if ACTION == "sleep":
    import time
    time.sleep(30)
'''


def payload(basic_source="X = 1\n"):
    zip_data = base64.b64encode(make_zip(basic_source)).decode()
    return ("ARGS = dict(\nzip_data='%s',\n)\n" % zip_data + PAYLOAD).encode()


def test_runner_env_state_failures_and_mismatch(tmp_path):
    r = LocalRunner(tmp_path)
    try:
        rc, out, err = r.run(1, {"FOO": "bär", "TMPDIR": str(tmp_path)}, payload())
        assert rc == 0, err
        first = json.loads(out)
        assert first == {"x": 1, "state": None, "foo": "bär", "argv": [""], "cwd": str(tmp_path), "probe": "probe",
                         "tmp": str(tmp_path)}
        # global state of the previous run (module_utils attribute, os.environ) does not leak
        rc, out, err = r.run(2, {}, payload())
        assert rc == 0, err
        second = json.loads(out)
        assert second["state"] is None and second["foo"] is None
        # an uncaught exception: traceback on stderr as a cold `python3 <stdin>` would print it, rc 1
        rc, out, err = r.run(3, {"ACTION": "fail"}, payload())
        assert rc == 1
        assert err.startswith(b"Traceback (most recent call last):\n  File \"<stdin>\"")
        assert err.rstrip().endswith(b"ValueError: boom")
        rc, out, err = r.run(4, {"ACTION": "exit"}, payload())
        assert (rc, err) == (3, b"bye\n")
        # module_utils that differ from the preloaded ones: refused (the worker runs it cold)
        rc, reason, dummy = r.run(5, {}, payload("X = 2\n"))
        assert rc == "refused" and "ansible/module_utils/basic.py" in reason
        # variables the interpreter reads at start-up: refused
        rc, reason, dummy = r.run(6, {"PYTHONPATH": "/x"}, payload())
        assert rc == "refused" and "PYTHONPATH" in reason
        rc, reason, dummy = r.run(7, {}, b"print('not a module payload')")
        assert rc == "refused"
        # a kill stops the module's process group
        meta = json.dumps({"env": {"ACTION": "sleep"}}).encode()
        r.send(8, RUN, struct.pack("!I", len(meta)) + meta + payload())
        assert r.frame()[1] == STARTED
        assert r.frame()[1] == OUT
        r.send(8, KILL)
        assert r.frame()[1:] == (EXIT, b'{"rc": -9}')
    finally:
        r.close()


EXTRA_PAYLOAD = r'''
_ANSIBALLZ_WRAPPER = True
import json, os
import ansible.module_utils.extra as extra
print(json.dumps({"v": extra.V, "imported_here": extra.PID == os.getpid(), "seen": extra.SEEN}))
extra.SEEN.append(os.getpid())
if os.environ.get("ACTION") == "fail":
    raise SystemExit(2)
'''


def extra_payload(extra_source, stamp=0):
    """A payload importing a module_utils the runner did not preload at start; stamp varies the zip's bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in ("ansible/__init__.py", "ansible/module_utils/__init__.py",
                     "ansible/module_utils/_internal/__init__.py", "ansible/module_utils/_internal/_ansiballz/__init__.py",
                     "ansible/module_utils/_internal/_ansiballz/_loader.py", "ansible/module_utils/basic.py"):
            z.writestr(name, "")
        z.writestr("ansible/module_utils/extra.py", extra_source)
        z.writestr("stamp.txt", str(stamp))
    zip_data = base64.b64encode(buf.getvalue()).decode()
    return ("ARGS = dict(\nzip_data='%s',\n)\n" % zip_data + EXTRA_PAYLOAD).encode()


def test_runner_preloads_what_clean_runs_import(tmp_path):
    r = LocalRunner(tmp_path)
    extra = "import os\nV = %d\nPID = os.getpid()\nSEEN = []\n"
    try:
        # a failed run teaches the runner nothing: the next run imports the module_utils itself again
        rc, out, err = r.run(1, {"ACTION": "fail"}, extra_payload(extra % 1))
        assert rc == 2 and json.loads(out)["imported_here"] is True, err
        rc, out, err = r.run(2, {}, extra_payload(extra % 1))
        assert rc == 0 and json.loads(out) == {"v": 1, "imported_here": True, "seen": []}, err
        # after a clean run it is preloaded in the runner: the next fork finds it imported, with fresh state
        # (the same zip, and another zip with the same module_utils)
        for rid, stamp in ((3, 0), (4, 1)):
            rc, out, err = r.run(rid, {}, extra_payload(extra % 1, stamp))
            assert rc == 0 and json.loads(out) == {"v": 1, "imported_here": False, "seen": []}, err
        # a payload whose copy of that module_utils differs is refused and runs cold
        rc, reason, dummy = r.run(5, {}, extra_payload(extra % 2))
        assert rc == "refused" and "ansible/module_utils/extra.py" in reason
    finally:
        r.close()


def test_runner_takes_a_held_zip_by_reference(tmp_path):
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr

    r = LocalRunner(tmp_path)
    data = payload()
    source, zip_b64 = wr.split_payload(data, module_runners.CORE)
    key = wr.zip_key(zip_b64)

    def run_ref(rid, run_env):
        meta = json.dumps({"env": run_env, "zip": key}).encode()
        r.send(rid, wr.RUNREF, struct.pack("!I", len(meta)) + meta + source)

    try:
        run_ref(1, {})  # not held yet: the runner asks for the whole payload and runs nothing
        assert r.frame() == (1, wr.MISS, b"")
        rc, out, err = r.run(2, {"FOO": "whole"}, data)
        assert rc == 0, err
        run_ref(3, {"FOO": "by reference"})  # now held: the same module runs from the kept zip
        assert r.frame()[:2] == (3, STARTED)
        out = b""
        while True:
            rid, kind, body = r.frame()
            assert rid == 3
            if kind == OUT:
                out += body
            if kind == EXIT:
                assert json.loads(body)["rc"] == 0
                break
        assert json.loads(out)["foo"] == "by reference" and json.loads(out)["probe"] == "probe"
    finally:
        r.close()


def test_runner_replaces_only_the_zip_literal():
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr

    data = payload()
    source, zip_b64 = wr.split_payload(data, module_runners.CORE)
    assert base64.b64decode(zip_b64) == make_zip("X = 1\n")
    assert source.count(b"\n") == data.count(b"\n")  # line numbers in tracebacks stay the same
    assert b"zip_data=__microvm_zip_data__,\n" in source and zip_b64.encode() not in source
    assert wr.split_payload(b"print('no wrapper')", module_runners.CORE) is None


# -- through ansible-playbook -----------------------------------------------------------------

def test_battery_warm_on_and_off(plane, sandbox, env, tmp_path, playbook_runner):  # noqa: F811
    work = tmp_path / "work"
    work.mkdir()
    (work / "empty").write_bytes(b"")
    inv = inventory({"box": sandbox["name"]})
    for warm in ("true", "false"):
        res = playbook_runner(BATTERY, inv, env, workdir=str(work),
                              extra_args=["-e", "ansible_pipelining=true", "-e", "ansible_microvm_warm_runner=%s" % warm, "-vvv"])
        assert res.rc == 0, res
        assert "failed=0" in res.stdout and "unreachable=0" in res.stdout, res
        if warm == "true":
            assert res.stdout.count(WARM_RAN) >= 10, res
            assert "WARM RUNNER not used, running cold: become is used" in res.stdout, res
        else:
            assert "WARM RUNNER" not in res.stdout, res


LIBRARY_STATE = r'''#!/usr/bin/python
import os
import sys
from ansible.module_utils import basic
from ansible.module_utils.basic import AnsibleModule


def main():
    m = AnsibleModule(argument_spec={"fail": {"type": "bool", "default": False}, "crash": {"type": "bool", "default": False}},
                      supports_check_mode=True)
    seen = getattr(basic, "_MICROVM_SEEN", 0)
    basic._MICROVM_SEEN = seen + 1
    leaked = os.environ.get("MICROVM_LEAK")
    os.environ["MICROVM_LEAK"] = "leaked"
    sys.modules.setdefault("microvm_leak_marker", basic)
    if m.params["crash"]:
        raise RuntimeError("crash on purpose")
    if m.params["fail"]:
        m.fail_json(msg="failed on purpose", seen=seen)
    m.exit_json(changed=not m.check_mode, seen=seen, leaked=leaked, my_var=os.environ.get("MY_VAR"),
                check_mode=m.check_mode, cwd=os.getcwd(), diff={"before": "a\n", "after": "b\n"} if m._diff else None)


if __name__ == "__main__":
    main()
'''

SEMANTICS = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - {name: state 1, microvm_state: {}, register: s1}
    - {name: state 2, microvm_state: {}, register: s2}
    - name: environment
      microvm_state: {}
      environment: {MY_VAR: "vål ue"}
      register: s3
    - {name: check and diff, microvm_state: {}, check_mode: true, diff: true, register: s4}
    - {name: fail, microvm_state: {fail: true}, register: f1, ignore_errors: true}
    - {name: crash, microvm_state: {crash: true}, register: f2, ignore_errors: true}
    - {name: command fails, ansible.builtin.command: /bin/false, register: f3, ignore_errors: true}
    - name: async task
      ansible.builtin.command: echo async
      async: 20
      poll: 1
      register: a1
    - name: become
      ansible.builtin.command: id -un
      become: true
      become_method: ansible.builtin.su
      register: b1
    - ansible.builtin.copy:
        dest: "{{ playbook_dir }}/result-{{ ansible_microvm_warm_runner }}.json"
        content: "{{ {'s1': s1, 's2': s2, 's3': s3, 's4': s4, 'f1': f1, 'f2': f2, 'f3': f3, 'a1': a1, 'b1': b1} | to_json }}"
      delegate_to: localhost
      vars: {ansible_connection: local, ansible_python_interpreter: "{{ ansible_playbook_python }}"}
"""

VOLATILE = ("start", "end", "delta", "cwd", "invocation", "ansible_job_id", "results_file", "started", "finished",
            "module_stderr", "exception")


def strip(result):
    return {k: v for k, v in result.items() if k not in VOLATILE}


def test_semantics_identical_warm_and_cold(plane, sandbox, env, tmp_path, playbook_runner):  # noqa: F811
    (tmp_path / "library").mkdir()
    (tmp_path / "library" / "microvm_state.py").write_text(LIBRARY_STATE)
    inv = inventory({"box": sandbox["name"]})
    results = {}
    for warm in ("true", "false"):
        res = playbook_runner(SEMANTICS, inv, env, workdir=str(tmp_path),
                              extra_args=["-e", "ansible_microvm_warm_runner=%s" % warm, "-vvv"])
        assert res.rc == 0, res
        results[warm] = json.loads((tmp_path / ("result-%s.json" % warm)).read_text())
        if warm == "true":
            assert WARM_RAN in res.stdout, res
            assert "WARM RUNNER not used, running cold: async task" in res.stdout, warm_lines(res)
            assert "WARM RUNNER not used, running cold: become is used" in res.stdout, warm_lines(res)
    warm, cold = results["true"], results["false"]
    for name in warm:
        assert strip(warm[name]) == strip(cold[name]), name
    assert warm["s1"]["seen"] == warm["s2"]["seen"] == 0
    assert warm["s2"]["leaked"] is None
    assert warm["s3"]["my_var"] == "vål ue"
    assert warm["s4"]["check_mode"] is True and warm["s4"]["changed"] is False
    assert warm["f1"]["msg"] == "failed on purpose" and warm["f1"]["failed"]
    for side in (warm, cold):
        assert side["f2"]["failed"] and "crash on purpose" in json.dumps(side["f2"])
    assert warm["f2"].get("exception") and warm["f2"].get("exception", "").split("\n")[-2:] == \
        cold["f2"].get("exception", "").split("\n")[-2:]
    assert warm["f3"]["rc"] == 1 and warm["a1"]["stdout"] == "async"


KILL_RUNNER = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - name: warm up
      ansible.builtin.command: echo warm
    - name: the module kills its own runner mid-run
      ansible.builtin.shell: |
        runner=$(awk '{print $4}' /proc/$PPID/stat)
        tr '\0' ' ' < /proc/$runner/cmdline | grep -q microvm-warm-runner && kill -9 $runner
        sleep 1
      register: k
      ignore_unreachable: true
    - name: the next task works (a new runner)
      ansible.builtin.command: echo after
      register: after
    - ansible.builtin.assert:
        that: ["after.stdout == 'after'", "k is unreachable"]
"""


def test_runner_killed_mid_run(plane, sandbox, env, playbook_runner):  # noqa: F811
    res = playbook_runner(KILL_RUNNER, inventory({"box": sandbox["name"]}, ansible_microvm_warm_runner="true"), env,
                          extra_args=["-vvv"])
    assert res.rc == 0, res
    assert "died during the task" in res.stdout, res
    assert "it is not re-run" in res.stdout, res  # a lost module is UNREACHABLE, like a lost cold command
    assert res.stdout.count(WARM_RAN) >= 2, res


NO_RUNNER_PYTHON = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - name: an interpreter that runs modules but cannot host the runner
      ansible.builtin.copy:
        dest: /workspace/python3
        mode: "0755"
        content: |
          #!/bin/sh
          [ "$3" = microvm-warm-runner ] && { echo "no runner here" >&2; exit 1; }
          exec /usr/bin/python3 "$@"
    - name: cold through it, twice
      ansible.builtin.command: echo cold
      register: c
      loop: [1, 2]
      vars: {ansible_python_interpreter: /workspace/python3}
    - ansible.builtin.assert:
        that: ["c.results | map(attribute='stdout') | list == ['cold', 'cold']"]
"""


def test_interpreter_without_runner_runs_cold(plane, sandbox, env, playbook_runner):  # noqa: F811
    res = playbook_runner(NO_RUNNER_PYTHON, inventory({"box": sandbox["name"]}), env, extra_args=["-vvv"])
    assert res.rc == 0, res
    assert res.stdout.count("WARM RUNNER refused, running cold: the warm runner could not start with /workspace/python3") == 2, \
        warm_lines(res)
    assert "no runner here" in res.stdout, warm_lines(res)


SERVED_WARM = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo {{ item }}
      loop: [1, 2, 3]
    - name: changed (mkdtemp, stat, put, chmod, copy, rm)
      ansible.builtin.copy: {content: "one\n", dest: /workspace/served-module_runners.txt}
    - name: unchanged (mkdtemp, stat, file, rm)
      ansible.builtin.copy: {content: "one\n", dest: /workspace/served-module_runners.txt}
    - ansible.builtin.ping:
"""


def test_every_task_is_served_warm(plane, sandbox, env, mux_dir, playbook_runner):  # noqa: F811
    """On this ansible-core, every module and every task tmp dir command is served by the warm runner.

    The mux counts how it served each request ("hello"); a core whose commands the connection no longer
    recognises (2.21 dropped ` && sleep 0`) shows up here as cold execs, failing this test.
    """
    res = playbook_runner(SERVED_WARM, inventory({"box": sandbox["name"]}), env, extra_args=["-vvv"])
    assert res.rc == 0 and "failed=0" in res.stdout, res
    # 3 commands + 2 (stat, copy) + 2 (stat, file) + ping; one put; the two rms, unawaited. No tmp dir command has a
    # round trip of its own (agent.py _defer): each mkdtemp goes with the stat module's request, the copy's chmod of
    # the file it put with the copy module's; a "tmp" here is one of them served alone
    served = served_by_session(mux_dir, sandbox["session_id"], until=lambda s: s.get("tmp_nowait", 0) >= 2)
    assert served == {"warm": 8, "put": 1, "tmp_nowait": 2}, (served, warm_lines(res))
    assert res.stdout.count("WARM RUNNER ran the module with /usr/bin/python3 (rc 0), after mkdtemp\n") == 2, warm_lines(res)
    assert ", after chmod" in res.stdout, warm_lines(res)
    assert res.stdout.count("WARM RUNNER removes the task tmp dir after this task, unawaited") == 2, warm_lines(res)


def served_by_session(mux_dir, session_id, until=lambda served: True):
    """How the mux served this session's requests ("hello"), once `until` holds of it: an unawaited request is
    counted when the mux has done it, which may be a moment after the playbook ended (bounded wait, then as is)."""
    from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import pool_status

    for _attempt in range(100):
        served = {}
        for status in pool_status(mux_dir).values():
            for how, count in status["served_by_session"].get(session_id, {}).items():
                served[how] = served.get(how, 0) + count
        if until(served):
            break
        time.sleep(0.1)
    return served


TMP_DIR_SEMANTICS = r"""
- hosts: sbx
  gather_facts: false
  vars:
    tmp_root: /workspace/.scratch/ansible-tmp
  tasks:
    - name: check mode (stat only; the tmp dir made with it, then removed)
      ansible.builtin.copy: {content: "check\n", dest: /workspace/tmp-sem-check.txt}
      check_mode: true
      register: checked
    - name: a module that fails (the tmp dir made with its stat, then removed all the same)
      ansible.builtin.copy: {content: "x\n", dest: /workspace/tmp-sem-missing/dir/x.txt}
      register: broken
      ignore_errors: true
    - name: a loop (each item's rm goes unanswered; the requests after it stay in step)
      ansible.builtin.copy: {content: "{{ item }}\n", dest: "/workspace/tmp-sem-{{ item }}.txt"}
      loop: [a, b, c]
      register: looped
    - name: no tmp dir is left behind
      ansible.builtin.find: {paths: "{{ tmp_root }}", patterns: "ansible-tmp-*", file_type: directory}
      register: left
    - ansible.builtin.stat: {path: /workspace/tmp-sem-check.txt}
      register: never
    - ansible.builtin.assert:
        that:
          - checked is changed and not never.stat.exists
          - broken is failed and 'does not exist' in broken.msg
          - left.matched == 0
          - looped.results | map(attribute='changed') | list == [true, true, true]
"""

TMP_DIR_FAILS = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: touch /workspace/tmp-sem-file
    - name: remote_tmp under a file (mkdir fails)
      ansible.builtin.copy: {content: "x\n", dest: /workspace/tmp-sem-never.txt}
      vars: {ansible_remote_tmp: /workspace/tmp-sem-file/tmp}
"""


def test_tmp_dir_without_round_trips_keeps_cores_semantics(plane, sandbox, env, mux_dir, playbook_runner):  # noqa: F811
    """mkdtemp answered ahead and rm unawaited: check mode, a failing module, and a mkdir that fails, which fails
    the task with core's own words (the same as with warm_runner off, where core runs its command itself)."""
    inv = inventory({"box": sandbox["name"]})
    res = playbook_runner(TMP_DIR_SEMANTICS, inv, env, extra_args=["-vvv"])
    assert res.rc == 0 and "failed=0" in res.stdout and "ignored=1" in res.stdout, res
    served = served_by_session(mux_dir, sandbox["session_id"], until=lambda s: s.get("tmp_nowait", 0) >= 5)
    assert "tmp" not in served and served.get("tmp_nowait") == 5, served

    failures = {}
    # warm runner on: the mkdir fails with the stat module's request; without pipelining, with the put of the module;
    # off: core runs its own command
    for warm, pipelining in (("true", "true"), ("true", "false"), ("false", "true")):
        res = playbook_runner(TMP_DIR_FAILS, inv, dict(env, MICROVM_WARM_RUNNER=warm, ANSIBLE_PIPELINING=pipelining),
                              extra_args=["-vvv"])
        assert res.rc != 0 and "unreachable=1" in res.stdout, (warm, pipelining, res)
        assert ("WARM RUNNER will make the task tmp dir" in res.stdout) == (warm == "true"), (warm, warm_lines(res))
        assert ("mkdtemp ahead of the put" in res.stdout) == (pipelining == "false"), (pipelining, warm_lines(res))
        found = re.search(r"(Failed to create temporary directory\..*?exited with result \d+)", res.stdout)
        assert found, (warm, pipelining, res.stdout)
        failures[warm + pipelining] = re.sub(r"ansible-tmp-[0-9.]+-\d+-\d+", "ansible-tmp-N", found.group(1))
    assert len(set(failures.values())) == 1, failures
    assert "Failed command was: ( umask 77 && mkdir -p" in failures["truetrue"], failures


def test_a_later_run_takes_its_payloads_from_the_cache(plane, sandbox, env, playbook_runner, tmp_path):  # noqa: F811
    """The first run builds each module's payload and keeps it; the next run builds none (core_compat A10)."""
    env = dict(env, MICROVM_PAYLOAD_CACHE=str(tmp_path / "payloads"))
    said = "came from the payload cache"
    first = playbook_runner(SERVED_WARM, inventory({"box": sandbox["name"]}), env, extra_args=["-vvv"])
    assert first.rc == 0 and said not in first.stdout, first
    second = playbook_runner(SERVED_WARM, inventory({"box": sandbox["name"]}), env, extra_args=["-vvv"])
    assert second.rc == 0 and "failed=0" in second.stdout, second
    cached = {line.split("payload of ", 1)[1].split()[0] for line in second.stdout.splitlines() if said in line}
    # every module the second run used (its copies find the file in place: stat and file, no copy module)
    assert cached == {"ansible.modules.command", "ansible.modules.stat", "ansible.modules.file", "ansible.modules.ping"}, \
        [line for line in second.stdout.splitlines() if said in line]


COUNT_PAYLOAD = r'''
_ANSIBALLZ_WRAPPER = True
import json, sys, zipimport
compiled = []
real = zipimport._compile_source
zipimport._compile_source = lambda pathname, source: compiled.append(pathname.rsplit("/", 1)[-1]) or real(pathname, source)
import ansible.module_utils.extra as extra
import ansible.modules.probe as probe
print(json.dumps({"compiled": compiled, "probe": probe.WHO, "file": probe.__file__}))
'''


def test_runner_compiles_a_module_once(tmp_path):
    """After a clean run, later forks find the module (and the module_utils it imported) compiled."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in ("ansible/__init__.py", "ansible/module_utils/__init__.py", "ansible/modules/__init__.py",
                     "ansible/module_utils/_internal/__init__.py", "ansible/module_utils/_internal/_ansiballz/__init__.py",
                     "ansible/module_utils/_internal/_ansiballz/_loader.py", "ansible/module_utils/basic.py"):
            z.writestr(name, "")
        z.writestr("ansible/module_utils/extra.py", "V = 1\n")
        z.writestr("ansible/modules/probe.py", "WHO = 'probe'\n")
    data = ("ARGS = dict(\nzip_data='%s',\n)\n" % base64.b64encode(buf.getvalue()).decode() + COUNT_PAYLOAD).encode()
    r = LocalRunner(tmp_path)
    try:
        seen = []
        for rid in (1, 2, 3):
            rc, out, err = r.run(rid, {}, data)
            assert rc == 0, err
            seen.append(json.loads(out))
        assert {"extra.py", "probe.py"} <= set(seen[0]["compiled"])
        assert seen[1]["compiled"] == seen[2]["compiled"] == []  # extra.py preloaded, probe.py compiled in the runner
        assert seen[0]["file"] == seen[2]["file"] and seen[2]["probe"] == "probe"
    finally:
        r.close()


DEFERRED_CHMOD = r"""
- hosts: sbx
  gather_facts: false
  vars:
    tmp_root: /workspace/.scratch/ansible-tmp
  tasks:
    - name: a tree of three files (each put's chmod goes with the copy module that reads it)
      ansible.builtin.copy: {src: "{{ playbook_dir }}/tree/", dest: "/workspace/deferred-{{ p }}/", mode: "0640"}
      register: tree
    - ansible.builtin.command: cat a.txt sub/b.txt sub/c.txt
      args: {chdir: "/workspace/deferred-{{ p }}"}
      register: cat
    - name: a copy that fails after its put and chmod (the dest dir is missing)
      ansible.builtin.copy: {content: "x\n", dest: /workspace/deferred-missing/dir/x.txt}
      register: broken
      ignore_errors: true
    - name: a script (no module after the chmod; it runs first, then the script)
      ansible.builtin.script: "{{ playbook_dir }}/s.sh"
      register: sc
    - name: no other task's tmp dir is left behind, the failed one's included
      ansible.builtin.find: {paths: "{{ tmp_root }}", patterns: "ansible-tmp-*", file_type: directory}
      register: left
    - ansible.builtin.assert:
        that:
          - tree is changed
          - cat.stdout_lines == ['a', 'b', 'c']
          - broken is failed and 'does not exist' in broken.msg
          - sc.stdout | trim == 'ran'
          - left.matched == (0 if p == 'true' else 1)  # without pipelining, find's own tmp dir
"""

KEPT = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.copy: {content: "kept\n", dest: /workspace/deferred-kept.txt}
"""


def test_a_deferred_chmod_keeps_cores_semantics(plane, sandbox, env, mux_dir, playbook_runner, tmp_path):  # noqa: F811
    """The chmod core runs on what it put, sent with the module's request (or run before anything else): a
    directory copy, a module failing after it (the tmp dir still removed), a script, pipelining off, and
    keep_remote_files (the kept modules have the mode core asked for: each chmod ran before its module)."""
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    for name, text in (("a.txt", "a"), ("sub/b.txt", "b"), ("sub/c.txt", "c")):
        (tmp_path / "tree" / name).write_text(text + "\n")
    (tmp_path / "s.sh").write_text("#!/bin/sh\necho ran\n")
    inv = inventory({"box": sandbox["name"]})
    for pipelining in ("true", "false"):
        res = playbook_runner(DEFERRED_CHMOD, inv, dict(env, ANSIBLE_PIPELINING=pipelining), workdir=str(tmp_path),
                              extra_args=["-vvv", "-e", "p=%s" % pipelining])
        assert res.rc == 0 and "failed=0" in res.stdout and "ignored=1" in res.stdout, (pipelining, res)
        assert (", after chmod" in res.stdout) == (pipelining == "true"), (pipelining, warm_lines(res))
        # the script's put (and without pipelining every module's) comes first: its tmp dir is made ahead of it
        assert "WARM RUNNER will do mkdtemp ahead of the put, in its request" in res.stdout, (pipelining, warm_lines(res))

    res = playbook_runner(KEPT, inv, dict(env, ANSIBLE_KEEP_REMOTE_FILES="1"), workdir=str(tmp_path), extra_args=["-vvv"])
    assert res.rc == 0 and "failed=0" in res.stdout, res
    check = playbook_runner(r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.shell: >-
        for f in /workspace/.scratch/ansible-tmp/ansible-tmp-*/AnsiballZ_*.py; do test -x "$f" && basename "$f"; done;
        rm -rf /workspace/.scratch/ansible-tmp/ansible-tmp-*
      register: kept
    - ansible.builtin.assert: {that: ["kept.stdout_lines == ['AnsiballZ_copy.py', 'AnsiballZ_stat.py']"]}
""", inv, env, workdir=str(tmp_path))
    assert check.rc == 0 and "failed=0" in check.stdout, check
