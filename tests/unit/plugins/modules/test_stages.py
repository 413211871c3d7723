# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""session and template return `stages`: what the task did and waited on, with seconds (issue 42)."""
from ansible_collections.microvm.sandbox.plugins.modules import session as session_module
from ansible_collections.microvm.sandbox.plugins.modules import template as template_module


def test_session_module_returns_its_stages(run_module, fake_plane):
    first = run_module(session_module.main, {"name": "web-1"})
    assert [s["stage"] for s in first.result["stages"]] == ["create", "PROVISIONING"], first.result
    assert all(isinstance(s["seconds"], float) for s in first.result["stages"])
    again = run_module(session_module.main, {"name": "web-1"})
    assert again.result["stages"] == [] and again.result["changed"] is False
    gone = run_module(session_module.main, {"name": "web-1", "state": "absent"})
    assert [s["stage"] for s in gone.result["stages"]] == ["delete"], gone.result   # the fake plane is DESTROYED at the first poll


def test_check_mode_has_no_stages(run_module, fake_plane):
    run = run_module(session_module.main, {"name": "web-1"}, check=True)
    assert run.result["stages"] == [] and run.result["changed"] is True


def test_template_module_returns_its_stages(run_module, fake_plane):
    run = run_module(template_module.main, {"name": "agent", "source_oci_ref": "registry.example.com/team/agent:1.0",
                                            "base_template": "sandbox"})
    stages = [s["stage"] for s in run.result["stages"]]
    assert stages[0] == "create" and all(s.startswith("build ") for s in stages[1:]), run.result
