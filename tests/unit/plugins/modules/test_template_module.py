"""microvm.sandbox.template and template_info against the fake plane."""
from ansible_collections.microvm.sandbox.plugins.modules import template, template_info

MAIN = template.main
REF = "registry.example.com/team/agent:1.0"


BASE = "sandbox"


def test_register_then_unchanged(run_module, fake_plane):
    first = run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE}, diff=True)
    assert first.result["changed"] is True
    assert first.result["template"]["status"] == "TEMPLATE_STATUS_READY"
    assert first.result["build"]["status"] == "SUCCEEDED"
    assert first.result["diff"]["before"] == {}
    second = run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE})
    assert second.result["changed"] is False
    assert len(list(fake_plane.builds.values())[0]) == 1


def test_base_template_change_rebuilds_with_put(run_module, fake_plane):
    run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE})
    run = run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": "codex-base"}, diff=True)
    assert run.result["changed"] is True
    assert ("PUT", "/templates/%s" % run.result["template"]["template_id"]) in fake_plane.calls
    assert run.result["diff"]["before"]["spec"] == {"base_template": BASE}
    assert run.result["diff"]["after"]["spec"] == {"base_template": "codex-base"}


def test_a_new_source_alone_is_not_seen_and_needs_force_rebuild(run_module, fake_plane):
    run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE})
    run = run_module(MAIN, {"name": "agent", "source_oci_ref": REF.replace("1.0", "2.0"), "base_template": BASE})
    assert run.result["changed"] is False


def test_force_rebuild_always_changes(run_module, fake_plane):
    run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE})
    run = run_module(MAIN, {"name": "agent", "force_rebuild": True})
    assert run.result["changed"] is True
    assert len(list(fake_plane.builds.values())[0]) == 2


def test_check_mode_builds_nothing(run_module, fake_plane):
    run = run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE}, check=True, diff=True)
    assert run.result["changed"] is True and fake_plane.templates == {}
    assert run.result["diff"]["after"]["spec"] == {"base_template": BASE}


def test_failed_build_fails_with_the_builds_error(run_module, fake_plane):
    fake_plane.build_outcome = ("FAILED", "skopeo copy failed: manifest unknown")
    run = run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE})
    assert run.failed
    assert "skopeo copy failed: manifest unknown" in run.result["msg"]
    assert "force_rebuild" in run.result["msg"]
    # The next run rebuilds a failed template, and succeeds once the image is there.
    fake_plane.build_outcome = ("SUCCEEDED", "")
    again = run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE})
    assert again.result["changed"] is True and again.result["template"]["status"] == "TEMPLATE_STATUS_READY"


def test_new_template_needs_a_source_and_a_base(run_module, fake_plane):
    run = run_module(MAIN, {"name": "agent"})
    assert run.failed and "source_oci_ref and base_template are required" in run.result["msg"]
    run = run_module(MAIN, {"name": "agent", "source_oci_ref": REF})
    assert run.failed and "base_template is required" in run.result["msg"]
    run = run_module(MAIN, {"name": "agent", "source_oci_ref": "bad ref", "base_template": BASE})
    assert run.failed and "source_oci_ref" in run.result["msg"]
    assert fake_plane.mutating_calls() == []


def test_absent(run_module, fake_plane):
    run_module(MAIN, {"name": "agent", "source_oci_ref": REF, "base_template": BASE})
    run = run_module(MAIN, {"name": "agent", "state": "absent"}, diff=True)
    assert run.result["changed"] is True and fake_plane.templates == {}
    assert run.result["diff"]["after"] == {}
    assert run_module(MAIN, {"name": "agent", "state": "absent"}).result["changed"] is False


def test_template_info(run_module, fake_plane):
    for n in ("a", "b", "c"):
        run_module(MAIN, {"name": n, "source_oci_ref": REF, "base_template": BASE})
    run = run_module(template_info.main, {})
    assert sorted(t["name"] for t in run.result["templates"]) == ["a", "b", "c"]
    run = run_module(template_info.main, {"name": "b", "include_builds": True})
    assert [t["name"] for t in run.result["templates"]] == ["b"]
    assert run.result["templates"][0]["builds"][0]["status"] == "SUCCEEDED"
    assert run_module(template_info.main, {"name": "zzz"}).result["templates"] == []
