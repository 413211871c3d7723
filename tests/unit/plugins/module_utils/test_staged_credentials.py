"""The check that keeps staged credentials out of checkpoints and forks (issue 42): what counts as staged, and
that an answer it cannot read is an error, never "nothing staged"."""
import os

import pytest
import yaml

from ansible_collections.microvm.sandbox.plugins.module_utils import profile, rest
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import refuse_if_credentials_staged

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


class ExecClient(rest.ApiClient):
    """A client whose exec answers what the test says (the rest of the stack is tested against the plane)."""

    def __init__(self, answer):
        self.answer = answer
        self.argv = None

    def exec_buffered(self, session_id, argv, timeout_seconds=60):
        self.argv = list(argv)
        return dict(self.answer)


def answer(stdout="", exit_code=0, stderr=""):
    return {"exit_code": exit_code, "stdout": stdout, "stderr": stderr, "duration_ms": 3}


def test_nothing_staged_is_an_empty_list_and_the_manifest_is_asked_for():
    client = ExecClient(answer(""))
    assert client.staged_credentials("s1") == []
    assert client.argv[0] == "/bin/sh" and client.argv[-1] == profile.STAGED_CREDENTIALS_DIR


def test_staged_directories_are_listed():
    out = "staged /workspace/.scratch/credentials.abc\nstaged /workspace/home/.creds/credentials.def\n"
    assert ExecClient(answer(out)).staged_credentials("s1") == [
        "/workspace/.scratch/credentials.abc", "/workspace/home/.creds/credentials.def"]


@pytest.mark.parametrize("reply", [answer("Linux"), answer("staged /etc/passwd"), answer("", exit_code=1),
                                   answer("", exit_code=126, stderr="sh: not found")])
def test_an_answer_it_cannot_read_is_an_error_not_nothing_staged(reply):
    with pytest.raises(rest.Refused) as err:
        ExecClient(reply).staged_credentials("s1")
    assert "could not tell whether credentials are staged" in str(err.value)


def test_the_refusal_names_the_staged_directories_and_the_fix():
    client = ExecClient(answer("staged /workspace/.scratch/credentials.abc\n"))
    with pytest.raises(rest.Refused) as err:
        refuse_if_credentials_staged(client, {"session_id": "s1", "name": "ci-1"}, "fork")
    msg = str(err.value)
    assert "refusing to fork session ci-1" in msg and "/workspace/.scratch/credentials.abc" in msg
    assert "tasks_from: cleanup" in msg and "check_staged_credentials: false" in msg
    assert err.value.details == {"staged_credentials": ["/workspace/.scratch/credentials.abc"]}
    refuse_if_credentials_staged(ExecClient(answer("")), {"session_id": "s1"}, "fork")  # nothing staged: no error


@pytest.mark.parametrize("role_vars", ["roles/credentials/vars/main.yml", "roles/workspace_export/vars/main.yml"])
def test_the_roles_name_the_same_manifest_as_the_modules(role_vars):
    with open(os.path.join(ROOT, role_vars)) as f:
        doc = yaml.safe_load(f)
    assert profile.STAGED_CREDENTIALS_DIR in doc.values(), doc
