"""The checkpoint and template modules through the real stack (ansible-playbook -> REST -> local plane)."""
import os
import shutil
import subprocess
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import run_playbook  # noqa: E402


def test_checkpoint_create_rollback_delete(plane, sandbox, tmp_path):
    sid = sandbox["session_id"]
    client = plane.client()
    client.request("POST", "/sessions/%s/sandbox/exec" % sid,
                   body={"argv": ["sh", "-c", "echo before > /workspace/marker"]})
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          vars:
            s: %(name)s
          tasks:
            - name: checkpoint
              microvm.sandbox.checkpoint: {session: "{{ s }}", label: clean}
            - name: checkpoint again
              microvm.sandbox.checkpoint: {session: "%(sid)s", label: clean}
            - name: checkpoint in check mode
              microvm.sandbox.checkpoint: {session: "{{ s }}", label: other}
              check_mode: true
            - name: change a file
              ansible.builtin.uri:
                url: "%(url)s/v2/agents/sessions/%(sid)s/sandbox/exec"
                method: POST
                headers: {Authorization: "Bearer {{ lookup('env', 'DO_AGENTS_API_TOKEN') }}"}
                body_format: json
                body: {argv: [sh, -c, "echo after > /workspace/marker"]}
              no_log: true
            - name: roll back
              microvm.sandbox.checkpoint: {session: "{{ s }}", label: clean, state: rolled_back}
            - name: list
              microvm.sandbox.checkpoint_info: {session: "{{ s }}"}
            - name: roll back to an unknown label
              microvm.sandbox.checkpoint: {session: "{{ s }}", label: nope, state: rolled_back}
              ignore_errors: true
            - name: delete
              microvm.sandbox.checkpoint: {session: "{{ s }}", label: clean, state: absent}
            - name: delete again
              microvm.sandbox.checkpoint: {session: "{{ s }}", label: clean, state: absent}
    """ % {"name": sandbox["name"], "sid": sid, "url": plane.url}, args=["--diff"])
    assert run.rc == 0, run
    cp = run.result("checkpoint")
    assert cp["changed"] and cp["checkpoint"]["label"] == "clean" and cp["checkpoint"]["status"] == "READY"
    assert not run.changed("checkpoint again")
    assert run.changed("checkpoint in check mode")
    labels = [c["label"] for c in run.result("list")["checkpoints"]]
    assert labels == ["clean"]  # check mode created nothing
    rolled = run.result("roll back")
    assert rolled["changed"] and rolled["session"]["status"] in ("SESSION_STATUS_READY", "SESSION_STATUS_DETACHED")
    assert rolled["session"]["session_id"] == sid
    assert rolled["diff"]["before"]["sandbox_id"] != rolled["diff"]["after"]["sandbox_id"]
    unknown = run.result("roll back to an unknown label")
    assert unknown["failed"] and "No checkpoint with id or name 'nope'" in unknown["msg"]
    assert run.changed("delete") and not run.changed("delete again")
    out = client.request("POST", "/sessions/%s/sandbox/exec" % sid, body={"argv": ["cat", "/workspace/marker"]})
    assert out["stdout"].strip() == "before"


@pytest.fixture
def oci_layout(tmp_path):
    """An OCI layout with two tiny images (tags v1 and v2), made locally: no registry, no network."""
    if not shutil.which("umoci"):
        pytest.skip("umoci is not installed (make system-deps)")
    layout = tmp_path / "layout"
    subprocess.run(["umoci", "init", "--layout", str(layout)], check=True)
    for tag in ("v1", "v2"):
        subprocess.run(["umoci", "new", "--image", "%s:%s" % (layout, tag)], check=True)
    return layout


def test_template_register_rebuild_fail_delete(plane, tmp_path, oci_layout):
    name = "tpl-%s" % uuid.uuid4().hex[:8]
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          vars:
            t: %(name)s
            src: "oci:%(layout)s"
          tasks:
            - name: register in check mode
              microvm.sandbox.template: {name: "{{ t }}", source_oci_ref: "{{ src }}:v1", base_template: sandbox}
              check_mode: true
            - name: register without a base
              microvm.sandbox.template: {name: "{{ t }}", source_oci_ref: "{{ src }}:v1"}
              ignore_errors: true
            - name: register
              microvm.sandbox.template: {name: "{{ t }}", source_oci_ref: "{{ src }}:v1", base_template: sandbox}
            - name: register again
              microvm.sandbox.template: {name: "{{ t }}", source_oci_ref: "{{ src }}:v1", base_template: sandbox}
            - name: new base
              microvm.sandbox.template: {name: "{{ t }}", source_oci_ref: "{{ src }}:v2", base_template: codex-base}
            - name: new base again
              microvm.sandbox.template: {name: "{{ t }}", source_oci_ref: "{{ src }}:v2", base_template: codex-base}
            - name: force
              microvm.sandbox.template: {name: "{{ t }}", force_rebuild: true}
            - name: info
              microvm.sandbox.template_info: {name: "{{ t }}", include_builds: true}
            - name: missing image
              microvm.sandbox.template: {name: "{{ t }}-bad", source_oci_ref: "{{ src }}:nope", base_template: sandbox}
              ignore_errors: true
            - name: delete
              microvm.sandbox.template: {name: "{{ item }}", state: absent}
              loop: ["{{ t }}", "{{ t }}-bad"]
            - name: delete again
              microvm.sandbox.template: {name: "{{ t }}", state: absent}
    """ % {"name": name, "layout": oci_layout}, args=["--diff"])
    assert run.rc == 0, run
    assert run.changed("register in check mode")
    assert "base_template is required" in run.result("register without a base")["msg"]
    registered = run.result("register")
    assert registered["changed"] and registered["template"]["status"] == "TEMPLATE_STATUS_READY"
    assert registered["build"]["status"] == "SUCCEEDED"
    assert registered["template"]["spec"] == {"base_template": "sandbox"}
    # Run twice with nothing changed: no rebuild (the module compares documented fields only).
    assert not run.changed("register again")
    rebuilt = run.result("new base")
    assert rebuilt["changed"] and rebuilt["template"]["spec"]["base_template"] == "codex-base"
    assert rebuilt["diff"]["before"]["spec"]["base_template"] == "sandbox"
    assert not run.changed("new base again")
    assert run.changed("force")
    builds = run.result("info")["templates"][0]["builds"]
    assert len(builds) == 3 and all(b["status"] == "SUCCEEDED" for b in builds)
    bad = run.result("missing image")
    assert bad["failed"] and "failed" in bad["msg"] and "nope" in bad["msg"], bad["msg"]
    assert run.changed("delete")
    assert not run.changed("delete again")
    assert plane.client().find_template(name) is None
