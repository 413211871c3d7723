"""microvm.sandbox.sync over `transport: api` (the documented exec and file API), agent port closed, for a team
without interactive stdin (the platform's default): what only this road has. test_sync.py and
test_hostile_sync.py run whole over this road in `make integration-api` (MICROVM_TEST_TRANSPORT=api); this module
runs on the api road whatever the suite's road is.

sync runs as steps whose stdin is one-shot (manifest, stage, apply, pack, drop), so it never asks for
`keep_stdin_open`: the plane answers that with a 403 here, and a run that asked for it would fail.

The collection's plugins that reach a sandbox through the connection, and their api-road tests with interactive
stdin off:
- microvm.sandbox.sync (action plugin: steps of the guest side, Upload with is_archive, Download): this module,
  and test_sync.py and test_hostile_sync.py over the api road;
- microvm.sandbox.workspace_archive (action plugin: a command, then Upload with is_archive), with the roles
  workspace_restore and workspace_export built on it: test_workspace_archive_api.py;
- any other module run on a sandbox host (ansible.builtin's and the like, through exec_command, put_file and
  fetch_file): test_connection.py, test_connection_shared.py and test_ssh_habits.py over the api road
  (`make integration-api`, interactive stdin off there).
Controller-only (they talk to the REST API, object storage or local files, never through the connection), so no
such test: session, session_info, session_fork, checkpoint, checkpoint_info, template, template_info,
environment_config, environment_config_info, persistent_workspace, persistent_workspace_info, size_info,
workspace_object and junit_merge (its action plugin merges files already on the controller; it has no connection).
"""

import os

import pytest
from test_sync import guest_sh, guest_state, local_state, result, sample_tree, sync

from microvm_localplane import dataplane
from microvm_plane_testing import stop_muxes, team_defaults, unique_name

BIG_FILES = 15_000  # with these names: a manifest of 1.3 MB (past the exec answer's 1 MiB) and deletions of 1 MB (past 512 KiB)
NAME = "f-%05d-" + "x" * 60


@pytest.fixture(scope="module")
def box(plane, tmp_path_factory):
    """test_sync's box, on the api road, for a team without interactive stdin and guest port 8443 closed."""
    client = plane.client()
    session = client.wait_session(client.create_session({"name": unique_name("sync-api"), "agent": "custom"})["session_id"],
                                  timeout=120)
    base = tmp_path_factory.mktemp("sync-api")
    mux = str(base / "mux")
    inv = base / "inventory.ini"
    inv.write_text("[sbx]\nbox ansible_host=%s\n\n[sbx:vars]\nansible_connection=microvm.sandbox.agent\n"
                   "ansible_python_interpreter=/usr/bin/python3\n" % session["session_id"])
    dataplane.write_settings(plane.state_dir, interactive_stdin=False, closed_ports=[8443])
    try:
        yield {"sid": session["session_id"], "inventory": str(inv),
               "env": {"MICROVM_MUX_DIR": mux, "MICROVM_PERSIST": "30", "MICROVM_TRANSPORT": "api"}}
    finally:
        dataplane.write_settings(plane.state_dir, **team_defaults())
        stop_muxes(mux)
        client.delete_session(session["session_id"])


def test_push_again_and_pull_without_interactive_stdin(plane, box, tmp_path):
    sid = box["sid"]
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    sample_tree(src)
    first = result(sync(plane, box, tmp_path, {"src": src, "dest": "/workspace/no-stdin"}))
    assert first["changed"] is True and first["applied"]["moved"] > 0, first
    assert guest_state(plane, sid, "/workspace/no-stdin") == local_state(src)
    again = result(sync(plane, box, tmp_path, {"src": src, "dest": "/workspace/no-stdin"}))
    assert again["changed"] is False and "applied" not in again, again
    pulled = result(sync(plane, box, tmp_path, {"mode": "pull", "src": "/workspace/no-stdin", "dest": out}))
    assert pulled["changed"] is True
    assert local_state(out) == local_state(src)
    # the steps leave nothing in the run's scratch dir
    assert "sync-" not in guest_sh(plane, sid, "ls -A /workspace/.scratch/*/ 2>/dev/null || true")


def test_a_manifest_and_deletions_past_the_exec_bounds(plane, box, tmp_path):
    """A tree whose manifest is more than the exec answer's 1 MiB per stream, pulled, then emptied by a push with
    delete whose operations are more than one request's one-shot stdin (the road stages them)."""
    sid = box["sid"]
    guest_sh(plane, sid, "python3 -c 'import os\nos.makedirs(\"/workspace/big\")\nfor i in range(%d):\n"
                         "    open(\"/workspace/big/%s\" %% i, \"w\").write(\"%%d\\n\" %% i)'" % (BIG_FILES, NAME))
    out = str(tmp_path / "out")
    pulled = result(sync(plane, box, tmp_path, {"mode": "pull", "src": "/workspace/big", "dest": out, "list_limit": 5}))
    assert pulled["counts"]["added"] == BIG_FILES, pulled["counts"]
    names = sorted(os.listdir(out))
    assert names == [NAME % i for i in range(BIG_FILES)]
    for i in (0, BIG_FILES // 2, BIG_FILES - 1):
        assert (tmp_path / "out" / (NAME % i)).read_text() == "%d\n" % i
    empty = tmp_path / "empty"
    empty.mkdir()
    pushed = result(sync(plane, box, tmp_path, {"src": str(empty), "dest": "/workspace/big", "delete": True,
                                                "list_limit": 5}))
    assert pushed["counts"]["deleted"] == BIG_FILES and pushed["applied"]["deleted"] == BIG_FILES, pushed["counts"]
    assert guest_sh(plane, sid, "ls -A /workspace/big") == ""
