"""The pure parts of the workspace_archive action plugin: which entries clean keeps, and its command."""
import pytest

from ansible_collections.microvm.sandbox.plugins.action.workspace_archive import (
    clean_command, inside_workspace, kept_entries)


@pytest.mark.parametrize("dest, keep, want", [
    ("/workspace", ["/workspace/.scratch"], ["/workspace/.scratch"]),
    ("/workspace", ["/workspace/a/b/.scratch", "/workspace/a/c"], ["/workspace/a"]),
    ("/workspace/restored", ["/workspace/.scratch"], []),
    ("/workspace/x", ["/workspace/x/.scratch/", "/workspace/xy"], ["/workspace/x/.scratch"]),
])
def test_kept_entries(dest, keep, want):
    assert kept_entries(dest, keep) == want


def test_clean_command_keeps_and_quotes():
    cmd = clean_command("/workspace/my dir", ["/workspace/my dir/.scratch"])
    assert cmd == ("if [ -d '/workspace/my dir' ]; then find '/workspace/my dir' -mindepth 1 -maxdepth 1 "
                   "! -path '/workspace/my dir/.scratch' -exec rm -rf -- {} +; fi")


@pytest.mark.parametrize("path, ok", [("/workspace", True), ("/workspace/a", True), ("/workspace2", False),
                                      ("/tmp", False), ("/", False)])
def test_inside_workspace(path, ok):
    assert inside_workspace(path) is ok
