"""persistent_workspace, persistent_workspace_info and a session attached through a config, through the real stack.

ansible-playbook -> REST -> local plane -> runc guests: the files a session wrote in its persistent workspace
are in /workspace of the next session started with it.
"""
import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import run_playbook  # noqa: E402


def test_workspace_lifecycle_and_files_across_sessions(plane, tmp_path):
    tag = uuid.uuid4().hex[:8]
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          vars:
            ws: notes-%(tag)s
            exec_url: "%(url)s/v2/agents/sessions/{{ sid }}/sandbox/exec"
          tasks:
            - name: create
              microvm.sandbox.persistent_workspace: {name: "{{ ws }}", size_limit_gib: 1}
              register: made
            - name: create again
              microvm.sandbox.persistent_workspace: {name: "{{ ws }}", size_limit_gib: 1}
            - name: create another in check mode
              microvm.sandbox.persistent_workspace: {name: "other-%(tag)s", size_limit_gib: 1}
              check_mode: true
            - name: a new size limit
              microvm.sandbox.persistent_workspace: {name: "{{ ws }}", size_limit_gib: 2}
              ignore_errors: true
            - name: a session whose YAML create saves a config
              microvm.sandbox.session: {name: "cfg-%(tag)s"}
              register: src
            - name: first session with the workspace
              microvm.sandbox.session:
                name: "first-%(tag)s"
                config_id: "{{ src.session.config_id }}"
                workspace_id: "{{ made.workspace.workspace_id }}"
              register: first
            - name: first session again
              microvm.sandbox.session:
                name: "first-%(tag)s"
                config_id: "{{ src.session.config_id }}"
                workspace_id: "{{ made.workspace.workspace_id }}"
            - name: held
              microvm.sandbox.persistent_workspace_info: {name: "{{ ws }}"}
            - name: delete while held
              microvm.sandbox.persistent_workspace: {name: "{{ ws }}", state: absent}
              ignore_errors: true
            - name: write into the workspace
              ansible.builtin.uri:
                url: "{{ exec_url }}"
                method: POST
                headers: {Authorization: "Bearer {{ lookup('env', 'DO_AGENTS_API_TOKEN') }}"}
                body_format: json
                body: {argv: [sh, -c, "echo kept-%(tag)s > /workspace/notes.txt"]}
              vars:
                sid: "{{ first.session.session_id }}"
              no_log: true
            - name: remove the first session
              microvm.sandbox.session: {name: "first-%(tag)s", state: absent}
            - name: saved
              microvm.sandbox.persistent_workspace_info: {workspace_id: "{{ made.workspace.workspace_id }}"}
            - name: available ones
              microvm.sandbox.persistent_workspace_info: {state: AVAILABLE}
            - name: second session with the workspace
              microvm.sandbox.session:
                name: "second-%(tag)s"
                config_id: "{{ src.session.config_id }}"
                workspace_id: "{{ made.workspace.workspace_id }}"
              register: second
            - name: read the workspace
              ansible.builtin.uri:
                url: "{{ exec_url }}"
                method: POST
                headers: {Authorization: "Bearer {{ lookup('env', 'DO_AGENTS_API_TOKEN') }}"}
                body_format: json
                body: {argv: [cat, /workspace/notes.txt]}
              vars:
                sid: "{{ second.session.session_id }}"
              register: read
            - name: clean up the sessions
              microvm.sandbox.session: {name: "{{ item }}", state: absent}
              loop: ["second-%(tag)s", "cfg-%(tag)s"]
            - name: delete
              microvm.sandbox.persistent_workspace: {name: "{{ ws }}", state: absent}
            - name: delete again
              microvm.sandbox.persistent_workspace: {name: "{{ ws }}", state: absent}
    """ % {"tag": tag, "url": plane.url}, args=["--diff"])
    assert run.rc == 0, run
    made = run.result("create")
    assert made["changed"] and made["workspace"]["state"] == "AVAILABLE" and made["workspace"]["size_limit_gib"] == 1
    assert not run.changed("create again")
    assert run.changed("create another in check mode")
    assert run.failed("a new size limit") and "fixed" in run.result("a new size limit")["msg"]
    wid = made["workspace"]["workspace_id"]
    first = run.result("first session with the workspace")["session"]
    assert first["workspace_id"] == wid
    assert not run.changed("first session again")
    held = run.result("held")["workspaces"]
    assert [(w["state"], w["attached_session_id"]) for w in held] == [("ATTACHED", first["session_id"])]
    refused = run.result("delete while held")
    assert run.failed("delete while held") and "remove the session" in refused["msg"]
    saved = run.result("saved")["workspaces"][0]
    assert saved["state"] == "AVAILABLE" and saved["last_saved_at"] and saved["bytes_used"] > 0
    assert wid in [w["workspace_id"] for w in run.result("available ones")["workspaces"]]
    assert "other-%s" % tag not in [w["name"] for w in run.result("available ones")["workspaces"]]  # check mode
    assert run.result("read the workspace")["json"]["stdout"].strip() == "kept-%s" % tag
    assert run.changed("delete") and not run.changed("delete again")
    assert plane.client().list_workspaces() == [] or wid not in [w["workspace_id"] for w in plane.client().list_workspaces()]


def test_environment_config_lifecycle_and_a_session_from_it(plane, tmp_path):
    tag = uuid.uuid4().hex[:8]
    secret = "s3cret-%s" % uuid.uuid4().hex
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          vars:
            cfg: reviewer-%(tag)s
          tasks:
            - name: save
              microvm.sandbox.environment_config:
                name: "{{ cfg }}"
                spec: {name: "{{ cfg }}", idle_timeout: 5m, keep_warm: false}
                secrets: {REVIEW_TOKEN: "%(secret)s"}
                insights: {logs: true}
              register: saved
            - name: save again
              microvm.sandbox.environment_config:
                name: "{{ cfg }}"
                spec: {name: "{{ cfg }}", idle_timeout: 5m}
            - name: save another in check mode
              microvm.sandbox.environment_config: {name: "other-%(tag)s", spec: {name: x}}
              check_mode: true
            - name: find
              microvm.sandbox.environment_config_info: {search: "REVIEWER-%(tag)s"}
            - name: find the one in check mode
              microvm.sandbox.environment_config_info: {name: "other-%(tag)s"}
            - name: a session from it
              microvm.sandbox.session: {name: "from-cfg-%(tag)s", config_id: "{{ saved.config.id }}"}
              register: from_cfg
            - name: a spec option with a config
              microvm.sandbox.session: {name: "bad-%(tag)s", config_id: "{{ saved.config.id }}", size: x}
              ignore_errors: true
            - name: delete while a session from it is active
              microvm.sandbox.environment_config: {name: "{{ cfg }}", state: absent}
              ignore_errors: true
            - name: remove the session
              microvm.sandbox.session: {name: "from-cfg-%(tag)s", state: absent}
            - name: recreate
              microvm.sandbox.environment_config:
                name: "{{ cfg }}"
                spec: {name: "{{ cfg }}"}
                recreate: true
            - name: delete
              microvm.sandbox.environment_config: {name: "{{ cfg }}", state: absent}
            - name: delete again
              microvm.sandbox.environment_config: {name: "{{ cfg }}", state: absent}
    """ % {"tag": tag, "secret": secret}, args=["--diff", "-vvv"])
    assert run.rc == 0, run
    saved = run.result("save")
    assert saved["changed"] and saved["config"]["name"] == "reviewer-%s" % tag
    assert not run.changed("save again")
    assert run.changed("save another in check mode") and run.result("find the one in check mode")["configs"] == []
    assert [c["id"] for c in run.result("find")["configs"]] == [saved["config"]["id"]]
    assert [c["name"] for c in saved["config"]["credentials"]] == ["REVIEW_TOKEN"]
    session = run.result("a session from it")["session"]
    assert session["config_id"] == saved["config"]["id"] and session["idle_timeout_seconds"] == 300
    assert run.failed("a spec option with a config") and "mutually exclusive" in run.result("a spec option with a config")["msg"]
    assert run.failed("delete while a session from it is active")
    assert "active session" in run.result("delete while a session from it is active")["msg"]
    recreated = run.result("recreate")
    assert recreated["changed"] and recreated["config"]["id"] != saved["config"]["id"]
    assert run.changed("delete") and not run.changed("delete again")
    assert secret not in run.stdout and secret not in run.stderr


def test_session_keep_warm_is_sent_reported_and_compared(plane, tmp_path):
    tag = uuid.uuid4().hex[:8]
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: warm
              microvm.sandbox.session: {name: "warm-%(tag)s", keep_warm: true}
            - name: warm again
              microvm.sandbox.session: {name: "warm-%(tag)s", keep_warm: true}
            - name: not warm
              microvm.sandbox.session: {name: "warm-%(tag)s", keep_warm: false}
              ignore_errors: true
            - name: a workspace without a config
              microvm.sandbox.session: {name: "ws-%(tag)s", workspace_id: "w"}
              ignore_errors: true
            - name: the api group reaches the new modules
              microvm.sandbox.persistent_workspace_info: {}
              module_defaults:
                group/microvm.sandbox.api: {api_url: "http://127.0.0.1:1", request_timeout: 2}
              ignore_errors: true
            - name: clean up
              microvm.sandbox.session: {name: "warm-%(tag)s", state: absent}
    """ % {"tag": tag})
    assert run.rc == 0, run
    assert run.result("warm")["session"]["keep_warm"] is True
    assert not run.changed("warm again")
    assert run.failed("not warm") and "keep_warm: is True, wanted False" in run.result("not warm")["msg"]
    assert run.failed("a workspace without a config") and "config_id" in run.result("a workspace without a config")["msg"]
    grouped = run.result("the api group reaches the new modules")
    assert grouped["failed"] and "127.0.0.1:1" in grouped["msg"]
