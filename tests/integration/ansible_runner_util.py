"""Run real ansible-playbook / ansible-inventory against a control plane, and read every task's result.

Results are recorded by a small callback plugin (one JSON line per task and
host), so tests assert on `changed`, `msg` and returned objects instead of
parsing the screen; the screen output is still returned for --diff checks.
"""
import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, ".venv", "bin")
COLLECTIONS = os.path.join(ROOT, ".local", "collections")

RECORDER = textwrap.dedent('''
    from __future__ import annotations

    import json
    import os

    from ansible.module_utils.common.json import _AnsibleJSONEncoder
    from ansible.plugins.callback import CallbackBase


    class CallbackModule(CallbackBase):
        CALLBACK_VERSION = 2.0
        CALLBACK_TYPE = "aggregate"
        CALLBACK_NAME = "microvm_recorder"
        CALLBACK_NEEDS_ENABLED = True

        def _record(self, result, status):
            line = {"task": result.task_name, "host": result._host.get_name(), "status": status,
                    "result": result._result}
            with open(os.environ["MICROVM_RECORD"], "a") as f:
                f.write(json.dumps(line, cls=_AnsibleJSONEncoder) + "\\n")

        def v2_runner_on_ok(self, result):
            self._record(result, "ok")

        def v2_runner_on_failed(self, result, ignore_errors=False):
            self._record(result, "failed")

        def v2_runner_on_skipped(self, result):
            self._record(result, "skipped")

        def v2_runner_on_unreachable(self, result):
            self._record(result, "unreachable")
''')


class PlaybookRun(object):
    def __init__(self, proc, records):
        self.rc = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.records = records

    def result(self, task):
        """The result of the task with this name (the last one when it ran more than once)."""
        found = [r for r in self.records if r["task"] == task]
        assert found, "task %r did not run; ran: %s\n%s\n%s" % (
            task, [r["task"] for r in self.records], self.stdout[-3000:], self.stderr[-3000:])
        record = found[-1]
        result = dict(record["result"])
        # ansible-core 2.19 keeps "failed" out of the result handed to callbacks.
        result.setdefault("failed", record["status"] == "failed")
        return result

    def changed(self, task):
        return bool(self.result(task).get("changed"))

    def failed(self, task):
        return bool(self.result(task).get("failed"))

    def __repr__(self):
        return "PlaybookRun(rc=%s)\n--- stdout ---\n%s\n--- stderr ---\n%s" % (self.rc, self.stdout[-4000:],
                                                                               self.stderr[-4000:])


def ansible_env(plane=None, tmp_path=None, extra=None):
    env = dict(os.environ)
    env.pop("DO_AGENTS_API_URL", None)
    env.pop("DO_AGENTS_API_TOKEN", None)
    env.update({
        "ANSIBLE_COLLECTIONS_PATH": COLLECTIONS,
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_LOCALHOST_WARNING": "False",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "False",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        "PATH": BIN + os.pathsep + env.get("PATH", ""),
    })
    if tmp_path is not None:
        env["ANSIBLE_LOCAL_TEMP"] = str(tmp_path / "ansible-local")
        env["ANSIBLE_HOME"] = str(tmp_path / "ansible-home")
    if plane is not None:
        env.update(plane.env)
    env.update(extra or {})
    return env


def run_playbook(plane, tmp_path, playbook, args=(), env=None, with_plane_env=True, timeout=300,
                 inventory="localhost,"):
    """Write `playbook` (YAML text) and run it (on localhost by default); returns a PlaybookRun."""
    play = tmp_path / "play.yml"
    play.write_text(textwrap.dedent(playbook))
    callbacks = tmp_path / "callbacks"
    callbacks.mkdir(exist_ok=True)
    (callbacks / "microvm_recorder.py").write_text(RECORDER)
    record = tmp_path / "records.jsonl"
    if record.exists():
        record.unlink()
    extra = {"ANSIBLE_CALLBACK_PLUGINS": str(callbacks), "ANSIBLE_CALLBACKS_ENABLED": "microvm_recorder",
             "MICROVM_RECORD": str(record)}
    extra.update(env or {})
    proc = subprocess.run([os.path.join(BIN, "ansible-playbook"), "-i", inventory, "-c", "local", str(play)]
                          + list(args), env=ansible_env(plane if with_plane_env else None, tmp_path, extra),
                          capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path), check=False)
    records = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return PlaybookRun(proc, records)


def run_inventory(plane, tmp_path, config, filename="test.microvm_sessions.yml", args=("--list",), env=None,
                  timeout=120):
    """Write an inventory config and run ansible-inventory on it; returns (proc, parsed JSON or None)."""
    path = tmp_path / filename
    path.write_text(textwrap.dedent(config))
    proc = subprocess.run([os.path.join(BIN, "ansible-inventory"), "-i", str(path)] + list(args),
                          env=ansible_env(plane, tmp_path, env), capture_output=True, text=True, timeout=timeout,
                          cwd=str(tmp_path), check=False)
    try:
        data = json.loads(proc.stdout) if proc.returncode == 0 else None
    except ValueError:
        data = None
    return proc, data
