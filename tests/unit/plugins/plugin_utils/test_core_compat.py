"""Each ansible-core assumption of _shared/core_compat.py (A1-A7), checked against the installed core.

Runs on every supported core: 2.19 (.venv), 2.20 (.venv-220, make test-core220) and 2.21 (.venv-newest,
make test-newest). The commands and payloads are the real ones: a playbook runs through a recording
connection (ansible.builtin.local underneath, wrapped with core_compat's own shell hooks) that writes down
every command core hands it, its stdin, and every file put. A core release that breaks an assumption fails
the test named after it, instead of silently sending tasks down the slow path.
"""
import base64
import json
import os
import shlex
import subprocess
import sys

import pytest
from ansible import constants as C
from ansible.plugins.loader import shell_loader
from ansible.release import __version__ as CORE_VERSION

from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import module_runners
from ansible_collections.microvm.sandbox.plugins.plugin_utils._guest import module_runner as wr
from microvm_warm_testing import LocalRunner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
COLLECTIONS = os.path.join(ROOT, ".local", "collections")

RECORDER = r'''
import base64, json, os
from ansible.plugins.connection.local import Connection as Local
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat

DOCUMENTATION = """
name: recorder
short_description: ansible.builtin.local, writing down what core asks of a connection
description: [Used by test_core_compat.py only.]
author: [microvm.sandbox maintainers (@microvm)]
options: {}
"""


class Connection(Local):
    transport = "recorder"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the agent connection's hooks (A5): a default remote_tmp set after the shell's options, TMPDIR last
        core_compat.wrap_shell(self._shell, self._after_shell_options, lambda: {"TMPDIR": os.environ["RECORD_TMPDIR"]},
                               self._home_alias)

    def _after_shell_options(self, task_keys):
        self._record(op="shell_options", remote_tmp=self._shell.get_option("remote_tmp"),
                     action=task_keys.get("action"))
        self._shell.set_option("remote_tmp", os.environ["RECORD_REMOTE_TMP"])

    def _home_alias(self, path):
        self._record(op="expand_user", path=path)
        if os.environ.get("RECORD_HOME_ALIAS") and path.startswith("~") and path != "~" and not path.startswith("~/"):
            _user, sep, rest = path[1:].partition("/")
            return "~" + sep + rest  # '~<user>/x' as '~/x', as the agent connection's one home per user does
        return path

    def _record(self, **entry):
        entry["pid"] = os.getpid()
        with open(os.environ["RECORD_LOG"], "a") as f:
            f.write(json.dumps(entry) + "\n")

    def exec_command(self, cmd, in_data=None, sudoable=True):
        self._record(op="exec", cmd=cmd, stdin=base64.b64encode(in_data or b"").decode(), sudoable=sudoable)
        return super().exec_command(cmd, in_data=in_data, sudoable=sudoable)

    def put_file(self, in_path, out_path):
        self._record(op="put", remote=out_path)
        return super().put_file(in_path, out_path)
'''

PLAYBOOK = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo hi
    - ansible.builtin.copy: {content: "one\\n", dest: "{{ dest }}/one.txt"}
    - ansible.builtin.ping:
"""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """What core asked of the connection in one real run: {"entries": [...], "dirs": {...}}."""
    work = tmp_path_factory.mktemp("core-%s" % CORE_VERSION)
    (work / "connection_plugins").mkdir()
    (work / "connection_plugins" / "recorder.py").write_text(RECORDER)
    (work / "playbook.yml").write_text(PLAYBOOK)
    (work / "dest").mkdir()
    dirs = {"log": str(work / "record.jsonl"), "remote_tmp": str(work / "remote" / "ansible-tmp"),
            "tmpdir": str(work / "run"), "dest": str(work / "dest")}
    os.makedirs(dirs["tmpdir"])
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS, ANSIBLE_PIPELINING="1", ANSIBLE_NOCOLOR="1",
               ANSIBLE_KEEP_REMOTE_FILES="0", RECORD_LOG=dirs["log"], RECORD_REMOTE_TMP=dirs["remote_tmp"],
               RECORD_TMPDIR=dirs["tmpdir"], PYTHONPATH=os.pathsep.join([COLLECTIONS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", "box,", "-c", "recorder",
                           "-e", "ansible_python_interpreter=%s dest=%s" % (sys.executable, dirs["dest"]), "playbook.yml"],
                          cwd=str(work), env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "failed=0" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(dirs["log"]) as f:
        entries = [json.loads(line) for line in f]
    for e in entries:
        if e["op"] == "exec":
            e["argv"] = core_compat.command_argv("/bin/sh", e["cmd"])
            e["stdin"] = base64.b64decode(e["stdin"])
    return {"entries": entries, "dirs": dirs}


def execs(recorded):
    return [e for e in recorded["entries"] if e["op"] == "exec"]


def module_runs(recorded):
    return [e for e in execs(recorded) if e["stdin"]]


def test_a1_pipelined_module_command_is_recognised(recorded):
    runs = module_runs(recorded)
    assert len(runs) == 4, [e["cmd"] for e in execs(recorded)]  # command, stat and copy, ping
    for e in runs:
        shape, why = core_compat.module_command(e["argv"], e["stdin"])
        assert why is None, "%s: %s (core %s)" % (why, e["cmd"], CORE_VERSION)
        interpreter, env = shape
        assert interpreter == sys.executable and list(env) == ["TMPDIR"]  # A5: our TMPDIR, last
        assert env["TMPDIR"] == recorded["dirs"]["tmpdir"]


@pytest.mark.parametrize("script, stdin, expected", [
    ("MY='a b' TMPDIR=/w/run.x /usr/bin/python3 && sleep 0", b"_ANSIBALLZ_WRAPPER = True\n",
     ("/usr/bin/python3", {"MY": "a b", "TMPDIR": "/w/run.x"})),           # 2.19, 2.20
    ("MY='a b' TMPDIR=/w/run.x /usr/bin/python3", b"_ANSIBALLZ_WRAPPER = True\n",
     ("/usr/bin/python3", {"MY": "a b", "TMPDIR": "/w/run.x"})),           # 2.21
    ("/usr/bin/python3", b"_ANSIBALLZ_WRAPPER = True\n", ("/usr/bin/python3", {})),
    ("MY='a b' /usr/bin/python3 && sleep 0", b"print(1)", "not a Python module payload"),
    ("sudo -H -S -n -u root /bin/sh -c 'echo BECOME; /usr/bin/python3' && sleep 0", b"_ANSIBALLZ_WRAPPER = True\n",
     "command shape not recognised (become or a wrapper?)"),
    ("MY=$HOME /usr/bin/python3", b"_ANSIBALLZ_WRAPPER = True\n", "command shape not recognised"),
    ("/usr/bin/python3 /x/async_wrapper.py 1 2 && sleep 0", b"", "async task"),
    ("/usr/bin/perl", b"_ANSIBALLZ_WRAPPER = True\n", "interpreter /usr/bin/perl is not a plain python path"),
    ("/usr/bin/python3 && sleep 0 && sleep 0", b"_ANSIBALLZ_WRAPPER = True\n", "command shape not recognised"),
])
def test_a1_module_command_shapes(script, stdin, expected):
    shape, why = core_compat.module_command(["/bin/sh", "-c", script], stdin)
    if isinstance(expected, tuple):
        assert (shape, why) == (expected, None)
    else:
        assert shape is None and why.startswith(expected)


def test_a2_ansiballz_payload_splits_and_preloads(recorded):
    import io
    import zipfile

    for e in module_runs(recorded):
        split = wr.split_payload(e["stdin"], module_runners.CORE)
        assert split is not None, "no zip_data line in this core's AnsiballZ payload"
        source, zip_b64 = split
        assert source.count(b"\n") == e["stdin"].count(b"\n") and zip_b64.encode() not in source
        names = set(zipfile.ZipFile(io.BytesIO(base64.b64decode(zip_b64))).namelist())
        for module in core_compat.PRELOAD:
            assert module.replace(".", "/") + ".py" in names, module


def test_a9_wrapper_code_comes_before_the_task_call(recorded):
    """Every payload of a run is the same wrapper code and then the task's call: the runner compiles that code
    once (one cache entry for the whole run), each run compiles only the call, on the lines it has in the payload."""
    cache = wr.WrapperCache(module_runners.CORE.wrapper_call)
    runs = module_runs(recorded)
    assert len(runs) >= 3
    for e in runs:
        source = wr.split_payload(e["stdin"], module_runners.CORE)[0]
        split = cache.split(source)
        assert split is not None, "this core's payload has no `_ansiballz_main(` call block where core_compat expects it"
        head, tail, flags = split
        assert b"_ansiballz_main(" in tail and b"__microvm_zip_data__" in tail and b"def _ansiballz_main" not in tail
        assert flags & __import__("__future__").annotations.compiler_flag  # the wrapper's own future import
        call_line = source[:source.rindex(b"_ansiballz_main(")].count(b"\n") + 1
        tail_code = compile(tail, "<stdin>", "exec", flags)
        assert call_line in {line for _start, _end, line in tail_code.co_lines()}  # tracebacks name the same lines
    assert len(cache.code) == 1, "the wrapper code differs between the tasks of one run: it would be compiled every time"
    assert cache.split(b"print('not a wrapper')\n") is None  # anything else is compiled whole, as before
    # wrapper code that warns when compiled is compiled whole in the fork, so the warning reaches the task's stderr
    warns = b"x = '\\d'\n" + module_runners.CORE.wrapper_call + b"params='{}',\n)\n"
    assert cache.split(warns) is None


def test_a3_runner_runs_real_payloads_warm(recorded, tmp_path):
    """This core's real payloads run in the warm runner (preloaded, then each module from its own zip)."""
    runs = module_runs(recorded)
    by_module = {}
    for e in runs:
        for name in ("command", "stat", "copy", "ping"):
            if b"ansible.modules.%s'" % name.encode() in e["stdin"] or b'ansible.modules.%s"' % name.encode() in e["stdin"]:
                by_module.setdefault(name, e)
    assert set(by_module) >= {"command", "ping"}, "cannot tell the recorded payloads apart"
    runner = LocalRunner(tmp_path)
    try:
        for rid, name in enumerate(["command", "ping", "command"], 1):
            (_interp, env), _why = core_compat.module_command(by_module[name]["argv"], by_module[name]["stdin"])
            rc, out, err = runner.run(rid, env, by_module[name]["stdin"])
            assert rc == 0, (name, out, err)
            result = json.loads(out)
            assert result.get("stdout" if name == "command" else "ping") == ("hi" if name == "command" else "pong")
    finally:
        runner.close()


def test_a4_plugin_options_can_be_defined_ahead():
    name = "ansible_collections.microvm.sandbox.plugins.connection.core_compat_probe"
    assert not core_compat.plugin_options_defined("connection", name)
    core_compat.define_plugin_options("connection", name, {
        "probe": {"type": "int", "default": 3, "vars": [{"name": "ansible_probe"}], "description": ["x"]}})
    assert core_compat.plugin_options_defined("connection", name)
    assert C.config.get_plugin_vars("connection", name) == ["ansible_probe"]
    assert C.config.get_config_value("probe", plugin_type="connection", plugin_name=name) == 3


def test_a5_shell_hooks_are_called_by_core(recorded):
    options = [e for e in recorded["entries"] if e["op"] == "shell_options"]
    assert options, "core never called the shell's set_options through the instance"
    remote_tmp = recorded["dirs"]["remote_tmp"]
    mkdtemps = [e for e in execs(recorded) if "mkdir" in e["cmd"]]
    assert mkdtemps and all(remote_tmp in e["cmd"] for e in mkdtemps), "remote_tmp was read before set_options"
    for e in module_runs(recorded):
        assert shlex.split(core_compat.core_script(e["argv"]))[-2] == "TMPDIR=%s" % recorded["dirs"]["tmpdir"]
    # the task's action reaches the hook (the tempfile module keeps the guest's own TMPDIR by it)
    actions = {e["action"] for e in options}
    assert {"ansible.builtin.command", "ansible.builtin.copy", "ansible.builtin.ping"} <= actions, actions


def test_a5_home_paths_are_expanded_through_the_shell_instance(tmp_path):
    """Core expands a task's `~` path with the shell instance's expand_user, as `~<remote user>`: the hook sees it,
    and what it returns decides where the file lands (the agent connection's one home per user rewrites
    `~<user>` to `~`, the HOME its commands run with)."""
    (tmp_path / "connection_plugins").mkdir()
    (tmp_path / "connection_plugins" / "recorder.py").write_text(RECORDER)
    (tmp_path / "home").mkdir()
    (tmp_path / "playbook.yml").write_text("""
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.copy: {content: "home\\n", dest: "~/x.txt"}
""")
    log = tmp_path / "record.jsonl"
    env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=COLLECTIONS, ANSIBLE_PIPELINING="1", ANSIBLE_NOCOLOR="1",
               HOME=str(tmp_path / "home"), RECORD_HOME_ALIAS="1", RECORD_LOG=str(log), RECORD_REMOTE_TMP=str(tmp_path / "remote"),
               RECORD_TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join([COLLECTIONS, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ansible-playbook"), "-i", "box,", "-c",
                           "recorder", "-e", "ansible_python_interpreter=%s" % sys.executable, "playbook.yml"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    asked = [json.loads(line)["path"] for line in log.read_text().splitlines() if '"expand_user"' in line]
    assert any(p.startswith("~") and p != "~" for p in asked), asked
    assert (tmp_path / "home" / "x.txt").read_text() == "home\n"


def test_a6_task_tmp_dir_names(recorded):
    puts = [e for e in recorded["entries"] if e["op"] == "put"]
    assert len(puts) == 1
    task_dir = os.path.basename(os.path.dirname(puts[0]["remote"]))
    found = core_compat.TASK_TMP.match(task_dir)
    assert found, task_dir
    assert int(found.group(1)) == puts[0]["pid"]  # the worker's pid: sweeping relies on it
    assert os.path.dirname(os.path.dirname(puts[0]["remote"])) == recorded["dirs"]["remote_tmp"]


def test_a7_tmp_dir_commands_are_recognised(recorded, tmp_path):
    """The copy task's mkdtemp, chmod and rm are recognised, and the runner does exactly what they do."""
    shell = shell_loader.get("ansible.builtin.sh")
    non_module = [e for e in execs(recorded) if not e["stdin"]]
    ops = [core_compat.tmp_op(shell, e["argv"]) for e in non_module]
    assert [op and op["op"] for op in ops] == ["mkdtemp", "chmod", "rm"], [e["cmd"] for e in non_module]
    assert ops[0]["base"] == recorded["dirs"]["remote_tmp"] and ops[0]["mode"] == 0o700

    # replayed under tmp_path: the shell and the runner leave the same tree and print the same
    def moved(op, root):
        text = json.dumps(op).replace(recorded["dirs"]["remote_tmp"], str(root / "ansible-tmp"))
        return json.loads(text)

    def tree(root):
        out = {}
        for dirpath, dirnames, filenames in os.walk(str(root)):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                out[os.path.relpath(path, str(root))] = oct(os.lstat(path).st_mode)
        return out

    shell_root, runner_root = tmp_path / "shell", tmp_path / "runner"
    for root in (shell_root, runner_root):
        root.mkdir()
    runner = LocalRunner(tmp_path)
    try:
        for rid, (entry, op) in enumerate(zip(non_module, ops), 1):
            script = core_compat.core_script(entry["argv"]).replace(
                recorded["dirs"]["remote_tmp"], str(shell_root / "ansible-tmp"))
            cold = subprocess.run(["/bin/sh", "-c", "umask 022; " + script], capture_output=True, text=True, check=False)
            warm_op = moved(op, runner_root)
            done = runner.tmp(rid, warm_op)
            assert done == {"rc": cold.returncode, "stdout": cold.stdout.replace(str(shell_root), str(runner_root)),
                            "stderr": ""}, (script, cold.stderr)
            if op["op"] == "mkdtemp":  # the file the put would have written, for chmod
                name = op["name"]
                for root in (shell_root, runner_root):
                    (root / "ansible-tmp" / name / ".source.txt").write_text("x")
                    os.chmod(str(root / "ansible-tmp" / name / ".source.txt"), 0o600)
            if op["op"] != "rm":
                assert tree(shell_root) == tree(runner_root)
        assert tree(shell_root) == tree(runner_root) == {"ansible-tmp": oct(0o40700)}
    finally:
        runner.close()


@pytest.mark.parametrize("script", [
    "chmod u+rwx /etc/passwd",                                        # not in a task tmp dir
    "chmod 0777 /w/ansible-tmp/ansible-tmp-1.2-3-4/",                 # not a u+ mode
    "chmod u+rwx '/w/ansible-tmp/ansible-tmp-1.2-3-4/a b'",           # not a plain path
    "rm -f -r /w/ansible-tmp/ > /dev/null 2>&1",                      # not a task tmp dir
    "rm -f -r /w/../ansible-tmp-1.2-3-4/ > /dev/null 2>&1",
    "rm -f -r /w/ansible-tmp-1.2-3-4/ > /dev/null 2>&1; reboot",      # not what the shell plugin builds
    "( umask 77 && mkdir -p \"` echo $HOME `\"&& mkdir \"` echo $HOME/ansible-tmp-1.2-3-4 `\" && echo "
    "ansible-tmp-1.2-3-4=\"` echo $HOME/ansible-tmp-1.2-3-4 `\" )",   # shell expansion
    "mkdir -p /w/ansible-tmp-1.2-3-4",
])
def test_a7_anything_else_runs_in_a_shell(script):
    assert core_compat.tmp_op(shell_loader.get("ansible.builtin.sh"), ["/bin/sh", "-c", script]) is None


def test_a7_runner_refuses_what_it_cannot_do_exactly(tmp_path):
    runner = LocalRunner(tmp_path)
    task = "ansible-tmp-1.5-77-88"
    try:
        (tmp_path / "file").write_text("x")
        # mkdir of an existing task dir fails in a shell too: the runner leaves it to the shell
        (tmp_path / task).mkdir()
        assert runner.tmp(1, {"op": "mkdtemp", "base": str(tmp_path), "name": task, "mode": 0o700})[0] == "refused"
        assert runner.tmp(2, {"op": "mkdtemp", "base": str(tmp_path / "file"), "name": task, "mode": 0o700})[0] == "refused"
        # chmod of a missing path changes nothing
        paths = [str(tmp_path / "file"), str(tmp_path / "missing")]
        assert runner.tmp(3, {"op": "chmod", "mode": "u+rwx", "paths": paths})[0] == "refused"
        assert oct(os.stat(str(tmp_path / "file")).st_mode & 0o777) == oct(0o644)
        # rm of a symlinked task dir, or of a dir that is not a task dir, is left to rm
        os.symlink(str(tmp_path / task), str(tmp_path / "ansible-tmp-2.5-77-88"))
        assert runner.tmp(4, {"op": "rm", "path": str(tmp_path / "ansible-tmp-2.5-77-88") + "/"})[0] == "refused"
        assert runner.tmp(5, {"op": "rm", "path": str(tmp_path) + "/"})[0] == "refused"
        assert (tmp_path / task).is_dir()
        # a missing task dir is fine for rm -f
        assert runner.tmp(6, {"op": "rm", "path": str(tmp_path / "ansible-tmp-3.5-77-88") + "/"})["rc"] == 0
    finally:
        runner.close()


def test_a7_deferred_chmod_runs_ahead_of_the_module_in_its_request(recorded, tmp_path):
    """The copy task's chmod, sent with the module's request, is done before the module starts; one the runner
    cannot do refuses the run, nothing started (the worker then runs both cold, and the chmod reports its error)."""
    ping = next(e for e in module_runs(recorded) if b"ansible.modules.ping" in e["stdin"])
    (_interp, env), _why = core_compat.module_command(ping["argv"], ping["stdin"])
    task = tmp_path / "ansible-tmp-1.5-77-88"
    task.mkdir(mode=0o700)
    source = task / "source"
    source.write_text("x")
    os.chmod(str(source), 0o600)
    chmod = {"op": "chmod", "mode": "u+rwx", "paths": [str(task) + "/", str(source)]}
    runner = LocalRunner(tmp_path)
    try:
        rc, out, err = runner.run(1, env, ping["stdin"], before=[chmod])
        assert rc == 0 and json.loads(out)["ping"] == "pong", err
        assert oct(os.stat(str(source)).st_mode & 0o777) == oct(0o700)
        missing = dict(chmod, paths=[str(source), str(task / "missing")])
        os.chmod(str(source), 0o600)
        refused = runner.run(2, env, ping["stdin"], before=[missing])
        assert refused[0] == "refused" and "deferred chmod" in refused[1] and "missing" in refused[1], refused
        assert oct(os.stat(str(source)).st_mode & 0o777) == oct(0o600)  # checked before any change
        assert runner.run(3, env, ping["stdin"], before=[{"op": "unknown"}])[0] == "refused"
    finally:
        runner.close()


WORKERS = r'''
import builtins, json, os, sys
from ansible import constants as C
from ansible.plugins.loader import init_plugin_loader, connection_loader
init_plugin_loader([sys.argv[1]])
C.DEFAULT_LOCAL_TMP  # the run's local temp dir, made by the parent before it forks workers, as ansible-playbook does
for worker in range(2):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        compiled, real = [], builtins.compile
        def counting(*args, **kwargs):
            name = str(kwargs.get("filename") or (args[1] if len(args) > 1 else ""))
            if "/microvm/sandbox/" in name:
                compiled.append(name.rsplit("/", 1)[-1])
            return real(*args, **kwargs)
        builtins.compile = counting
        plugin = connection_loader.get("microvm.sandbox.agent", class_only=True)
        from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import mux_client
        os.write(w, json.dumps({"compiled": compiled, "transport": plugin.transport,
                                "file": mux_client.__file__}).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    print(os.read(r, 65536).decode())
'''


def test_a8_collection_code_compiled_once_per_run(tmp_path):
    """The first worker of a run compiles this collection's modules; the next one loads them compiled."""
    env = dict(os.environ, ANSIBLE_LOCAL_TEMP=str(tmp_path), PYTHONPATH=os.pathsep.join([COLLECTIONS, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", WORKERS, COLLECTIONS], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    first, second = json.loads(out[0]), json.loads(out[1])
    assert {"mux_client.py", "frames.py", "profile.py"} <= set(first["compiled"]), first
    # left: the plugin itself (core loads it before it can install anything) and the small module that installs
    # the cache (issue 45: core_compat was that module, compiled in every worker)
    assert set(second["compiled"]) <= {"agent.py", "__init__.py", "code_cache.py"}, second
    assert second["transport"] == first["transport"] == "microvm.sandbox.agent"
    assert second["file"] == first["file"] and second["file"].startswith(COLLECTIONS)


# A10: one "run" of ansible-core's payload build, in a fresh process with a fresh local temp dir (as each
# ansible-playbook run has), with the payload cache hooked in as the agent connection does it.
BUILD = r'''
import base64, hashlib, io, json, os, re, sys, tempfile, zipfile
from ansible import constants as C
from ansible.executor import module_common
from ansible.plugins.loader import init_plugin_loader, module_loader
from ansible.template import Templar
init_plugin_loader([sys.argv[1]])
C.DEFAULT_LOCAL_TMP = tempfile.mkdtemp()  # core's own cache lasts one run: this is a new run
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import payload_cache
store, names = sys.argv[2], sys.argv[3:]
assert payload_cache.install()
payload_cache.configure(store)
out = {}
for name in names:
    path = module_loader.find_plugin(name)
    built = module_common.modify_module(module_name=name, module_path=path, module_args={"_raw_params": "true"},
                                        templar=Templar(), task_vars={"ansible_python_interpreter": "/usr/bin/python3"})
    zip_data = re.search(rb"zip_data='([^']*)'", built.b_module_data).group(1)
    zf = zipfile.ZipFile(io.BytesIO(base64.b64decode(zip_data)))
    out[name] = {n: zf.read(n).decode("utf-8", "replace") for n in zf.namelist()}
out["counts"] = payload_cache.COUNTS.__dict__
print(json.dumps(out))
'''


def build_run(tmp_path, store, *modules, **env_extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([COLLECTIONS, os.environ.get("PYTHONPATH", "")]), **env_extra)
    done = subprocess.run([sys.executable, "-c", BUILD, env_extra.get("ANSIBLE_COLLECTIONS_PATH", COLLECTIONS),
                           store, *modules], env=env, capture_output=True, text=True, timeout=120, check=False, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a10_payloads_are_kept_across_runs(tmp_path):
    """A second run takes the payloads from the store, not from recursive_finder, and they are the same payloads."""
    store = str(tmp_path / "store")
    first = build_run(tmp_path, store, "ansible.builtin.command", "ansible.builtin.copy")
    assert first["counts"] == {"hits": 0, "built": 2, "kept": 2, "refused": 0}
    second = build_run(tmp_path, store, "ansible.builtin.command", "ansible.builtin.copy")
    assert second["counts"] == {"hits": 2, "built": 0, "kept": 0, "refused": 0}
    plain = build_run(tmp_path, "", "ansible.builtin.command", "ansible.builtin.copy")  # the cache off: core alone
    assert plain["counts"] == {"hits": 0, "built": 0, "kept": 0, "refused": 0}
    for module in ("ansible.builtin.command", "ansible.builtin.copy"):
        assert second[module] == first[module] == plain[module]
        assert "ansible/module_utils/basic.py" in second[module]
    (entry,) = os.listdir(store)
    assert entry == "core-%s-%d" % (CORE_VERSION, 1)  # per core version: an upgrade of core starts afresh
    assert oct(os.stat(os.path.join(store, entry)).st_mode & 0o777) == "0o700"


def _collection(root, helper="VALUE = 'one'\n"):
    base = root / "ansible_collections" / "acme" / "demo"
    (base / "plugins" / "modules").mkdir(parents=True, exist_ok=True)
    (base / "plugins" / "module_utils").mkdir(parents=True, exist_ok=True)
    (base / "galaxy.yml").write_text("namespace: acme\nname: demo\nversion: 1.0.0\n")
    (base / "plugins" / "modules" / "echo.py").write_text(
        "from ansible.module_utils.basic import AnsibleModule\n"
        "from ansible_collections.acme.demo.plugins.module_utils.helper import VALUE\n"
        "from ansible.module_utils.acme_util import WORD\n"
        "AnsibleModule(argument_spec={}).exit_json(value=VALUE, word=WORD)\n")
    (base / "plugins" / "module_utils" / "helper.py").write_text(helper)
    return base


def test_a10_a_changed_or_shadowed_module_util_is_built_afresh(tmp_path):
    """A stale payload after an upgrade of a module_util (or a new file that the import would now find first)
    is a failure: the store is checked against the files at every use."""
    store = str(tmp_path / "store")
    first_mu, second_mu, colls, early_colls = (tmp_path / "mu1", tmp_path / "mu2", tmp_path / "colls", tmp_path / "early")
    first_mu.mkdir(), second_mu.mkdir(), early_colls.mkdir()
    (second_mu / "acme_util.py").write_text("WORD = 'late'\n")
    base = _collection(colls)
    env = {"ANSIBLE_MODULE_UTILS": "%s:%s" % (first_mu, second_mu),
           "ANSIBLE_COLLECTIONS_PATH": "%s:%s:%s" % (early_colls, colls, COLLECTIONS)}
    helper, util = "ansible_collections/acme/demo/plugins/module_utils/helper.py", "ansible/module_utils/acme_util.py"

    run = build_run(tmp_path, store, "acme.demo.echo", **env)
    assert run["counts"]["kept"] == 1 and run["acme.demo.echo"][helper] == "VALUE = 'one'\n"
    assert build_run(tmp_path, store, "acme.demo.echo", **env)["counts"]["hits"] == 1

    (base / "plugins" / "module_utils" / "helper.py").write_text("VALUE = 'two'\n")  # the collection upgraded
    run = build_run(tmp_path, store, "acme.demo.echo", **env)
    assert run["counts"]["hits"] == 0 and run["acme.demo.echo"][helper] == "VALUE = 'two'\n"
    assert build_run(tmp_path, store, "acme.demo.echo", **env)["acme.demo.echo"][helper] == "VALUE = 'two'\n"

    (first_mu / "acme_util.py").write_text("WORD = 'early'\n")  # found first by the import from now on
    run = build_run(tmp_path, store, "acme.demo.echo", **env)
    assert run["counts"]["hits"] == 0 and run["acme.demo.echo"][util] == "WORD = 'early'\n"

    shadow = _collection(early_colls, helper="VALUE = 'shadow'\n")  # the same collection, on an earlier path
    (shadow / "plugins" / "modules" / "echo.py").write_text((base / "plugins" / "modules" / "echo.py").read_text())
    run = build_run(tmp_path, store, "acme.demo.echo", **env)
    assert run["counts"]["hits"] == 0 and run["acme.demo.echo"][helper] == "VALUE = 'shadow'\n"


def test_a10_a_redirected_module_util_is_not_kept(tmp_path):
    """A redirect's shim comes from no file (its text follows the collection's routing): never kept."""
    store, colls = str(tmp_path / "store"), tmp_path / "colls"
    base = _collection(colls)
    (base / "meta").mkdir()
    (base / "meta" / "runtime.yml").write_text(
        "plugin_routing:\n  module_utils:\n    old_helper:\n      redirect: acme.demo.helper\n")
    (base / "plugins" / "modules" / "echo.py").write_text(
        "from ansible.module_utils.basic import AnsibleModule\n"
        "from ansible_collections.acme.demo.plugins.module_utils.old_helper import VALUE\n"
        "AnsibleModule(argument_spec={}).exit_json(value=VALUE)\n")
    env = {"ANSIBLE_COLLECTIONS_PATH": "%s:%s" % (colls, COLLECTIONS)}
    for _attempt in range(2):
        run = build_run(tmp_path, store, "acme.demo.echo", **env)
        assert run["counts"] == {"hits": 0, "built": 1, "kept": 0, "refused": 1}


def test_a10_a_store_others_can_write_is_not_used(tmp_path):
    store = tmp_path / "store"
    build_run(tmp_path, str(store), "ansible.builtin.command")
    (entry,) = os.listdir(str(store))
    os.chmod(str(store / entry), 0o777)
    run = build_run(tmp_path, str(store), "ansible.builtin.command")
    assert run["counts"] == {"hits": 0, "built": 1, "kept": 0, "refused": 1}


@pytest.mark.parametrize("rc,stdout,stderr,verbosity", [
    (1, "", "mkdir: cannot create directory '/x': Not a directory\n", 0),
    (1, "partial\n", "mkdir: Permission denied\n", 4),
    (5, "", "", 0),
    (1, "", "mkdir: No space left on device\n", 0),
])
def test_a11_mkdtemp_failure_in_cores_words(monkeypatch, rc, stdout, stderr, verbosity):
    """The message a failed mkdtemp fails the task with is core's own: ActionBase._make_tmp_path run on this core."""
    from ansible.errors import AnsibleConnectionFailure
    from ansible.plugins.action import ActionBase
    from ansible.utils.display import Display

    shell = shell_loader.get("ansible.builtin.sh")
    shell.set_options(var_options={}, direct={"remote_tmp": "/workspace/.scratch/ansible-tmp"})

    class Conn:
        _shell = shell
        transport = "microvm.sandbox.agent"
        _remote_is_local = False

        def is_pipelining_enabled(self, wrap_async=False):  # asked by 2.21's _make_tmp_path (on by default here)
            return True

    class Action(ActionBase):
        def run(self, tmp=None, task_vars=None):
            return {}

    seen = []
    action = Action.__new__(Action)
    action._connection = Conn()
    monkeypatch.setattr(action, "_is_become_unprivileged", lambda: False, raising=False)
    monkeypatch.setattr(action, "get_shell_option", lambda name, default=None: shell.get_option(name), raising=False)
    monkeypatch.setattr(action, "_low_level_execute_command", lambda cmd, **kw: seen.append(cmd) or
                        {"rc": rc, "stdout": stdout, "stderr": stderr}, raising=False)
    monkeypatch.setattr(Display(), "verbosity", verbosity)
    with pytest.raises(AnsibleConnectionFailure) as e:
        action._make_tmp_path()
    assert core_compat.tmp_op(shell, ["/bin/sh", "-c", seen[0]])["op"] == "mkdtemp"  # the command the connection answers
    # compared as the task shows it: the connection raises the same exception class with this text
    assert e.value.message == AnsibleConnectionFailure(
        core_compat.mkdtemp_failure(seen[0], rc, stdout, stderr, verbosity)).message


def test_a11_mkdtemp_answer_is_what_the_shell_prints(tmp_path):
    shell = shell_loader.get("ansible.builtin.sh")
    name = "ansible-tmp-1.5-77-88"
    script = shell.mkdtemp(basefile=name, system=False, mode=0o700, tmpdir=str(tmp_path / "base"))
    op = core_compat.tmp_op(shell, ["/bin/sh", "-c", script])
    done = subprocess.run(["/bin/sh", "-c", script], capture_output=True, check=True)
    assert core_compat.mkdtemp_stdout(op) == done.stdout


def test_the_runner_stamps_a_run_only_when_asked(recorded, tmp_path):
    """bench/hops_bench.py (issue 45): a RUN asking with "hops" gets the runner's timestamps in its EXIT, in order;
    any other gets {"rc"} alone, as before."""
    run = [e for e in module_runs(recorded) if b"ansible.modules.command" in e["stdin"]][0]
    (_interp, env), _why = core_compat.module_command(run["argv"], run["stdin"])
    runner = LocalRunner(tmp_path)
    try:
        assert runner.run(1, env, run["stdin"])[0] == 0
        assert runner.last_exit == {"rc": 0}
        assert runner.run(2, env, run["stdin"], hops=True)[0] == 0
        stamps = runner.last_exit["hops"]
        assert set(stamps) == {"recv", "forked", "exit"}
        assert stamps["recv"] <= stamps["forked"] <= stamps["exit"]
        assert all(isinstance(v, int) and not isinstance(v, bool) for v in stamps.values())
        assert runner.run(3, env, run["stdin"])[0] == 0 and runner.last_exit == {"rc": 0}
    finally:
        runner.close()


WARM_THEN_FORK = r'''
import json, os, sys
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import core_compat
from ansible.module_utils.common.json import Direction, get_module_decoder, get_module_encoder
warmed = core_compat.warm_worker_caches()
try:
    from ansible._internal._task import UnifiedTaskResult
    mapping = UnifiedTaskResult.get_result_key_to_resolved_field_mapping
except ImportError:
    mapping = None
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # a task's worker: what it does for a module task's result finds everything worked out already
    before, misses = set(sys.modules), mapping.cache_info().misses if mapping else 0
    for profile in core_compat.MODULE_PROFILES:
        get_module_encoder(profile, Direction.CONTROLLER_TO_MODULE)
        get_module_decoder(profile, Direction.MODULE_TO_CONTROLLER)
    if mapping:
        mapping(source_is_module=True)
    os.write(w, json.dumps({"imported": sorted(set(sys.modules) - before),
                            "new_misses": (mapping.cache_info().misses - misses) if mapping else 0}).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
print(json.dumps({"warmed": warmed, "has_mapping": mapping is not None, "child": json.loads(os.read(r, 65536))}))
'''


def test_a12_core_caches_warmed_before_the_fork_are_inherited():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([COLLECTIONS, os.environ.get("PYTHONPATH", "")]))
    out = json.loads(subprocess.run([sys.executable, "-c", WARM_THEN_FORK], env=env, capture_output=True, text=True,
                                    timeout=120, check=True).stdout.splitlines()[-1])
    assert "module JSON profiles" in out["warmed"]
    assert ("task result fields" in out["warmed"]) == out["has_mapping"]
    assert out["child"] == {"imported": [], "new_misses": 0}, out
