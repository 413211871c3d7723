"""Helpers shared by the roles tests (test_roles*.py).

Playbooks run through run_playbook() of this directory's conftest.py.
"""
import importlib.util
import json
import os
import re
import uuid


def conftest():
    """This directory's conftest.py as a module (its helpers, outside the fixtures)."""
    spec = importlib.util.spec_from_file_location("microvm_integration_runner",
                                                  os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def runner():
    """run_playbook from this directory's conftest.py (module-scoped fixtures cannot use its function-scoped fixture)."""
    return conftest().run_playbook


def unique(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


def inventory(name, session_id):
    return ("[sbx]\n%s ansible_host=%s\n\n[sbx:vars]\nansible_connection=microvm.sandbox.agent\n"
            "ansible_python_interpreter=/usr/bin/python3\n" % (name, session_id))


LOCALHOST = "localhost ansible_connection=local ansible_python_interpreter={{ ansible_playbook_python }}\n"


def markers(output, tag):
    """Values printed by `debug: msg="TAG=<json>"` tasks, in order."""
    found = []
    for m in re.finditer(r'^\s*"msg": "%s=(.*)"\s*$' % re.escape(tag), output, re.M):
        value = json.loads('"%s"' % m.group(1))
        while isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                break
        found.append(value)
    return found
