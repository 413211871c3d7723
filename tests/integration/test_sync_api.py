"""microvm.sandbox.sync over `transport: api` (the documented exec and file API), agent port closed: what only
this road has. test_sync.py runs whole over this road in `make integration-api` (MICROVM_TEST_TRANSPORT=api).
sync streams its manifest and operations over one command's stdin and stdout, so on this road it needs the
team's interactive stdin; without it, it fails naming it.
"""

import pytest
from test_sync import sync

from microvm_localplane import dataplane
from microvm_plane_testing import stop_muxes, team_defaults, unique_name


@pytest.fixture(scope="module")
def box(plane, tmp_path_factory):
    """test_sync's box, on the api road, for a team with interactive stdin and guest port 8443 closed."""
    client = plane.client()
    session = client.wait_session(client.create_session({"name": unique_name("sync-api"), "agent": "custom"})["session_id"],
                                  timeout=120)
    base = tmp_path_factory.mktemp("sync-api")
    mux = str(base / "mux")
    inv = base / "inventory.ini"
    inv.write_text("[sbx]\nbox ansible_host=%s\n\n[sbx:vars]\nansible_connection=microvm.sandbox.agent\n"
                   "ansible_python_interpreter=/usr/bin/python3\n" % session["session_id"])
    dataplane.write_settings(plane.state_dir, interactive_stdin=True, closed_ports=[8443])
    try:
        yield {"sid": session["session_id"], "inventory": str(inv),
               "env": {"MICROVM_MUX_DIR": mux, "MICROVM_PERSIST": "30", "MICROVM_TRANSPORT": "api"}}
    finally:
        dataplane.write_settings(plane.state_dir, **team_defaults())
        stop_muxes(mux)
        client.delete_session(session["session_id"])


def test_without_interactive_stdin_sync_names_the_team_setting(plane, box, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    dataplane.write_settings(plane.state_dir, interactive_stdin=False)
    try:
        run = sync(plane, box, tmp_path, {"src": str(src), "dest": "/workspace/no-stdin"},
                   env={"MICROVM_MUX_DIR": box["env"]["MICROVM_MUX_DIR"] + "-2"})
    finally:
        dataplane.write_settings(plane.state_dir, interactive_stdin=True)
    assert run.rc != 0
    assert "interactive stdin (keep_stdin_open)" in run.stdout + run.stderr, run
