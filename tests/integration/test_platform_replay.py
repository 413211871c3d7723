"""Every module and the inventory plugin against a strict stand-in that answers only in the documented shapes.

The replay server (tests/support/platform_replay.py) is built from tests/platform_corpus/: it answers with exactly
the documented keys, mints non-UUID ids as the docs show them, and records anything undocumented the collection
sends. Each test runs real ansible-playbook / ansible-inventory against it and asserts both the task results and
that nothing undocumented was sent.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "support"))

from ansible_runner_util import run_inventory, run_playbook  # noqa: E402
from platform_replay import ReplayServer  # noqa: E402


@pytest.fixture
def replay():
    with ReplayServer() as server:
        yield server
    assert not server.platform.undocumented, "the collection sent what the docs do not show:\n" + "\n".join(
        server.platform.undocumented)


def test_sessions_lifecycle_info_fork_and_sizes(replay, tmp_path):
    run = run_playbook(replay, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: create
              microvm.sandbox.session: {name: rp-one, agent: codex, permissions: {default: allow}}
            - name: rerun
              microvm.sandbox.session: {name: rp-one, agent: codex, recreate: true}
            - name: pause
              microvm.sandbox.session: {name: rp-one, agent: codex, state: paused}
            - name: resume
              microvm.sandbox.session: {name: rp-one, agent: codex, state: running}
            - name: info
              microvm.sandbox.session_info: {name: rp-one}
            - name: search
              microvm.sandbox.session_info: {search: rp-}
            - name: checkpoint
              microvm.sandbox.checkpoint: {session: rp-one, label: before}
            - name: checkpoints
              microvm.sandbox.checkpoint_info: {session: rp-one}
              register: cps
            - name: fork by id
              microvm.sandbox.session_fork:
                source: rp-one
                checkpoint: "{{ cps.checkpoints[0].checkpoint_id }}"
                count: 1
            - name: sizes
              microvm.sandbox.size_info: {}
    """)
    assert run.rc == 0, run
    assert run.changed("create") and not run.changed("rerun"), run.result("rerun")
    # ids are opaque: the session is found by the id the platform minted, whatever its shape
    sid = run.result("create")["session"]["session_id"]
    assert not sid.count("-") == 4
    assert [s["session_id"] for s in run.result("info")["sessions"]] == [sid]
    assert run.result("search")["sessions"]
    assert run.changed("fork by id")
    assert run.result("checkpoints")["checkpoints"][0]["kind"] == "explicit"
    assert run.result("sizes")["sizes"]
    # the newest documented prefix by default
    assert all(path.startswith("/v2/harness-runtime/") for _m, path, _op in replay.platform.calls)


def test_failed_sessions_are_found_by_name_and_in_the_gone_group(replay, tmp_path):
    run = run_playbook(replay, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: create
              microvm.sandbox.session: {name: rp-broken}
    """)
    assert run.rc == 0, run
    replay.platform.set_status(run.result("create")["session"]["session_id"], "FAILED")
    run = run_playbook(replay, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: failed
              microvm.sandbox.session_info: {name: rp-broken, statuses: [FAILED]}
            - name: default
              microvm.sandbox.session_info: {name_prefix: rp-}
    """)
    assert run.rc == 0, run
    assert [s["name"] for s in run.result("failed")["sessions"]] == ["rp-broken"]
    assert run.result("default")["sessions"] == []  # hidden by default, as the platform does
    proc, data = run_inventory(replay, tmp_path, """
        plugin: microvm.sandbox.sessions
        statuses: [usable, gone]
        keyed_groups:
          - key: "'gone' if microvm_status in ['FAILED', 'DESTROYED'] else 'live'"
            separator: ""
    """)
    assert proc.returncode == 0, proc.stderr
    assert "rp-broken" in data["gone"]["hosts"], data


def test_templates_do_not_rebuild_an_unchanged_template(replay, tmp_path):
    play = """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: register
              microvm.sandbox.template:
                name: rp-tpl
                source_oci_ref: registry.example.com/team/agent:v1
                base_template: sandbox
            - name: info
              microvm.sandbox.template_info: {name: rp-tpl, include_builds: true}
            - name: all
              microvm.sandbox.template_info: {}
    """
    first = run_playbook(replay, tmp_path, play)
    assert first.rc == 0, first
    second = run_playbook(replay, tmp_path, play)
    assert second.rc == 0, second
    assert first.changed("register") and not second.changed("register"), second.result("register")
    assert len(second.result("info")["templates"][0]["builds"]) == 1
    assert "templates.update" not in replay.platform.operations_called()
    # list items carry no spec; the module returns each template as its GET does
    assert [t["spec"] for t in second.result("all")["templates"]] == [{"base_template": "sandbox"}]


def test_the_older_prefix_is_selectable_and_tokens_come_from_doctl_names(replay, tmp_path):
    env = {"DO_AGENTS_API_URL": replay.url, "DIGITALOCEAN_TOKEN": replay.token, "DO_AGENTS_API_PREFIX": "/v2/agents"}
    run = run_playbook(replay, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: list
              microvm.sandbox.session_info: {}
    """, env=env, with_plane_env=False)
    assert run.rc == 0, run
    assert replay.platform.calls and all(p.startswith("/v2/agents/") for _m, p, _op in replay.platform.calls)


def test_an_error_body_is_reported_with_its_request_id(replay, tmp_path):
    run = run_playbook(replay, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: missing
              microvm.sandbox.checkpoint: {session: rp-none, label: x}
              ignore_errors: true
    """)
    result = run.result("missing")
    assert result["failed"] and "rp-none" in result["msg"], result
