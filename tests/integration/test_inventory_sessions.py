"""The sessions inventory plugin through real ansible-inventory / ansible-playbook runs."""
import json
import os
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ansible_runner_util import run_inventory, run_playbook  # noqa: E402


def plain(hostvars):
    """ansible-inventory marks unsafe values as {"__ansible_unsafe": value}; unwrap them for comparison."""
    return dict((k, v["__ansible_unsafe"] if isinstance(v, dict) and "__ansible_unsafe" in v else v)
                for k, v in hostvars.items())


@pytest.fixture(scope="module")
def fleet(plane):
    """Three sessions with a common random prefix: two READY (one paused later), one in another group."""
    client = plane.client()
    prefix = "inv%s" % uuid.uuid4().hex[:6]
    made = []
    try:
        for suffix in ("a-1", "a-2", "b-1"):
            made.append(client.create_session({"name": "%s-%s" % (prefix, suffix)}))
        made = [client.wait_session(s["session_id"], timeout=120) for s in made]
        client.pause_session(made[1]["session_id"])
        made[1] = client.wait_session(made[1]["session_id"], until=frozenset(["PAUSED"]), timeout=120)
        yield prefix, made
    finally:
        for s in made:
            try:
                client.delete_session(s["session_id"])
            except Exception:
                pass


def test_inventory_hosts_vars_and_keyed_groups(plane, tmp_path, fleet):
    prefix, made = fleet
    proc, data = run_inventory(plane, tmp_path, """
        plugin: microvm.sandbox.sessions
        name_prefix: %s-
        keyed_groups:
          - key: microvm_status | lower
            prefix: status
          - key: microvm_agent_kind | lower
            prefix: kind
        groups:
          group_a: microvm_name is search('-a-')
        compose:
          sandbox_region: microvm_region
    """ % prefix)
    assert proc.returncode == 0, proc.stderr
    hostvars = data["_meta"]["hostvars"]
    names = sorted(hostvars)
    assert names == ["%s-a-1" % prefix, "%s-a-2" % prefix, "%s-b-1" % prefix]
    first = plain(hostvars["%s-a-1" % prefix])
    assert first["ansible_host"] == made[0]["session_id"]
    assert first["ansible_connection"] == "microvm.sandbox.agent"
    assert first["microvm_session_id"] == made[0]["session_id"]
    assert first["microvm_status"] == "READY"
    assert first["sandbox_region"] == made[0]["region"]
    assert first["ansible_microvm_api_url"] == plane.url  # not the default, so the connection is told
    assert "ansible_microvm_route_prefix" not in first  # the default: nothing to pass
    assert sorted(data["status_ready"]["hosts"]) == ["%s-a-1" % prefix, "%s-b-1" % prefix]
    assert data["status_paused"]["hosts"] == ["%s-a-2" % prefix]
    assert sorted(data["kind_agent_kind_custom"]["hosts"]) == names
    assert sorted(data["group_a"]["hosts"]) == ["%s-a-1" % prefix, "%s-a-2" % prefix]
    assert plane.token not in proc.stdout + proc.stderr


def test_inventory_filters(plane, tmp_path, fleet):
    prefix = fleet[0]
    proc, data = run_inventory(plane, tmp_path, """
        plugin: microvm.sandbox.sessions
        name_regex: '^%s-(a|b)-1$'
        statuses: [usable]
    """ % prefix)
    assert proc.returncode == 0, proc.stderr
    assert sorted(data["_meta"]["hostvars"]) == ["%s-a-1" % prefix, "%s-b-1" % prefix]


def test_inventory_takes_the_route_prefix_from_the_environment(plane, tmp_path, fleet):
    prefix = fleet[0]
    proc, data = run_inventory(plane, tmp_path, """
        plugin: microvm.sandbox.sessions
        name_prefix: %s-a-1
    """ % prefix, env={"DO_AGENTS_API_PREFIX": "/v2/agents"})
    assert proc.returncode == 0, proc.stderr
    host = plain(data["_meta"]["hostvars"]["%s-a-1" % prefix])
    # The older routes are not the default, so the connection is told too.
    assert host["ansible_microvm_route_prefix"] == "/v2/agents"
    proc = run_inventory(plane, tmp_path, "plugin: microvm.sandbox.sessions\n",
                         env={"DO_AGENTS_API_PREFIX": "/v2/nowhere", "ANSIBLE_INVENTORY_UNPARSED_FAILED": "True"})[0]
    assert proc.returncode != 0 and "/v2/nowhere/sessions" in proc.stderr


def test_inventory_cache_and_flush(plane, tmp_path):
    client = plane.client()
    name = "cache%s" % uuid.uuid4().hex[:6]
    s = client.create_session({"name": name})
    config = """
        plugin: microvm.sandbox.sessions
        name_prefix: %s
        statuses: [PROVISIONING, usable, PAUSED]
        cache: true
        cache_plugin: ansible.builtin.jsonfile
        cache_connection: %s
        cache_timeout: 3600
    """ % (name, tmp_path / "cache")
    try:
        proc, data = run_inventory(plane, tmp_path, config)
        assert proc.returncode == 0, proc.stderr
        assert name in data["_meta"]["hostvars"]
    finally:
        client.delete_session(s["session_id"])
    proc, cached = run_inventory(plane, tmp_path, config)
    assert name in cached["_meta"]["hostvars"]  # served from the cache
    proc, fresh = run_inventory(plane, tmp_path, config, args=("--list", "--flush-cache"))
    assert name not in fresh["_meta"]["hostvars"]


def test_inventory_errors_are_clear(plane, tmp_path):
    proc = run_inventory(plane, tmp_path, """
        plugin: microvm.sandbox.sessions
        api_token: wrong
    """, env={"ANSIBLE_INVENTORY_UNPARSED_FAILED": "True"})[0]
    assert proc.returncode != 0
    assert "refused the API token" in proc.stderr and "HTTP 401" in proc.stderr
    proc = run_inventory(plane, tmp_path, """
        plugin: microvm.sandbox.sessions
        statuses: [sleepy]
    """, env={"ANSIBLE_INVENTORY_UNPARSED_FAILED": "True"})[0]
    assert proc.returncode != 0 and "unknown session status 'sleepy'" in proc.stderr


# -- API data is never a template --------------------------------------------

HOSTILE = "{{ lookup('ansible.builtin.pipe', 'touch %s') }}"


class StubApi(BaseHTTPRequestHandler):
    """Answers GET /v2/harness-runtime/sessions with sessions whose fields hold template code."""

    sessions = []
    token = "stub-token"

    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer " + self.token:
            return self._send(401, {"error": {"code": 401, "message": "bad token"}})
        if not self.path.startswith("/v2/harness-runtime/sessions"):
            return self._send(404, {"error": {"code": 404, "message": "no route"}})
        self._send(200, {"sessions": self.sessions, "next_page_token": ""})

    def _send(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def hostile_api(tmp_path):
    marker = tmp_path / "evaluated"
    code = HOSTILE % marker
    StubApi.sessions = [
        {"session_id": "11111111-2222-4333-8444-555555555555", "name": "evil-{{ 7 * 7 }}",
         "status": "SESSION_STATUS_READY", "repo_hint": code, "region": "ric1", "config_id": code},
        {"session_id": "21111111-2222-4333-8444-555555555555", "name": "plain",
         "status": "SESSION_STATUS_READY", "repo_hint": code, "region": "{{ 6 * 7 }}"},
    ]
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {"DO_AGENTS_API_URL": "http://127.0.0.1:%d" % server.server_address[1],
           "DO_AGENTS_API_TOKEN": StubApi.token}
    try:
        yield env, code, marker
    finally:
        server.shutdown()


class EnvOnly(object):
    def __init__(self, env):
        self.env = env


def test_api_data_is_never_evaluated(tmp_path, hostile_api):
    env, code, marker = hostile_api
    config = """
        plugin: microvm.sandbox.sessions
        connection_plugin: ansible.builtin.local
        compose:
          copied_template: microvm_repo_hint
        keyed_groups:
          - key: microvm_region
            prefix: region
    """
    proc, data = run_inventory(EnvOnly(env), tmp_path, config)
    assert proc.returncode == 0, proc.stderr
    hostvars = data["_meta"]["hostvars"]
    # A name the platform would never issue does not become a host name; the id does.
    raw = hostvars["11111111-2222-4333-8444-555555555555"]
    assert raw["microvm_repo_hint"] == {"__ansible_unsafe": code}  # marked unsafe, not just left alone
    evil = plain(raw)
    assert evil["microvm_name"] == "evil-{{ 7 * 7 }}"
    assert evil["microvm_repo_hint"] == code and evil["copied_template"] == code
    assert evil["microvm_config_id"] == code
    assert plain(hostvars["plain"])["microvm_region"] == "{{ 6 * 7 }}"
    assert not marker.exists()

    inventory = tmp_path / "test.microvm_sessions.yml"  # written by run_inventory above
    run = run_playbook(EnvOnly(env), tmp_path, """
        - hosts: all
          gather_facts: false
          tasks:
            - name: show
              ansible.builtin.debug:
                msg: "{{ microvm_name }}|{{ microvm_repo_hint }}|{{ copied_template }}|{{ microvm_region }}"
    """, inventory=str(inventory))
    assert run.rc == 0, run
    shown = [r["result"]["msg"] for r in run.records if r["task"] == "show"]
    assert "evil-{{ 7 * 7 }}|%s|%s|ric1" % (code, code) in shown
    assert "plain|%s|%s|{{ 6 * 7 }}" % (code, code) in shown
    assert not marker.exists()


def test_inventory_hosts_run_tasks_over_the_agent_connection(plane, tmp_path, fleet):
    """The inventory's host variables are enough for the agent connection: a paused session is woken too."""
    prefix, made = fleet
    inventory = tmp_path / "run.microvm_sessions.yml"
    inventory.write_text("plugin: microvm.sandbox.sessions\nname_regex: '^%s-a-'\n" % prefix)
    run = run_playbook(plane, tmp_path, """
        - hosts: all
          gather_facts: false
          tasks:
            - name: hostname
              ansible.builtin.command: cat /etc/hostname
              changed_when: false
    """, inventory=str(inventory), env={"ANSIBLE_PYTHON_INTERPRETER": "/usr/bin/python3"})
    assert run.rc == 0, run
    by_host = dict((r["host"], r["result"]) for r in run.records if r["task"] == "hostname")
    assert sorted(by_host) == ["%s-a-1" % prefix, "%s-a-2" % prefix]
    for host, result in by_host.items():
        assert result["stdout"] == host


def test_the_inventory_loads_the_connection_before_the_workers_fork(plane, tmp_path, fleet):
    """Each task's worker inherits the agent connection loaded by the inventory, in ansible-playbook itself."""
    prefix, _made = fleet
    inventory = tmp_path / "one.microvm_sessions.yml"
    inventory.write_text("plugin: microvm.sandbox.sessions\nname_regex: '^%s-a-1$'\n" % prefix)
    play = """
        - hosts: all
          gather_facts: false
          tasks:
            - ansible.builtin.command: "true"
              changed_when: false
            - ansible.builtin.command: "true"
              changed_when: false
    """
    run = run_playbook(plane, tmp_path, play, inventory=str(inventory), args=["-vvvv"],
                       env={"ANSIBLE_PYTHON_INTERPRETER": "/usr/bin/python3"})
    assert run.rc == 0, run
    assert run.stdout.count("microvm.sandbox.agent: loaded before this worker was forked") == 2, run.stdout[-3000:]


def test_a_play_that_starts_its_session_loads_the_connection_before_the_workers_fork(plane, tmp_path, fleet):
    """The strategy loads the session action in ansible-playbook itself: the connection comes with it."""
    prefix, _made = fleet
    run = run_playbook(plane, tmp_path, """
        - hosts: localhost
          gather_facts: false
          tasks:
            - microvm.sandbox.session: {name: "%s-a-1", state: running}
              register: sandbox
            - ansible.builtin.add_host:
                name: box
                ansible_connection: microvm.sandbox.agent
                ansible_host: "{{ sandbox.session.session_id }}"
                ansible_python_interpreter: /usr/bin/python3
        - hosts: box
          gather_facts: false
          tasks:
            - ansible.builtin.command: "true"
              changed_when: false
    """ % prefix, args=["-vvvv"])
    assert run.rc == 0, run
    in_the_session = run.stdout.split("TASK [ansible.builtin.command]")[-1]
    assert "microvm.sandbox.agent: loaded before this worker was forked" in in_the_session, in_the_session[-3000:]
