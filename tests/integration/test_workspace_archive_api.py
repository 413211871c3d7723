"""microvm.sandbox.workspace_archive (and the roles built on it) over `transport: api`, agent port closed.

A representative subset of test_workspace_restore.py collected again with this module's `env` (see
test_connection_api.py for why a subset): the archive goes in through the documented upload with
is_archive, so the guest's checks refuse what they refuse on the agent road.
"""
import pytest
from test_workspace_restore import (  # noqa: F401  (fixtures and tests collected again here)  # pylint: disable=unused-import
    ACCESS_KEY,
    SECRET_KEY,
    new_session_name,
    s3,
    test_clean_through_a_link_out_of_the_workspace_removes_nothing,
    test_round_trip_through_object_storage,
    test_the_agent_refuses_what_only_the_session_shows,
)

from microvm_localplane import dataplane
from microvm_plane_testing import team_defaults


@pytest.fixture(scope="module")
def env(plane, s3, tmp_path_factory):  # noqa: F811
    """test_workspace_restore's env on the api road (interactive stdin off: the archive needs none)."""
    mux = tmp_path_factory.mktemp("restore-api-mux")
    dataplane.write_settings(plane.state_dir, interactive_stdin=False, closed_ports=[8443])
    try:
        yield dict(plane.env, MICROVM_MUX_DIR=str(mux), MICROVM_PERSIST="20", AWS_ACCESS_KEY_ID=ACCESS_KEY,
                   AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_ENDPOINT_URL_S3=s3["endpoint"], AWS_DEFAULT_REGION="us-east-1",
                   MICROVM_TRANSPORT="api")
    finally:
        dataplane.write_settings(plane.state_dir, **team_defaults())
