"""The one error vocabulary (_shared/errors.py) and the one mapping of its kinds to task outcomes (_worker/outcomes.py)."""
import importlib
import inspect
import pathlib
import socket

import pytest
from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound

from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux import session_link
from ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.agent_client import ExecResult
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import outcomes

PLUGINS = pathlib.Path(errors.__file__).resolve().parent.parent.parent
PREFIX = "ansible_collections.microvm.sandbox.plugins."


def plugin_modules():
    for path in sorted(PLUGINS.rglob("*.py")):
        rel = path.relative_to(PLUGINS)
        if "agent_pb" in rel.parts or rel.parts[0] not in ("plugin_utils", "connection", "action"):
            continue
        yield PREFIX + ".".join(rel.with_suffix("").parts).replace(".__init__", "")


def test_the_family_is_defined_in_shared_alone():
    """No module outside _shared/errors.py defines a member of the family (aliases of old names are fine)."""
    defined_elsewhere = []
    for name in plugin_modules():
        module = importlib.import_module(name)
        for _attr, obj in inspect.getmembers(module, inspect.isclass):
            if obj.__module__ == name and issubclass(obj, errors.SandboxError) and name != errors.__name__:
                defined_elsewhere.append("%s.%s" % (name, obj.__name__))
    assert not defined_elsewhere, "define error classes in _shared/errors.py: %s" % defined_elsewhere


def test_every_kind_has_one_class_and_one_outcome():
    kinds = {v for k, v in vars(errors).items() if k.startswith("ERR_")}
    assert kinds == set(errors.CLASS_OF_KIND) == errors.KINDS
    assert set(outcomes.OUTCOME_OF_KIND) == kinds - {errors.ERR_WARM}  # warm_refused never reaches a task
    for kind, cls in errors.CLASS_OF_KIND.items():
        assert cls.kind == kind


@pytest.mark.parametrize("kind, expected", [
    ("unreachable", AnsibleConnectionFailure), ("lost", AnsibleConnectionFailure), ("gone", AnsibleConnectionFailure),
    ("protocol", AnsibleConnectionFailure), ("not_found", AnsibleFileNotFound), ("denied", AnsibleError),
    ("path", AnsibleError), ("failed", AnsibleError), ("a-kind-from-a-newer-mux", AnsibleError)])
def test_a_frame_round_trip_gives_the_kinds_ansible_exception(kind, expected):
    """Encoded by the mux, decoded by the worker over a real socket pair, mapped once."""
    mux_side, worker_side = socket.socketpair()
    with mux_side, worker_side:
        mp.send_frame(mux_side, mp.ERROR, errors.CLASS_OF_KIND.get(kind, errors.SandboxError)("it broke", kind).to_frame())
        frame_kind, payload = mp.recv_frame(worker_side)
    assert frame_kind == mp.ERROR
    rebuilt = errors.from_frame(payload)
    assert rebuilt.kind == kind and str(rebuilt) == "it broke"
    mapped = outcomes.ansible_error(rebuilt, "microvm.sandbox.agent")
    assert mapped.__class__ is expected and str(mapped).startswith("microvm.sandbox.agent: it broke")


def test_a_frame_without_a_kind_is_a_protocol_mismatch():
    assert isinstance(errors.from_frame("garbage"), errors.ProtocolMismatch)
    assert errors.from_frame({"message": "x"}).kind == errors.ERR_FAILED


def test_actions_raise_unreachable_and_fail_the_rest():
    with pytest.raises(AnsibleConnectionFailure, match="^microvm.sandbox.sync: lost it"):
        outcomes.task_failure(errors.CommandLost("lost it"), "sync")
    assert outcomes.task_failure(errors.Denied("no"), "sync") == "no"
    gone = AnsibleConnectionFailure("microvm.sandbox.agent: session box is DESTROYED")
    with pytest.raises(AnsibleConnectionFailure) as e:  # the connection mapped it already: it goes up as it is
        outcomes.task_failure(gone, "workspace_archive")
    assert e.value is gone
    assert outcomes.task_failure(AnsibleFileNotFound("missing"), "sync").startswith("missing")


class OneAnswerAgent:
    def __init__(self, exit_code, stderr):
        self.result = ExecResult(exit_code, stderr=stderr)

    def exec(self, argv, deadline=None):
        return self.result


def helper_link(tmp_path, exit_code, stderr):
    link = session_link.SessionLink(LinkConfig(session="box", token="t"), str(tmp_path))
    link.road = "api"  # ready without a channel
    link.client = OneAnswerAgent(exit_code, stderr)
    return link


@pytest.mark.parametrize("exit_code, stderr, expected", [
    (session_link.RC_NOT_FOUND, "Datei oder Verzeichnis nicht gefunden", errors.NotFound),
    (session_link.RC_DENIED, "Keine Berechtigung", errors.Denied),
    (1, "cp: cannot stat '/x': No such file or directory", errors.SandboxError),  # words never pick the kind
    (1, "Permission denied", errors.SandboxError)])
def test_the_mux_helpers_say_what_failed_by_exit_code_not_words(tmp_path, exit_code, stderr, expected):
    with pytest.raises(errors.SandboxError) as e:
        helper_link(tmp_path, exit_code, stderr.encode()).guest("true")
    assert e.value.__class__ is expected and str(e.value) == stderr


def test_a_lost_command_stays_lost_and_says_the_session_is_gone(tmp_path):
    """The session's state explains a lost command without changing its kind; a gone session closes the link."""
    link = helper_link(tmp_path, 0, b"")

    def check_session():
        raise errors.SessionGone("session box (sid) is DESTROYED; it cannot run tasks any more")
    link.check_session = check_session
    frame = link.report(errors.CommandLost("lost the command on session box: Socket closed (UNAVAILABLE)"))
    assert frame["kind"] == errors.ERR_LOST
    assert frame["message"].endswith("(UNAVAILABLE); session box (sid) is DESTROYED; it cannot run tasks any more")
    assert link.closed.wait(5) and isinstance(link.closed_because, errors.SessionGone)
