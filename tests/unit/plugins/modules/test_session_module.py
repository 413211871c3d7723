"""microvm.sandbox.session against the fake plane: arguments, idempotency, check mode, diff, errors."""
import pytest

from ansible_collections.microvm.sandbox.plugins.modules import session as session_module
from ansible_collections.microvm.sandbox.plugins.modules import session_info

MAIN = session_module.main


def test_create_then_unchanged(run_module, fake_plane):
    first = run_module(MAIN, {"name": "web-1", "size": "mars-2vcpu-4gb", "idle_timeout": "10m"})
    assert first.result["changed"] is True
    assert first.result["session"]["status"] == "SESSION_STATUS_READY"
    assert first.result["session"]["idle_timeout_seconds"] == 600
    # The size is not reported back, so a different one is not a difference (it cannot be seen).
    second = run_module(MAIN, {"name": "web-1", "size": "mars-4vcpu-8gb", "idle_timeout": "600"})
    assert second.result["changed"] is False
    assert [c for c in fake_plane.mutating_calls() if c[0] == "POST"] == [("POST", "/sessions")]


def test_create_body(run_module, fake_plane):
    run_module(MAIN, {"name": "web-1", "env": {"A": "1", "FLAG": True}, "secret_env": {"TOKEN": "s3cret-value"},
                      "egress": ["mirror.example.com"], "template": "base", "size": "mars-2vcpu-4gb",
                      "persistent_workspace": True})
    rec = list(fake_plane.sessions.values())[0]
    assert rec["_env"] == {"A": "1", "FLAG": "true"}
    # secret_env is an alias of secrets: the values go to the platform's secret store, not to env.
    assert rec["_secrets"] == {"TOKEN": "s3cret-value"}
    assert rec["_egress"] == ["mirror.example.com"]
    assert rec["_template"] == "base" and rec["_size"] == "mars-2vcpu-4gb"
    assert rec["agent_kind"] == "AGENT_KIND_CUSTOM" and rec["workspace_id"]


def test_the_create_body_is_yaml_with_repos_and_resume_on_topoff_as_a_query(run_module, fake_plane):
    run = run_module(MAIN, {"name": "web-1", "repos": ["your-org/your-service"], "resume_on_topoff": True})
    assert run.result["changed"] is True and run.result["session"]["resume_on_topoff"] is True
    rec = list(fake_plane.sessions.values())[0]
    assert rec["_repos"] == ["your-org/your-service"] and rec["resume_on_topoff"] is True
    assert [c for c in fake_plane.content_types if c[0] != "GET"] == [("POST", "/sessions", "application/yaml")]


def test_resume_on_topoff_is_changed_in_place_not_by_recreating(run_module, fake_plane):
    rec = fake_plane.add_session("web-1")
    check = run_module(MAIN, {"name": "web-1", "resume_on_topoff": True}, check=True, diff=True)
    assert check.result["changed"] is True and fake_plane.mutating_calls() == []
    assert check.result["diff"]["before"]["resume_on_topoff"] is False
    assert check.result["diff"]["after"]["resume_on_topoff"] is True
    run = run_module(MAIN, {"name": "web-1", "resume_on_topoff": True})
    assert run.result["changed"] is True and run.result["session"]["session_id"] == rec["session_id"]
    assert fake_plane.mutating_calls() == [("PATCH", "/sessions/%s" % rec["session_id"])]
    assert fake_plane.content_types[-1] == ("PATCH", "/sessions/%s" % rec["session_id"], "application/json")
    assert run_module(MAIN, {"name": "web-1", "resume_on_topoff": True}).result["changed"] is False
    # Not set: left as it is.
    assert run_module(MAIN, {"name": "web-1"}).result["changed"] is False
    assert fake_plane.sessions[rec["session_id"]]["resume_on_topoff"] is True


def test_a_variable_in_env_and_secrets_is_refused(run_module, fake_plane):
    run = run_module(MAIN, {"name": "web-1", "env": {"TOKEN": "plain-value"}, "secrets": {"TOKEN": "secret-value"}})
    assert run.failed and "TOKEN set in both env and secrets" in run.result["msg"]
    assert fake_plane.mutating_calls() == []


def test_an_egress_host_the_plane_cannot_resolve_fails_the_task_naming_it(run_module, fake_plane):
    message = "egress host 'nope.example' does not resolve: the session could not reach it; fix or remove it"
    fake_plane.fail_next.append(("POST", "/sessions", 400, message))
    run = run_module(MAIN, {"name": "web-1", "egress": ["a.example", "nope.example"]})
    assert run.failed and "nope.example" in run.result["msg"] and "does not resolve" in run.result["msg"]
    assert fake_plane.sessions == {}


def test_egress_unrestricted_is_the_keyword(run_module, fake_plane):
    run_module(MAIN, {"name": "web-1", "egress": ["unrestricted"]})
    assert list(fake_plane.sessions.values())[0]["_egress"] == "unrestricted"


def test_secret_env_and_token_never_printed(run_module):
    run = run_module(MAIN, {"name": "web-1", "secret_env": {"TOKEN": "s3cret-value"}}, diff=True)
    assert "s3cret-value" not in run.stdout
    assert "t0ken-not-printed" not in run.stdout


def test_secret_looking_env_key_warns(run_module, monkeypatch):
    # Recorded at the source: where a warning ends up depends on whether controller code was imported.
    from ansible.module_utils.basic import AnsibleModule
    warned = []
    monkeypatch.setattr(AnsibleModule, "warn", lambda self, msg: warned.append(msg))
    run_module(MAIN, {"name": "web-1", "env": {"API_TOKEN": "x" * 20, "LOG_LEVEL": "debug"}})
    assert len(warned) == 1 and "'API_TOKEN' looks like a secret: pass it in secrets" in warned[0]


def test_check_mode_creates_nothing(run_module, fake_plane):
    run = run_module(MAIN, {"name": "web-1", "idle_timeout": "5m"}, check=True, diff=True)
    assert run.result["changed"] is True
    assert fake_plane.sessions == {}
    assert run.result["diff"]["before"] == {}
    assert run.result["diff"]["after"]["name"] == "web-1"
    assert run.result["diff"]["after"]["idle_timeout_seconds"] == 300
    assert run.result["diff"]["after"]["agent_kind"] == "AGENT_KIND_CUSTOM"


def test_differing_reported_settings_fail_and_list_the_fields(run_module, fake_plane):
    fake_plane.add_session("web-1", idle_timeout_seconds=600, agent_kind="AGENT_KIND_CODEX")
    run = run_module(MAIN, {"name": "web-1", "idle_timeout": "5m", "persistent_workspace": True,
                            "template": "py", "size": "mars-4vcpu-8gb"})
    assert run.failed
    assert "idle_timeout_seconds: is 600, wanted 300" in run.result["msg"]
    assert "agent_kind: is 'AGENT_KIND_CODEX'" in run.result["msg"]
    assert "persistent_workspace: is False" in run.result["msg"]
    assert "recreate: true" in run.result["msg"]
    # template and size are not reported by the platform: never compared.
    assert len(run.result["differing_fields"]) == 3
    assert fake_plane.mutating_calls() == []


def test_an_unspecified_agent_kind_is_no_difference(run_module, fake_plane):
    fake_plane.add_session("web-1", agent_kind="AGENT_KIND_UNSPECIFIED")
    assert run_module(MAIN, {"name": "web-1"}).result["changed"] is False


def test_recreate_replaces_the_session(run_module, fake_plane):
    old = fake_plane.add_session("web-1", idle_timeout_seconds=600)
    run = run_module(MAIN, {"name": "web-1", "idle_timeout": "60s", "recreate": True}, diff=True)
    assert run.result["changed"] is True
    assert run.result["session"]["session_id"] != old["session_id"]
    assert run.result["session"]["idle_timeout_seconds"] == 60
    assert fake_plane.sessions[old["session_id"]]["status"] == "SESSION_STATUS_DESTROYED"
    assert run.result["diff"]["before"]["idle_timeout_seconds"] == 600


def test_paused_then_running(run_module, fake_plane):
    fake_plane.add_session("web-1")
    paused = run_module(MAIN, {"name": "web-1", "state": "paused"})
    assert paused.result["changed"] is True
    assert paused.result["session"]["status"] == "SESSION_STATUS_PAUSED"
    assert run_module(MAIN, {"name": "web-1", "state": "paused"}).result["changed"] is False
    # present leaves a paused session paused
    assert run_module(MAIN, {"name": "web-1"}).result["changed"] is False
    running = run_module(MAIN, {"name": "web-1", "state": "running"})
    assert running.result["changed"] is True
    assert running.result["session"]["status"] == "SESSION_STATUS_READY"
    assert run_module(MAIN, {"name": "web-1", "state": "running"}).result["changed"] is False


def test_paused_check_mode_predicts(run_module, fake_plane):
    fake_plane.add_session("web-1")
    run = run_module(MAIN, {"name": "web-1", "state": "paused"}, check=True, diff=True)
    assert run.result["changed"] is True
    assert run.result["diff"]["before"]["status"] == "SESSION_STATUS_READY"
    assert run.result["diff"]["after"]["status"] == "SESSION_STATUS_PAUSED"
    assert fake_plane.mutating_calls() == []


def test_absent(run_module, fake_plane):
    rec = fake_plane.add_session("web-1")
    run = run_module(MAIN, {"name": "web-1", "state": "absent"}, diff=True)
    assert run.result["changed"] is True
    assert run.result["diff"]["after"] == {}
    assert fake_plane.sessions[rec["session_id"]]["status"] == "SESSION_STATUS_DESTROYED"
    again = run_module(MAIN, {"name": "web-1", "state": "absent"})
    assert again.result["changed"] is False
    by_id = run_module(MAIN, {"name": rec["session_id"], "state": "absent"})
    assert by_id.result["changed"] is False


def test_absent_deletes_failed_sessions(run_module, fake_plane):
    failed = fake_plane.add_session("web-1", status="FAILED", warnings=["the sandbox failed to boot"])
    gone = fake_plane.add_session("web-1", status="DESTROYED")
    run = run_module(MAIN, {"name": "web-1", "state": "absent"})
    assert run.result["changed"] is True
    assert fake_plane.sessions[failed["session_id"]]["status"] == "SESSION_STATUS_DESTROYED"
    assert ("DELETE", "/sessions/%s" % gone["session_id"]) not in fake_plane.calls
    assert run_module(MAIN, {"name": "web-1", "state": "absent"}).result["changed"] is False
    by_id = fake_plane.add_session("web-2", status="FAILED")
    run = run_module(MAIN, {"name": by_id["session_id"], "state": "absent"})
    assert run.result["changed"] is True
    assert fake_plane.sessions[by_id["session_id"]]["status"] == "SESSION_STATUS_DESTROYED"


def test_address_by_id(run_module, fake_plane):
    rec = fake_plane.add_session("web-1")
    run = run_module(MAIN, {"name": rec["session_id"], "state": "paused"})
    assert run.result["session"]["status"] == "SESSION_STATUS_PAUSED"


def test_unknown_id_cannot_be_created(run_module, fake_plane):
    run = run_module(MAIN, {"name": "2f0c8f9e-8d1e-4a57-9d0c-0c4bbf3cb2a1"})
    assert run.failed
    assert "must not look like a UUID" in run.result["msg"]
    assert fake_plane.mutating_calls() == []


def test_bad_name_is_refused_before_any_call(run_module, fake_plane):
    run = run_module(MAIN, {"name": "-bad name-"})
    assert run.failed
    assert "Cannot create a session named '-bad name-'" in run.result["msg"]
    assert fake_plane.mutating_calls() == []


def test_bad_arguments(run_module):
    run = run_module(MAIN, {"name": "x", "state": "sideways"})
    assert run.failed and "state" in run.result["msg"]
    run = run_module(MAIN, {"name": "x", "idle_timeout": "soon"})
    assert run.failed and "idle_timeout" in run.result["msg"]
    run = run_module(MAIN, {"name": "x", "colour": "blue"})
    assert run.failed and "colour" in run.result["msg"]


def test_missing_token_says_what_to_set(run_module):
    run = run_module(MAIN, {"name": "x"}, token=None)
    assert run.failed
    assert "DO_AGENTS_API_TOKEN" in run.result["msg"]


def test_env_fallback_for_url_and_token(run_module, monkeypatch, fake_plane):
    monkeypatch.setenv("DO_AGENTS_API_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("DO_AGENTS_API_TOKEN", "from-env")
    seen = {}
    import microvm_fake_plane

    init = microvm_fake_plane.FakeClient.__init__

    def record(self, *a, **kw):
        seen.update(kw)
        init(self, *a, **kw)

    monkeypatch.setattr(microvm_fake_plane.FakeClient, "__init__", record)
    run = run_module(MAIN, {"name": "web-1"}, token=None)
    assert not run.failed, run.result
    assert seen["api_url"] == "http://127.0.0.1:9"
    assert seen["api_token"] == "from-env"
    assert seen["prefix"] == "/v2/harness-runtime"


def test_route_prefix_from_the_environment(run_module, monkeypatch, fake_plane):
    monkeypatch.setenv("DO_AGENTS_API_PREFIX", "/v2/harness-runtime")
    seen = {}
    import microvm_fake_plane

    init = microvm_fake_plane.FakeClient.__init__

    def record(self, *a, **kw):
        seen.update(kw)
        init(self, *a, **kw)

    monkeypatch.setattr(microvm_fake_plane.FakeClient, "__init__", record)
    assert not run_module(MAIN, {"name": "web-1"}).failed
    assert seen["prefix"] == "/v2/harness-runtime"


def test_conflict_reports_the_server_message_and_state(run_module, fake_plane):
    fake_plane.add_session("web-1")
    fake_plane.fail_next.append(("POST", "/sessions/", 409, "session is busy"))
    run = run_module(MAIN, {"name": "web-1", "state": "paused"})
    assert run.failed
    assert "HTTP 409" in run.result["msg"] and "session is busy" in run.result["msg"]
    assert "in state READY" in run.result["msg"]
    assert run.result["http_status"] == 409


def test_session_info_filters_and_pages(run_module, fake_plane):
    for i in range(5):
        fake_plane.add_session("ci-%d" % i)
    fake_plane.add_session("other")
    fake_plane.add_session("ci-gone", status="DESTROYED")
    fake_plane.add_session("ci-paused", status="PAUSED")
    run = run_module(session_info.main, {"name_prefix": "ci-", "statuses": ["usable"]})
    assert sorted(s["name"] for s in run.result["sessions"]) == ["ci-%d" % i for i in range(5)]
    run = run_module(session_info.main, {"statuses": ["paused", "SESSION_STATUS_DESTROYED"]})
    assert sorted(s["name"] for s in run.result["sessions"]) == ["ci-gone", "ci-paused"]
    run = run_module(session_info.main, {"session": "CI-3"})
    assert [s["name"] for s in run.result["sessions"]] == ["ci-3"]
    assert run_module(session_info.main, {"name": "ci-3"}).result["sessions"] == run.result["sessions"]
    run = run_module(session_info.main, {"session": "nope"})
    assert run.result["sessions"] == [] and not run.failed
    run = run_module(session_info.main, {"statuses": ["sleepy"]})
    assert run.failed and "unknown session status 'sleepy'" in run.result["msg"]


def test_absent_without_wait_returns_at_once(run_module, fake_plane):
    rec = fake_plane.add_session("web-1")
    run = run_module(MAIN, {"name": "web-1", "state": "absent", "wait": False})
    assert run.result["changed"] is True
    assert run.result["session"]["session_id"] == rec["session_id"]
    assert run.result["session"]["status"] in ("SESSION_STATUS_DESTROYING", "SESSION_STATUS_DESTROYED")


def test_local_plane_token_never_leaves_loopback(run_module, fake_plane):
    fake_plane.add_session("web-1")
    token = "mvlp-local-secret"
    # DO_AGENTS_API_URL unset: the default URL is the platform's; nothing may be sent there.
    run = run_module(session_info.main, {"name": "web-1"}, token=token)
    assert run.failed
    assert "local control plane" in run.result["msg"] and "DO_AGENTS_API_URL" in run.result["msg"]
    assert "is not set" in run.result["msg"]
    assert token not in run.stdout
    assert fake_plane.calls == []
    run = run_module(MAIN, {"name": "web-2", "api_url": "https://agents.example.com"}, token=token)
    assert run.failed and "https://agents.example.com" in run.result["msg"] and fake_plane.calls == []
    for url in ("http://127.0.0.1:8787", "http://localhost:9", "http://[::1]:8787"):
        run = run_module(session_info.main, {"name": "web-1", "api_url": url}, token=token)
        assert not run.failed and len(run.result["sessions"]) == 1, url


@pytest.mark.parametrize("option,value", [("request_timeout", -1), ("request_timeout", 0), ("request_timeout", 1e308),
                                          ("request_timeout", float("nan")), ("blocking_timeout", -1),
                                          ("wait_timeout", -1), ("wait_timeout", 1e308)])
def test_a_timeout_out_of_range_fails_naming_the_option(run_module, fake_plane, option, value):
    run = run_module(MAIN, {"name": "web-1", option: value})
    assert run.failed
    assert run.result["msg"].startswith(option + " "), run.result["msg"]
    assert "seconds" in run.result["msg"] and fake_plane.sessions == {}


@pytest.mark.parametrize("option,value", [("env", {"A": [1, 2]}), ("env", {"A": {"b": 1}}),
                                          ("secrets", {"TOKEN": ["s3cret-value"]}), ("env", {"A": None})])
def test_a_non_scalar_env_value_is_refused_naming_the_key(run_module, fake_plane, option, value):
    run = run_module(MAIN, {"name": "web-1", option: value})
    assert run.failed
    key = list(value)[0]
    assert "%s: the value of %s must be a string, a number or a boolean" % (option, key) in run.result["msg"], run.result
    assert "s3cret-value" not in str(run.result)
    assert "s3cret-value" not in run.stdout and fake_plane.sessions == {}
