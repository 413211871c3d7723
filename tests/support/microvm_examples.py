"""The collection's printed examples (issue 42), as a reader finds them: the YAML blocks of README.md and of each
role's README, each module's EXAMPLES, and the inventory and connection plugins' EXAMPLES.

Shared by tests/integration/test_examples_run.py (runs them against a local plane) and
tests/unit/test_examples_lint.py (every task that can create a session sets permissions.default).
"""
import ast
import glob
import os
import re

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = sorted(glob.glob(os.path.join(ROOT, "plugins", "modules", "*.py")))
PLUGINS = [os.path.join(ROOT, "plugins", "inventory", "sessions.py"), os.path.join(ROOT, "plugins", "connection", "agent.py")]
READMES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "roles", "*", "README.md")))


def rel(path):
    return os.path.relpath(path, ROOT)


def plugin_examples(path):
    """The EXAMPLES string of a plugin file, read without importing it."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXAMPLES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("%s has no EXAMPLES" % rel(path))


def readme_yaml_blocks(path):
    """The ```yaml blocks of a Markdown file, in order."""
    with open(path) as f:
        return re.findall(r"^```yaml\n(.*?)^```", f.read(), re.S | re.M)


def all_examples():
    """(source, YAML text) for every printed example: one per README block, one per plugin's EXAMPLES."""
    found = []
    for path in READMES:
        blocks = readme_yaml_blocks(path)
        for i, block in enumerate(blocks):
            found.append(("%s#%d" % (rel(path), i) if len(blocks) > 1 else rel(path), block))
    for path in MODULES + PLUGINS:
        found.append((rel(path), plugin_examples(path)))
    return found


def tasks_of(doc):
    """Every task of a parsed example (a task list, or plays), blocks walked into."""
    items = doc if isinstance(doc, list) else [doc]
    out = []
    for item in items:
        if not isinstance(item, dict):
            continue
        if "hosts" in item:  # a play
            for section in ("pre_tasks", "tasks", "post_tasks", "handlers"):
                out.extend(tasks_of(item.get(section) or []))
            continue
        out.append(item)
        for section in ("block", "rescue", "always"):
            if section in item:
                out.extend(tasks_of(item[section]))
    return out


SESSION_MODULES = ("microvm.sandbox.session", "microvm.sandbox.environment_config")


def session_tasks_without_allow(text):
    """Names of the tasks in an example that can create a session yet leave permissions.default unset (the platform
    then resolves it to `ask`, and every command waits for a person's approval):

    - microvm.sandbox.session with any state but absent, unless it starts from a saved config (config_id: the
      policy is the config's);
    - microvm.sandbox.environment_config with any state but absent: its spec must set permissions.default, since
      every session started from it gets that policy.
    """
    bad = []
    for doc in yaml.safe_load_all(text):
        for task in tasks_of(doc):
            module = next((m for m in SESSION_MODULES if m in task), None)
            if module is None:
                continue
            args = task[module] or {}
            if args.get("state", "present") == "absent":
                continue
            if module == "microvm.sandbox.session":
                if args.get("config_id"):
                    continue
                policy = args.get("permissions") or {}
            else:
                policy = (args.get("spec") or {}).get("permissions") or {}
            if not policy.get("default"):
                bad.append(task.get("name", "(unnamed %s task)" % module))
    return bad
