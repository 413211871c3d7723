"""The session modules through the real stack: ansible-playbook -> module -> REST -> local plane -> guest."""
import json
import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import run_playbook  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError  # noqa: E402


def unique(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:8])


@pytest.fixture
def cleanup(plane):
    """Names of sessions to delete after the test, whatever happened."""
    names = []
    yield names
    client = plane.client()
    for name in names:
        try:
            s = client.find_session(name)
            if s:
                client.delete_session(s["session_id"])
        except ApiError:
            pass


def live(plane, name):
    s = plane.client().find_session(name)
    return s if s and not s["status"].endswith(("DESTROYING", "DESTROYED", "FAILED")) else None


def test_session_lifecycle_is_idempotent(plane, tmp_path, cleanup):
    name = unique("life")
    cleanup.append(name)
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          vars:
            n: %s
          tasks:
            - name: create
              microvm.sandbox.session: {name: "{{ n }}", idle_timeout: 10m, size: mars-2vcpu-4gb}
            - name: create again
              microvm.sandbox.session: {name: "{{ n }}", idle_timeout: 600s, size: mars-2vcpu-4gb}
            - name: pause in check mode
              microvm.sandbox.session: {name: "{{ n }}", state: paused}
              check_mode: true
            - name: info after check mode
              microvm.sandbox.session_info: {session: "{{ n }}"}
            - name: pause
              microvm.sandbox.session: {name: "{{ n }}", state: paused}
            - name: pause again
              microvm.sandbox.session: {name: "{{ n }}", state: paused}
            - name: present keeps it paused
              microvm.sandbox.session: {name: "{{ n }}"}
            - name: resume
              microvm.sandbox.session: {name: "{{ n }}", state: running}
            - name: resume again
              microvm.sandbox.session: {name: "{{ n }}", state: running}
            - name: delete
              microvm.sandbox.session: {name: "{{ n }}", state: absent}
            - name: delete again
              microvm.sandbox.session: {name: "{{ n }}", state: absent}
    """ % name)
    assert run.rc == 0, run
    created = run.result("create")
    assert created["changed"] and created["session"]["status"] == "SESSION_STATUS_READY"
    assert created["session"]["idle_timeout_seconds"] == 600
    assert not run.changed("create again")
    assert run.changed("pause in check mode")
    assert run.result("info after check mode")["sessions"][0]["status"] == "SESSION_STATUS_READY"
    assert run.result("pause")["session"]["status"] == "SESSION_STATUS_PAUSED"
    assert run.result("pause")["session"]["pause_reason"] == "manual"
    assert not run.changed("pause again")
    assert not run.changed("present keeps it paused")
    assert run.changed("resume") and run.result("resume")["session"]["status"] == "SESSION_STATUS_READY"
    assert not run.changed("resume again")
    assert run.changed("delete")
    assert run.result("delete")["session"]["status"] == "SESSION_STATUS_DESTROYED"
    assert not run.changed("delete again")
    assert live(plane, name) is None


def test_check_mode_and_diff_create_nothing(plane, tmp_path):
    name = unique("check")
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: create in check mode
              microvm.sandbox.session: {name: %s, size: mars-2vcpu-4gb}
    """ % name, args=["--check", "--diff"])
    assert run.rc == 0, run
    assert run.changed("create in check mode")
    assert live(plane, name) is None
    # The diff shows the object that would appear.
    assert '+    "name": "%s"' % name in run.stdout, run


def test_diff_shows_before_and_after(plane, tmp_path, cleanup):
    name = unique("diff")
    cleanup.append(name)
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: create
              microvm.sandbox.session: {name: %s}
            - name: pause
              microvm.sandbox.session: {name: %s, state: paused}
    """ % (name, name), args=["--diff"])
    assert run.rc == 0, run
    assert '-    "status": "SESSION_STATUS_READY"' in run.stdout, run
    assert '+    "status": "SESSION_STATUS_PAUSED"' in run.stdout, run
    diff = run.result("pause")["diff"]
    assert diff["before"]["status"] == "SESSION_STATUS_READY" and diff["after"]["status"] == "SESSION_STATUS_PAUSED"


def test_differing_settings_fail_then_recreate(plane, tmp_path, cleanup):
    name = unique("differ")
    cleanup.append(name)
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: create
              microvm.sandbox.session: {name: %(n)s, idle_timeout: 300}
            - name: different timeout
              microvm.sandbox.session: {name: %(n)s, idle_timeout: 900}
              ignore_errors: true
            - name: recreate
              microvm.sandbox.session: {name: %(n)s, idle_timeout: 900, recreate: true}
            - name: recreated is stable
              microvm.sandbox.session: {name: %(n)s, idle_timeout: 900}
    """ % {"n": name})
    assert run.rc == 0, run
    differ = run.result("different timeout")
    assert differ["failed"]
    assert "idle_timeout_seconds: is 300, wanted 900" in differ["msg"] and "recreate: true" in differ["msg"]
    recreated = run.result("recreate")
    assert recreated["changed"]
    assert recreated["session"]["session_id"] != run.result("create")["session"]["session_id"]
    assert not run.changed("recreated is stable")


def test_bad_arguments_and_unknown_names(plane, tmp_path):
    ghost_id = str(uuid.uuid4())
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: bad state
              microvm.sandbox.session: {name: x, state: sideways}
              ignore_errors: true
            - name: bad name
              microvm.sandbox.session: {name: "no spaces allowed"}
              ignore_errors: true
            - name: unknown option
              microvm.sandbox.session: {name: x, colour: blue}
              ignore_errors: true
            - name: unknown id
              microvm.sandbox.session: {name: %(g)s, state: paused}
              ignore_errors: true
            - name: checkpoint of an unknown session
              microvm.sandbox.checkpoint: {session: ghost-session, label: x}
              ignore_errors: true
            - name: info of an unknown session
              microvm.sandbox.session_info: {session: ghost-session}
            - name: server refuses a bad size
              microvm.sandbox.session: {name: bad-size-x, size: "small"}
              ignore_errors: true
            - name: server refuses an unknown adapter
              microvm.sandbox.session: {name: bad-agent-x, agent: "none"}
              ignore_errors: true
    """ % {"g": ghost_id})
    assert run.rc == 0, run
    assert "value of state must be one of" in run.result("bad state")["msg"]
    assert "Cannot create a session named 'no spaces allowed'" in run.result("bad name")["msg"]
    assert "colour" in run.result("unknown option")["msg"]
    assert "must not look like a UUID" in run.result("unknown id")["msg"]
    msg = run.result("checkpoint of an unknown session")["msg"]
    assert "No session with id or name 'ghost-session'" in msg
    assert run.result("info of an unknown session")["sessions"] == []
    bad_size = run.result("server refuses a bad size")
    assert bad_size["http_status"] == 400 and "unknown size 'small'" in bad_size["msg"]
    # the catalog's route under the default prefix the module used, never a hard-coded /v2/agents
    assert "GET /v2/harness-runtime/sessions/sandbox/sizes" in bad_size["msg"] and "/v2/agents" not in bad_size["msg"]
    bad_agent = run.result("server refuses an unknown adapter")
    assert bad_agent["http_status"] == 400 and "unknown agent 'none'" in bad_agent["msg"]


def test_wrong_token_is_explained(plane, tmp_path):
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: list
              microvm.sandbox.session_info: {api_token: wrong-token}
              ignore_errors: true
    """)
    result = run.result("list")
    assert result["failed"] and result["http_status"] == 401
    assert "refused the API token" in result["msg"] and "DO_AGENTS_API_TOKEN" in result["msg"]
    assert "wrong-token" not in run.stdout + json.dumps(run.records)


def test_module_defaults_group_sets_api_options_once(plane, tmp_path):
    name = unique("defaults")
    # No DO_AGENTS_* in the environment: only module_defaults supplies them.
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          module_defaults:
            group/microvm.sandbox.api:
              api_url: %(url)s
              api_token: %(token)s
              wait_timeout: 120
              request_timeout: 20
          tasks:
            - name: create
              microvm.sandbox.session: {name: %(n)s}
            - name: info
              microvm.sandbox.session_info: {session: %(n)s}
            - name: checkpoint
              microvm.sandbox.checkpoint: {session: %(n)s, label: first}
            - name: checkpoints
              microvm.sandbox.checkpoint_info: {session: %(n)s}
            - name: templates
              microvm.sandbox.template_info: {name: base}
            - name: delete
              microvm.sandbox.session: {name: %(n)s, state: absent}
    """ % {"url": plane.url, "token": plane.token, "n": name}, with_plane_env=False)
    assert run.rc == 0, run
    assert run.result("info")["sessions"][0]["name"] == name
    assert run.result("checkpoints")["checkpoints"][0]["label"] == "first"
    assert run.result("templates")["templates"][0]["name"] == "base"
    assert plane.token not in run.stdout + run.stderr


def test_secrets_and_braces_reach_the_sandbox_literally(plane, tmp_path, cleanup):
    """secrets (alias secret_env) are hidden even at -vvv, never in the session object; braces pass unevaluated."""
    name = unique("secret")
    cleanup.append(name)
    secret = "s3cr3t-" + uuid.uuid4().hex
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: create
              microvm.sandbox.session:
                name: %s
                env:
                  TEMPLATED: !unsafe "{{ lookup('env', 'HOME') }}"
                secret_env:
                  MY_SECRET: %s
    """ % (name, secret), args=["-vvv"])
    assert run.rc == 0, run
    assert secret not in run.stdout + run.stderr
    session = run.result("create")["session"]
    client = plane.client()
    out = client.request("POST", "/sessions/%s/sandbox/exec" % session["session_id"],
                         body={"argv": ["sh", "-c", 'printf "%s|%s" "$TEMPLATED" "$MY_SECRET"']})
    assert out["exit_code"] == 0, out
    assert out["stdout"] == "{{ lookup('env', 'HOME') }}|" + secret
    # Platform-side secrets: readable inside the sandbox, never in API responses.
    assert secret not in json.dumps(client.get_session(session["session_id"]))


def test_sizes_are_listed_and_usable(plane, tmp_path, cleanup):
    name = unique("sized")
    cleanup.append(name)
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: sizes
              microvm.sandbox.size_info:
              register: catalog
            - name: create with the smallest
              microvm.sandbox.session: {name: %s, size: "{{ catalog.sizes[0].slug }}"}
    """ % name)
    assert run.rc == 0, run
    assert "mars-2vcpu-4gb" in run.result("sizes")["slugs"]
    assert run.changed("create with the smallest")


def test_resume_on_topoff_is_set_at_create_and_changed_in_place(plane, tmp_path, cleanup):
    name = unique("topoff")
    cleanup.append(name)
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: create
              microvm.sandbox.session: {name: %s, resume_on_topoff: true}
            - name: again
              microvm.sandbox.session: {name: %s, resume_on_topoff: true}
            - name: revoke in check mode
              microvm.sandbox.session: {name: %s, resume_on_topoff: false}
              check_mode: true
            - name: revoke
              microvm.sandbox.session: {name: %s, resume_on_topoff: false}
    """ % ((name,) * 4))
    assert run.rc == 0, run
    created = run.result("create")["session"]
    assert run.changed("create") and created["resume_on_topoff"] is True
    assert not run.changed("again")
    assert run.changed("revoke in check mode") and run.result("revoke in check mode")["session"]["resume_on_topoff"] is False
    revoked = run.result("revoke")["session"]
    assert run.changed("revoke") and revoked["session_id"] == created["session_id"]  # in place, no recreate
    assert plane.client().get_session(created["session_id"])["resume_on_topoff"] is False


def test_repos_reach_the_plane_which_refuses_them_clearly(plane, tmp_path):
    """The module sends the documented repos key; the local plane cannot clone and says so, naming them."""
    name = unique("repos")
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: with repos
              microvm.sandbox.session: {name: %s, repos: [your-org/your-service]}
              ignore_errors: true
    """ % name)
    assert run.rc == 0, run
    result = run.result("with repos")
    assert result["failed"] and result["http_status"] == 400
    assert "your-org/your-service" in result["msg"] and "no network" in result["msg"]
    assert live(plane, name) is None


def test_fork_fans_out_idempotently_with_the_files(plane, tmp_path, cleanup):
    name = unique("fan")
    cleanup.extend([name] + ["%s-fork-%d" % (name, i) for i in (1, 2, 3)])
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          vars:
            n: %s
          tasks:
            - name: create
              microvm.sandbox.session: {name: "{{ n }}"}
            - name: checkpoint
              microvm.sandbox.checkpoint: {session: "{{ n }}", label: prepared}
            - name: fork in check mode
              microvm.sandbox.session_fork: {source: "{{ n }}", checkpoint: prepared, count: 3}
              check_mode: true
            - name: fork
              microvm.sandbox.session_fork: {source: "{{ n }}", checkpoint: prepared, count: 3}
            - name: fork again
              microvm.sandbox.session_fork: {source: "{{ n }}", checkpoint: prepared, count: 3}
            - name: drop the forks
              microvm.sandbox.session_fork: {source: "{{ n }}", checkpoint: prepared, state: absent}
    """ % name)
    assert run.rc == 0, run
    forked = run.result("fork")
    assert forked["changed"] and forked["names"] == ["%s-fork-%d" % (name, i) for i in (1, 2, 3)]
    assert run.result("fork in check mode")["created"] == forked["created"]  # check mode predicts the real run
    assert all(s["status"] == "SESSION_STATUS_READY" for s in forked["sessions"])
    again = run.result("fork again")
    assert not again["changed"] and again["names"] == forked["names"]
    assert run.changed("drop the forks")
    assert all(live(plane, n) is None for n in forked["names"])
    assert live(plane, name) is not None


def test_a_slow_blocking_call_is_reconciled_not_resent(plane, tmp_path, cleanup):
    """The plane takes longer than blocking_timeout: the checkpoint happened, so the task succeeds, once."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults"))
    from faultproxy import FaultProxy
    name = unique("slow")
    cleanup.append(name)
    proxy = FaultProxy(plane.url).start()
    try:
        proxy.slow_answers(6, methods=("POST",), path=r"/checkpoints$")
        run = run_playbook(plane, tmp_path, """
            - hosts: localhost
              gather_facts: false
              module_defaults:
                group/microvm.sandbox.api: {api_url: %(url)s, blocking_timeout: 2, request_timeout: 2}
              tasks:
                - name: create
                  microvm.sandbox.session: {name: %(n)s}
                - name: checkpoint
                  microvm.sandbox.checkpoint: {session: %(n)s, label: slow-one}
        """ % {"url": proxy.url, "n": name})
        assert run.rc == 0, run
        cp = run.result("checkpoint")
        assert cp["changed"] and cp["checkpoint"]["label"] == "slow-one" and cp["checkpoint"]["status"] == "READY"
        assert len(proxy.requests("POST", r"/checkpoints$")) == 1  # never sent again
        sid = run.result("create")["session"]["session_id"]
        assert [c["label"] for c in plane.client().list_checkpoints(sid)] == ["slow-one"]
    finally:
        proxy.stop()


@pytest.mark.parametrize("status", [504, 502])
def test_an_edge_timeout_on_blocking_calls_is_reconciled_not_resent(plane, tmp_path, cleanup, status):
    """A gateway answers 504 (or 502) while the plane did the work: the tasks succeed, each call sent once."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults"))
    from faultproxy import FaultProxy
    name = unique("edge")
    cleanup.append(name)
    proxy = FaultProxy(plane.url).start()
    try:
        proxy.lose_answers(status, methods=("POST",), path=r"/checkpoints$")
        proxy.lose_answers(status, methods=("POST",), path=r"/fork$")
        run = run_playbook(plane, tmp_path, """
            - hosts: localhost
              gather_facts: false
              module_defaults:
                group/microvm.sandbox.api: {api_url: %(url)s}
              tasks:
                - name: create
                  microvm.sandbox.session: {name: %(n)s}
                - name: checkpoint
                  microvm.sandbox.checkpoint: {session: %(n)s, label: edge-one}
                - name: fork
                  microvm.sandbox.session_fork: {source: %(n)s, checkpoint: edge-one, count: 2}
        """ % {"url": proxy.url, "n": name})
        assert run.rc == 0, run
        cp = run.result("checkpoint")
        assert cp["changed"] and cp["checkpoint"]["label"] == "edge-one" and cp["checkpoint"]["status"] == "READY"
        forked = run.result("fork")
        cleanup.extend(forked["names"])
        assert forked["changed"] and len(forked["sessions"]) == 2
        assert all(s["status"] == "SESSION_STATUS_READY" for s in forked["sessions"])
        # Each blocking call reached the plane once and was answered only by the gateway.
        assert [e[2] for e in proxy.requests("POST", r"/checkpoints$")] == [status]
        assert [e[2] for e in proxy.requests("POST", r"/fork$")] == [status]
        sid = run.result("create")["session"]["session_id"]
        assert [c["label"] for c in plane.client().list_checkpoints(sid)] == ["edge-one"]
        assert len(plane.client().forks_of(sid)) == 2
    finally:
        proxy.stop()


def failed_session(plane, tmp_path, name):
    """A session the local plane really marks FAILED: its template's rootfs is lost before the boot.

    The template builds (an empty OCI image, made here); its unpacked rootfs is then removed from the plane's
    state dir, as a disk fault would, so the guest cannot be prepared and the plane's boot path records FAILED
    ("the sandbox failed to boot"). No boot code is bypassed.
    """
    import glob
    import shutil
    import subprocess
    import time

    if plane.state_dir is None:
        pytest.skip("needs the local plane's state dir")
    if not shutil.which("umoci"):
        pytest.skip("umoci is not installed (make system-deps)")
    layout = tmp_path / "layout"
    subprocess.run(["umoci", "init", "--layout", str(layout)], check=True)
    subprocess.run(["umoci", "new", "--image", "%s:v1" % layout], check=True)
    client = plane.client()
    template = client.create_template(unique("lost-rootfs"), "oci:%s:v1" % layout, "sandbox")
    deadline = time.time() + 120
    while client.get_template(template["template_id"])["status"] != "TEMPLATE_STATUS_READY":
        assert time.time() < deadline, client.get_template(template["template_id"])
        time.sleep(0.2)
    builds = glob.glob(os.path.join(plane.state_dir, "template-data", template["template_id"], "*"))
    assert builds, "the template's unpacked rootfs is not where docs/localplane.md says"
    for build in builds:
        shutil.rmtree(build)
    session = client.create_session({"name": name, "agent": "custom", "template": template["name"]})
    return client.wait_session(session["session_id"], until={"FAILED"}, timeout=120, gone_ok=True), template


def test_a_failed_session_is_deleted_by_state_absent(plane, tmp_path, cleanup):
    name = unique("failed")
    cleanup.append(name)
    failed, template = failed_session(plane, tmp_path, name)
    assert failed is not None and failed["status"] == "SESSION_STATUS_FAILED", failed
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - name: delete
              microvm.sandbox.session: {name: "%(name)s", state: absent}
            - name: delete again
              microvm.sandbox.session: {name: "%(sid)s", state: absent}
            - name: list
              microvm.sandbox.session_info: {}
    """ % {"name": name, "sid": failed["session_id"]})
    assert run.rc == 0, run
    assert run.changed("delete"), run.result("delete")
    assert run.result("delete")["session"]["status"] == "SESSION_STATUS_DESTROYED", run.result("delete")
    assert not run.changed("delete again"), run.result("delete again")
    # gone: no longer FAILED (the plane keeps DESTROYED records queryable for an hour, docs/localplane.md)
    listed = [s["status"] for s in run.result("list")["sessions"] if s["session_id"] == failed["session_id"]]
    assert listed in ([], ["SESSION_STATUS_DESTROYED"]), listed
    with pytest.raises(ApiError) as gone:
        plane.client().delete_session(failed["session_id"])
    assert gone.value.status == 404  # the plane agrees: already destroyed
    plane.client().delete_template(template["template_id"])
