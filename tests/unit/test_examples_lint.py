"""Every printed example that can create a session gives it `permissions: {default: allow}` (issue 42).

The platform resolves an omitted permissions.default to `ask`: every command in such a sandbox waits for a person's
approval, and an Ansible run, with nobody to approve, hangs and then fails. The examples are what readers copy, so
none may leave it out (the rule: microvm_examples.session_tasks_without_allow)."""
import pytest

from microvm_examples import all_examples, session_tasks_without_allow

EXAMPLES = all_examples()


@pytest.mark.parametrize("source,text", EXAMPLES, ids=[source for source, _text in EXAMPLES])
def test_every_session_an_example_creates_allows_its_commands(source, text):
    assert session_tasks_without_allow(text) == [], (
        "%s: these tasks can create a session without permissions: {default: allow} "
        "(the platform's default is ask)" % source)


def test_the_rule_sees_what_it_must():
    """The check itself: a session task (also inside a block, or a play) or an environment config without the
    policy is found; one with it, a deletion, and a session from a saved config are not."""
    text = """
- name: plain
  microvm.sandbox.session: {name: a}
- name: in a block
  block:
    - name: nested
      microvm.sandbox.session: {name: b, permissions: {rules: []}}
- name: allowed
  microvm.sandbox.session: {name: c, permissions: {default: allow}}
- name: gone
  microvm.sandbox.session: {name: d, state: absent}
- name: from config
  microvm.sandbox.session: {name: e, config_id: x}
- name: config without
  microvm.sandbox.environment_config: {name: f, spec: {name: f}}
- name: config with
  microvm.sandbox.environment_config: {name: g, spec: {name: g, permissions: {default: allow}}}
---
- name: a play
  hosts: localhost
  tasks:
    - name: in a play
      microvm.sandbox.session: {name: h, state: paused}
"""
    assert session_tasks_without_allow(text) == ["plain", "nested", "config without", "in a play"]


def test_the_examples_are_all_found():
    """Nothing is silently skipped: the README, every role README and every plugin with EXAMPLES."""
    sources = [source for source, _text in EXAMPLES]
    assert "README.md" in sources
    assert "plugins/modules/session.py" in sources and "plugins/modules/checkpoint.py" in sources
    assert "plugins/inventory/sessions.py" in sources and "plugins/connection/agent.py" in sources
    assert sum(s.startswith("roles/") for s in sources) >= 5
