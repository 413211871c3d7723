# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Everything the agent connection assumes about ansible-core's internals, in one place.

ansible-core has no public API for what makes this connection fast, so the fast paths lean on how core
builds commands and payloads. A core release that changes one of these must not silently send every task
down the slow path (as 2.21 did when it stopped appending ` && sleep 0`): each assumption below names the
test that checks it against the installed core. tests/unit/plugins/plugin_utils/test_core_compat.py runs
on every supported core: 2.19 (`make unit`), 2.20 (`make test-core220`) and 2.21 (`make test-newest`).

A1 The pipelined module command is `<executable> -c '<NAME=value>... <interpreter>'`, quoted with
   shlex.quote, on 2.19 and 2.20 followed by ` && sleep 0` (core's SSH race mitigation, dropped in 2.21),
   with the AnsiballZ payload on stdin.                      -> test_a1_pipelined_module_command_is_recognised
A2 An AnsiballZ payload carries the marker line and its zip as one `zip_data='<base64>',` line, and the
   zip holds ansible.module_utils.basic and the AnsiballZ loader, which the warm runner preloads.
                                                             -> test_a2_ansiballz_payload_splits_and_preloads
A3 ansible's packages are regular packages with a list `__path__`: the warm runner edits the `__path__` of
   the packages it preloaded so that a fork imports the module (and module_utils it did not preload) from
   the payload's own zip. Checked by running this core's real payloads in the runner.
                                                             -> test_a3_runner_runs_real_payloads_warm
A4 Core skips parsing a plugin's DOCUMENTATION when its options are already defined
   (ConfigManager.has_configuration_definition / initialize_plugin_configuration_definitions), which
   _worker/option_defs.py uses to save the parse in every worker.   -> test_a4_plugin_options_can_be_defined_ahead
A5 Core calls `connection._shell.set_options()` after the connection's own options and before it reads
   remote_tmp, with the task's keys (`task_keys`, its `action` among them), builds a module's environment
   string with `shell.env_prefix(**env)` and expands `~` paths with `shell.expand_user()`: the connection
   wraps all three on its shell instance (wrap_shell).           -> test_a5_shell_hooks_are_called_by_core
A6 A task's temporary dir is `<remote_tmp>/ansible-tmp-<time>-<worker pid>-<random>` (TASK_TMP).
                                                             -> test_a6_task_tmp_dir_names
A7 A task's tmp dir commands (the shell's mkdtemp, chmod and remove) are rebuilt byte for byte with the
   task's own shell plugin, so the warm runner can serve them (tmp_op).
                                                             -> test_a7_tmp_dir_commands_are_recognised
A8 Core's collection loader compiles every collection module from source, in every task's worker
   (_AnsibleCollectionPkgLoaderBase.get_code, caching in `_compiled_code`); the connection has the
   compiled code of this collection's own modules kept for the run (code_cache.py, a module of its own).
                                                             -> test_a8_collection_code_compiled_once_per_run
A9 A Python module's payload is core's wrapper code, the same for every task of a core, followed by one
   `if __name__ == "__main__":` / `_ansiballz_main(<the task's arguments>)` block (WRAPPER_CALL): the warm runner
   compiles the code before it once and only the call in each run.
                                                             -> test_a9_wrapper_code_comes_before_the_task_call
A10 Core builds a Python module's payload with `module_common.recursive_finder(name, module_fqn, module_data, zf,
   date_time, extension_manager)`, looked up at call time, only when its per-run cache in the run's local temp dir
   lacks the module; it writes each module_util into `zf` with `writestr`, the text tagged with its file's `Origin`
   (no tag: made by core), and returns a `metadata_versions` dataclass: _worker/payload_cache.py keeps those
   entries across runs and writes them back, checked against their files.
                                             -> test_a10_payloads_are_kept_across_runs and the other test_a10_*
A11 A failed mkdtemp fails the task with ActionBase._make_tmp_path's words (an AnsibleConnectionFailure, so the
   host is UNREACHABLE), which the connection repeats when the mkdtemp it answered ahead is made later and fails
   (mkdtemp_failure).                                        -> test_a11_mkdtemp_failure_in_cores_words
A12 Core works out, once per process and so in every task's worker, the module JSON profiles' encoders and decoders
   (module_utils.common.json, imported on first use) and, on 2.21, the task result's field mapping
   (UnifiedTaskResult.get_result_key_to_resolved_field_mapping, a functools cache over get_type_hints): worked out
   in ansible-playbook's own process before the forks, every worker inherits them (warm_worker_caches).
                                                  -> test_a12_core_caches_warmed_before_the_fork_are_inherited

Only the standard library and ansible-core (imported lazily) are used: this runs in every task's worker.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from typing import Any, Callable

# -- A1: the pipelined module command -----------------------------------------------------------------
RACE_SUFFIX = " && sleep 0"  # appended by 2.19 and 2.20 (ansible/ansible#13876), no longer by 2.21
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PYTHON_NAME = re.compile(r"^python[0-9.]*$")


def command_argv(executable: str, cmd: str) -> list[str]:
    """The Exec argv of a command string (the agent has no implicit shell).

    ansible-core usually hands over `<executable> -c '<script>'` already; running that directly
    saves a shell per command. Anything else runs under `<executable> -c`.
    """
    if cmd.startswith(executable + " -c "):
        try:
            parts = shlex.split(cmd)
        except ValueError:
            parts = None
        if parts and len(parts) == 3 and parts[:2] == [executable, "-c"]:
            return parts
    return [executable, "-c", cmd]


def core_script(argv: list[str]) -> str | None:
    """The script core built (its race suffix removed) of an argv `<sh> -c <script>`, else None."""
    if len(argv) != 3 or argv[1] != "-c":
        return None
    script = argv[2]
    return script[:-len(RACE_SUFFIX)] if script.endswith(RACE_SUFFIX) else script


def module_command(argv: list[str], in_data: bytes) -> tuple[tuple[str, dict[str, str]] | None, str | None]:
    """((interpreter, env), None) when argv is exactly the pipelined module command core builds, else (None, why).

    The script is rebuilt with the same quoting and must match byte for byte: anything else (become,
    a wrapper, shell syntax) is not a plain module run.
    """
    if "async_wrapper" in argv[-1] or "ANSIBLE_ASYNC_DIR" in argv[-1]:
        return None, "async task"
    if not in_data:
        return None, "no pipelined payload"
    script = core_script(argv)
    if script is None:
        return None, "not a shell command"
    if ANSIBALLZ_MARKER not in in_data:
        return None, "not a Python module payload"
    try:
        words = shlex.split(script)
    except ValueError:
        return None, "command shape not recognised"
    if not words:
        return None, "command shape not recognised"
    interpreter = words[-1]
    env = {}
    for word in words[:-1]:
        name, sep, value = word.partition("=")
        if not sep or not ENV_NAME.match(name):
            return None, "command shape not recognised (become or a wrapper?)"
        env[name] = value
    if not interpreter.startswith("/") or not PYTHON_NAME.match(posixpath.basename(interpreter)):
        return None, "interpreter %s is not a plain python path" % interpreter
    rebuilt = " ".join(["%s=%s" % (k, shlex.quote(v)) for k, v in env.items()] + [shlex.quote(interpreter)])
    if rebuilt != script:
        return None, "command shape not recognised"
    return (interpreter, env), None


# -- A2: the AnsiballZ payload ---------------------------------------------------------------------
ANSIBALLZ_MARKER = b"_ANSIBALLZ_WRAPPER = True"
ZIP_DATA = r"^zip_data='([A-Za-z0-9+/=]*)',$"   # bytes regex, multiline: the one line holding the zip
# A9: where the task's own part of a payload begins (module_common's wrapper template, 2.19-2.21)
WRAPPER_CALL = '\nif __name__ == "__main__":\n    _ansiballz_main(\n'
PRELOAD = ("ansible.module_utils.basic", "ansible.module_utils._internal._ansiballz._loader")
# Names whose modules a clean run may have the runner preload: module_utils only, never a module.
MODULE_UTILS = r"^(ansible\.module_utils|ansible_collections\.[^.]+\.[^.]+\.plugins\.module_utils)\."


def core_version() -> str:
    """This controller's ansible-core version: the mux keeps one warm runner per (interpreter, core), since
    payloads of two cores carry different module_utils and would never run warm in the other's runner."""
    from ansible.release import __version__

    return __version__


def runner_config() -> dict[str, Any]:
    """What the warm runner (which runs in the guest and imports nothing of ours) must know about core."""
    return {"marker": ANSIBALLZ_MARKER.decode("ascii"), "zip_data": ZIP_DATA, "preload": list(PRELOAD),
            "module_utils": MODULE_UTILS, "task_tmp": TASK_TMP.pattern, "wrapper_call": WRAPPER_CALL}


# -- A4: plugin option definitions -----------------------------------------------------------------
def plugin_options_defined(plugin_type: str, name: str) -> bool:
    from ansible import constants as C

    return bool(C.config.has_configuration_definition(plugin_type, name))


def define_plugin_options(plugin_type: str, name: str, options: dict) -> None:
    """Define a plugin's options as core would after parsing its DOCUMENTATION (core then skips the parse)."""
    from ansible import constants as C

    C.config.initialize_plugin_configuration_definitions(plugin_type, name, options)


# -- A5: the shell plugin's hooks ------------------------------------------------------------------
def wrap_shell(shell: Any, after_set_options: Callable[[dict], None], last_env: Callable[[], dict[str, str]],
               home_alias: Callable[[str], str] | None = None) -> None:
    """Patch one shell plugin instance: after_set_options(task_keys) runs after every set_options() (task_keys:
    what core tells the shell of the task, its `action` among them), the variables last_env() returns (it may
    raise KeyError to add none) come last in every env_prefix(), and home_alias() rewrites a `~` path before the
    shell's expand_user() builds its `echo ~...` command."""
    shell_set_options = shell.set_options
    shell_env_prefix = shell.env_prefix
    shell_expand_user = shell.expand_user

    def set_options(*args: Any, **kwargs: Any) -> None:
        shell_set_options(*args, **kwargs)
        after_set_options(kwargs.get("task_keys") or {})

    def env_prefix(**kwargs: Any) -> str:
        try:
            extra = last_env()
        except KeyError:
            extra = {}
        for name, value in extra.items():
            kwargs.pop(name, None)
            kwargs[name] = value
        return shell_env_prefix(**kwargs)

    def expand_user(user_home_path: str, username: str = "") -> str:
        return shell_expand_user(home_alias(user_home_path) if home_alias else user_home_path, username=username)

    shell.set_options = set_options
    shell.env_prefix = env_prefix
    shell.expand_user = expand_user


# -- A6: task tmp dir names ------------------------------------------------------------------------
TASK_TMP = re.compile(r"^ansible-tmp-[0-9.]+-(\d+)-\d+$")  # time, worker pid, random
TASK_TMP_PREFIX = "ansible-tmp-"


# -- A7: the task tmp dir's commands, served by the warm runner --------------------------------------
# Paths the runner serves: plain absolute paths, no shell syntax, no '..'; anything else runs in a shell.
PLAIN_PATH = re.compile(r"^/[A-Za-z0-9._+@%,/-]*$")
MKDTEMP = re.compile(r'mkdir "` echo (?P<tmp>\S+) `" && echo (?P<name>ansible-tmp-[0-9.]+-\d+-\d+)=')
UMASK = re.compile(r"umask (?P<umask>[0-7]{1,4}) ")
CHMOD_MODE = re.compile(r"^u\+[rwx]+$")


def _plain(path: str) -> bool:
    return bool(PLAIN_PATH.match(path)) and ".." not in path.split("/")


def _in_task_tmp(path: str) -> bool:
    """Whether a path lies in (or is) a task tmp dir `.../ansible-tmp-*/`."""
    parts = [p for p in path.split("/") if p]
    return any(TASK_TMP.match(p) for p in parts)


def tmp_op(shell: Any, argv: list[str]) -> dict[str, Any] | None:
    """The warm runner's op for a task tmp dir command of core's, or None (run it in a shell).

    Recognised only when the task's own shell plugin rebuilds the very same script from the parsed
    arguments, so a core that words them differently runs them in a shell, as before.
      mkdtemp: {"op": "mkdtemp", "base": remote tmp, "name": "ansible-tmp-...", "mode": 0o700}
      chmod:   {"op": "chmod", "mode": "u+rwx", "paths": [...]} (paths in a task tmp dir)
      rm:      {"op": "rm", "path": ".../ansible-tmp-.../"}
    """
    script = core_script(argv)
    if not script:
        return None
    try:
        if script.startswith("( umask "):
            return _mkdtemp_op(shell, script)
        if script.startswith("chmod "):
            return _chmod_op(shell, script)
        if script.startswith("rm -f -r "):
            return _rm_op(shell, script)
    except (ValueError, TypeError, AttributeError):
        return None  # not core's, or a shell plugin without these builders
    return None


def _mkdtemp_op(shell: Any, script: str) -> dict[str, Any] | None:
    found = MKDTEMP.search(script)
    umask = UMASK.match(script[2:]) if script.startswith("( ") else None
    if not found or not umask:  # no umask: a mode the runner would have to guess
        return None
    path, name = found.group("tmp"), found.group("name")
    if posixpath.basename(path) != name:
        return None
    base = posixpath.dirname(path)
    mode = 0o777 & ~int(umask.group("umask"), 8)
    if not _plain(base) or shell.mkdtemp(basefile=name, system=False, mode=mode, tmpdir=base) != script:
        return None
    return {"op": "mkdtemp", "base": base, "name": name, "mode": mode}


def mkdtemp_stdout(op: dict[str, Any]) -> bytes:
    """What core's mkdtemp command prints when it made the dir (`echo NAME=PATH`), for an op of _mkdtemp_op."""
    return ("%s=%s\n" % (op["name"], posixpath.join(op["base"], op["name"]))).encode("utf-8")


def _chmod_op(shell: Any, script: str) -> dict[str, Any] | None:
    words = shlex.split(script)
    if len(words) < 3 or not CHMOD_MODE.match(words[1]):
        return None
    paths = words[2:]
    if not all(_plain(p) and _in_task_tmp(p) for p in paths) or shell.chmod(paths, words[1]) != script:
        return None
    return {"op": "chmod", "mode": words[1], "paths": paths}


def _rm_op(shell: Any, script: str) -> dict[str, Any] | None:
    words = shlex.split(script)
    if len(words) < 4:
        return None
    path = words[3]
    if not _plain(path) or not TASK_TMP.match(posixpath.basename(path.rstrip("/"))):
        return None
    if shell.remove(path, recurse=True) != script:
        return None
    return {"op": "rm", "path": path}


# -- A11: core's words for a failed mkdtemp --------------------------------------------------------------
def mkdtemp_failure(command: str, rc: int, stdout: str, stderr: str, verbosity: int) -> str:
    """The message ActionBase._make_tmp_path fails the task with when its mkdtemp command returned rc != 0
    (its ssh-only branch left out: this is not the ssh connection)."""
    if rc == 5:
        output = "Authentication failure."
    elif "No space left on device" in stderr:
        output = stderr
    else:
        output = ("Failed to create temporary directory. "
                  "In some cases, you may have been able to authenticate and did not have permissions on the target directory. "
                  'Consider changing the remote tmp path in ansible.cfg to a path rooted in "/tmp", for more error information use -vvv. '
                  "Failed command was: %s, exited with result %d" % (command, rc))
    if stdout != "":
        output += ", stdout output: %s" % stdout
    if verbosity > 3 and stderr != "":
        output += ", stderr output: %s" % stderr
    return output


# -- A12: what core works out once per process, worked out before the workers fork ---------------------------
MODULE_PROFILES = ("legacy", "modern")  # the module JSON serialization profiles (module_utils/_internal/_json)


def warm_worker_caches() -> list[str]:
    """Have core work out, in ansible-playbook's own process, what each task's worker would otherwise work out afresh
    (core keeps it per process, and the workers are forked from this one): the module JSON profiles' encoders and
    decoders (imported by every module task's worker, 2.19+) and the task result's field mapping (a cached
    get_type_hints over a dataclass, 2.21). Called where the connection is loaded before the forks (_worker/preload.py).
    Returns what was warmed (for the test); anything missing is left to the workers, as before."""
    warmed = []
    try:
        from ansible.module_utils.common.json import Direction, get_module_decoder, get_module_encoder

        for profile in MODULE_PROFILES:
            get_module_encoder(profile, Direction.CONTROLLER_TO_MODULE)
            get_module_decoder(profile, Direction.MODULE_TO_CONTROLLER)
        warmed.append("module JSON profiles")
    except Exception:  # pylint: disable=broad-exception-caught  # a core without them: nothing to warm
        pass
    try:
        from ansible._internal._task import UnifiedTaskResult  # type: ignore[attr-defined,unused-ignore]  # 2.21

        for source_is_module in (True, False):
            UnifiedTaskResult.get_result_key_to_resolved_field_mapping(source_is_module=source_is_module)
        warmed.append("task result fields")
    except Exception:  # pylint: disable=broad-exception-caught  # before 2.21 there is no such mapping
        pass
    return warmed
