"""Run a module of the collection in-process against the fake plane, as Ansible would."""
import json

import pytest

from microvm_fake_plane import FakeClient, FakePlane  # noqa: E402

from ansible.module_utils.testing import patch_module_args  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import api_module  # noqa: E402


class ModuleRun(object):
    def __init__(self, result, rc, stdout):
        self.result = result
        self.rc = rc
        self.stdout = stdout

    @property
    def failed(self):
        return bool(self.result.get("failed"))


@pytest.fixture
def fake_plane(monkeypatch):
    plane = FakePlane()
    FakeClient.plane = plane
    monkeypatch.setattr(api_module, "ApiClient", FakeClient)
    monkeypatch.delenv("DO_AGENTS_API_URL", raising=False)
    monkeypatch.delenv("DO_AGENTS_API_TOKEN", raising=False)
    return plane


@pytest.fixture
def run_module(fake_plane, capsys):
    """run_module(module_main, args, check=False, diff=False) -> ModuleRun (stdout JSON parsed)."""

    def run(main, args, check=False, diff=False, token="t0ken-not-printed"):
        args = dict(args)
        if token is not None:
            args.setdefault("api_token", token)
        args["_ansible_check_mode"] = check
        args["_ansible_diff"] = diff
        capsys.readouterr()
        with patch_module_args(args):
            try:
                main()
                rc = 0
            except SystemExit as e:
                rc = e.code
        out = capsys.readouterr().out
        return ModuleRun(json.loads(out), rc, out)

    return run
