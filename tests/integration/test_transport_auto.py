"""`transport: auto`, the default, through the real stack: which road it picks, why, and who is told.

The agent where its port answers, else the documented API: a refused agent port (the plane's team setting
`closed_ports`, which answers the port-forward's dial with the 502 a template without the agent gives) falls back
at once, an agent port that takes the dial but stays silent after the probe; a paused session is woken first and a
gone one is an error. The choice is in the mux log once per link and shown at -v once per session and run. An explicit `transport: agent`
on a refused agent port fails on the refusal, naming what to do.
"""
import glob
import os

import pytest
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared.config import LinkConfig
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker.mux_client import MuxClient
from test_connection import inventory

from microvm_plane_testing import stop_muxes, team

CHOSE_AGENT = "transport auto chose agent (the agent answered on port 8443)"
CHOSE_API = "transport auto chose api (the agent port refused: "
PROBE_RAN_OUT = "did not answer within"


@pytest.fixture
def mux_dir(tmp_path):
    d = str(tmp_path / "mux")
    yield d
    stop_muxes(d)


@pytest.fixture
def default_env(plane, mux_dir, monkeypatch):
    """The plane's settings with no transport anywhere: the option's default decides."""
    monkeypatch.delenv("MICROVM_TRANSPORT", raising=False)
    env = {k: v for k, v in plane.env.items() if k != "MICROVM_TRANSPORT"}
    return dict(env, MICROVM_MUX_DIR=mux_dir, MICROVM_PERSIST="60")


def mux_log(mux_dir):
    text = ""
    for path in sorted(glob.glob(os.path.join(mux_dir, "mux-*", "mux.log"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            text += f.read()
    return text


def attach(plane, mux_dir, session, run, **settings):
    """A mux client attached to `session` with the default transport (unless `settings` say otherwise)."""
    cfg = LinkConfig(session=session, token=plane.token, api_url=plane.url, persist=60, **settings)
    return MuxClient(mux_dir, cfg, run=run).connect()


PLAY = r"""
- hosts: sbx
  gather_facts: false
  tasks:
    - ansible.builtin.command: echo one
    - ansible.builtin.copy: {content: "x\n", dest: /workspace/auto-road}
    - ansible.builtin.command: cat /workspace/auto-road
      register: r
    - ansible.builtin.assert: {that: ["r.stdout == 'x'"]}
"""


def test_a_default_run_takes_the_agent_and_says_so_once_per_run(plane, sandbox, default_env, mux_dir, playbook_runner):
    """No transport set, the plane's default template (agent listening): the agent road, warm runner and all;
    -v shows the choice once in a run of several tasks, and once again in the next run on the same link."""
    inv = inventory({"box": sandbox["session_id"]})
    with team(plane, interactive_stdin=False, closed_ports=[]):
        runs = [playbook_runner(PLAY, inv, default_env, extra_args=["-vvv"]) for _run in range(2)]
    for res in runs:
        assert res.rc == 0 and "failed=0" in res.stdout, res
        assert res.stdout.count(CHOSE_AGENT) == 1, res
        assert "WARM RUNNER ran the module" in res.stdout, res
    assert mux_log(mux_dir).count(CHOSE_AGENT) == 1  # one link served both runs: chosen and logged once


def test_a_default_run_with_the_agent_port_closed_takes_the_api_at_once(plane, sandbox, default_env, mux_dir,
                                                                        playbook_runner):
    """No transport set, the agent port refused (a template without the agent): the api road, chosen on the
    refusal itself, not when the 5 s probe ran out; shown once at -v, not at all without it."""
    inv = inventory({"box": sandbox["session_id"]})
    with team(plane, interactive_stdin=False, closed_ports=[8443]):
        verbose = playbook_runner(PLAY, inv, default_env, extra_args=["-v"])
        quiet = playbook_runner(PLAY, inv, default_env)
    assert verbose.rc == 0 and "failed=0" in verbose.stdout, verbose
    assert verbose.stdout.count(CHOSE_API) == 1 and "could not reach guest port 8443" in verbose.stdout, verbose
    assert quiet.rc == 0 and "transport auto chose" not in quiet.stdout, quiet
    log = mux_log(mux_dir)
    assert log.count(CHOSE_API) == 1, log
    assert PROBE_RAN_OUT not in log, log
    assert "using the documented exec and file API (transport auto)" in log, log


def test_the_choice_reaches_each_run_once_in_the_attach_reply(plane, sandbox, mux_dir):
    """The worker learns the choice from the attach it makes anyway: the first attach of a run gets it, the
    run's later attaches do not, another run does."""
    with team(plane, interactive_stdin=False, closed_ports=[8443]):
        first = attach(plane, mux_dir, sandbox["name"], "run-a")
        again = attach(plane, mux_dir, sandbox["name"], "run-a")
        other = attach(plane, mux_dir, sandbox["name"], "run-b")
        try:
            assert first.attached["road"] == "api" and CHOSE_API in first.attached["road_note"]
            assert again.attached["road"] == "api" and again.attached["road_note"] is None
            assert other.attached["road_note"] == first.attached["road_note"]
            assert first.exec(["echo", "over the api"])[:2] == (0, b"over the api\n")
        finally:
            for client in (first, again, other):
                client.close()


def test_an_explicit_road_is_not_a_choice(plane, sandbox, mux_dir):
    """transport agent and api say nothing about a choice (there was none)."""
    with team(plane, interactive_stdin=False, closed_ports=[]):
        for road in ("agent", "api"):
            client = attach(plane, mux_dir, sandbox["name"], "run-x", transport=road)
            try:
                assert client.attached["road"] == road and client.attached["road_note"] is None
            finally:
                client.close()
    assert "transport auto chose" not in mux_log(mux_dir)


def test_agent_on_a_refused_port_is_unreachable_naming_what_to_do(plane, sandbox, default_env, mux_dir, playbook_runner):
    """transport agent where the agent port is refused (a template without the agent): UNREACHABLE on the refusal,
    naming the cause and the options that help (transport, agent_port), not "could not connect within 60s"."""
    inv = inventory({"box": sandbox["session_id"]})
    with team(plane, interactive_stdin=False, closed_ports=[8443]):
        res = playbook_runner(PLAY, inv, dict(default_env, MICROVM_TRANSPORT="agent"))
    assert res.rc != 0 and "UNREACHABLE!" in res.stdout and "unreachable=1" in res.stdout, res
    assert "the platform could not reach guest port 8443 (HTTP 502)" in res.stdout, res
    assert "the template has no guest agent, or it does not listen there" in res.stdout, res
    assert "Set transport to auto or api" in res.stdout and "agent_port" in res.stdout, res
    assert "within 60s (option connect_timeout)" not in res.stdout, res
    log = mux_log(mux_dir)
    assert "could not open: session" in log and "the agent port refused" in log, log
    assert "using the documented exec and file API" not in log and "transport auto chose" not in log, log


SILENT_PORT = 9555
SILENT_LISTENER = ("import socket, time\n"
                   "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                   "s.bind(('0.0.0.0', %d)); s.listen(8)\n"
                   "held = []\n"
                   "while True:\n"
                   "    held.append(s.accept()[0])\n" % SILENT_PORT)


def test_a_port_that_takes_the_dial_but_stays_silent_waits_the_probe(plane, sandbox, mux_dir):
    """Something listens on the agent port but never speaks gRPC: not a refusal, so the probe runs out, then api."""
    client = plane.client()
    started = client.request("POST", "/sessions/%s/sandbox/exec" % sandbox["session_id"], body={"argv": [
        "sh", "-c", 'setsid python3 -c "$0" </dev/null >/dev/null 2>&1 & sleep 0.5', SILENT_LISTENER]})
    assert started["exit_code"] == 0, started
    with team(plane, interactive_stdin=False, closed_ports=[]):
        mux = attach(plane, mux_dir, sandbox["name"], "run-s", agent_port=SILENT_PORT)
        try:
            note = mux.attached["road_note"]
            assert mux.attached["road"] == "api", mux.attached
            assert "transport auto chose api (the agent did not answer within 5 s" in note, note
            assert mux.exec(["echo", "after the probe"])[:2] == (0, b"after the probe\n")
        finally:
            mux.close()


def test_a_paused_session_is_woken_and_keeps_the_agent(plane, sandbox, mux_dir):
    """A paused session's agent is quiet until it is resumed: auto wakes it first and picks the agent."""
    client = plane.client()
    client.pause_session(sandbox["session_id"])
    assert client.get_session(sandbox["session_id"])["status"].endswith("PAUSED")
    with team(plane, interactive_stdin=False, closed_ports=[]):
        mux = attach(plane, mux_dir, sandbox["name"], "run-p")
        try:
            assert mux.attached["road"] == "agent" and CHOSE_AGENT in mux.attached["road_note"], mux.attached
        finally:
            mux.close()
    assert "is paused: resuming it" in mux_log(mux_dir)


def test_a_gone_session_is_an_error_not_a_fallback(plane, mux_dir):
    """A deleted session fails the attach on auto as on agent: the api road is never tried for it."""
    client = plane.client()
    session = client.create_session({"name": "auto-gone-%s" % os.urandom(4).hex(), "agent": "custom", "keep_warm": True})
    client.wait_session(session["session_id"], timeout=120)
    client.delete_session(session["session_id"])
    with team(plane, interactive_stdin=False, closed_ports=[8443]):
        with pytest.raises(errors.SessionGone):
            attach(plane, mux_dir, session["session_id"], "run-g")
    assert "transport auto chose" not in mux_log(mux_dir)
