"""pytest plugin: a real local control plane (or the real platform) for the suites that need one.

Fixtures:
- `plane` (session scope): a `serve` subprocess on a free loopback port with a
  temporary state dir, torn down with every guest at the end. With
  MICROVM_LIVE=1 and DO_AGENTS_API_URL / DO_AGENTS_API_TOKEN set, it points at
  the real platform instead and starts nothing.
- `sandbox` (function scope): a READY session with a unique name (from the plane's warm pool), deleted after.

The road: with MICROVM_TEST_TRANSPORT=api (`make integration-api`) every playbook a suite runs with
`plane.env` goes over `transport: api`, for a team WITHOUT interactive stdin (the platform's default: buffered
exec only) and the agent port closed (`team_defaults()`); a test marked `@pytest.mark.agent_road("why")` is skipped there, naming why.
Otherwise `plane.env` says `transport: agent` (not the default, auto, which would take the api road if the agent
broke); the default road has its own tests (test_transport_auto.py).
"""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

import microvm_localplane
from microvm_localplane import contract

START_TIMEOUT = 60
TRANSPORTS = ("agent", "api")


def run_transport():
    """The road the suites run on: MICROVM_TEST_TRANSPORT, agent unless it says api."""
    road = os.environ.get("MICROVM_TEST_TRANSPORT", "") or "agent"
    if road not in TRANSPORTS:
        raise pytest.UsageError("MICROVM_TEST_TRANSPORT must be agent or api, got %r" % road)
    return road


def team_defaults():
    """The local plane's team switches for the run: on the api road, the agent port closed (what proves that road
    needs no agent port) and no interactive stdin (what the platform gives a team by default); on the agent road,
    the plane's defaults. The exec clamp is the documented 240 s on both."""
    if run_transport() == "api":
        return {"interactive_stdin": False, "closed_ports": [contract.AGENT_PORT], "exec_max_timeout": contract.EXEC_MAX_TIMEOUT,
                "throttle": None}
    return {"interactive_stdin": False, "closed_ports": [], "exec_max_timeout": contract.EXEC_MAX_TIMEOUT, "throttle": None}


@contextlib.contextmanager
def team(plane, **values):
    """The local plane's team switches (interactive stdin, closed guest ports) for one test, then the run's again."""
    from microvm_localplane import dataplane
    dataplane.write_settings(plane.state_dir, **values)
    try:
        yield
    finally:
        dataplane.write_settings(plane.state_dir, **team_defaults())


def pytest_configure(config):
    config.addinivalue_line("markers", "agent_road(reason): needs the agent road (skipped on the api road, naming "
                                       "the reason)")


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("agent_road")
    if mark is not None and run_transport() == "api":
        pytest.skip("agent road only: %s" % (mark.args[0] if mark.args else "it needs the gRPC agent"))


class PlaneHandle:
    """Where a control plane answers: .url, .token, .state_dir (None when live), .env, .client()."""

    def __init__(self, url, token, state_dir=None, process=None, live=False):
        self.url = url
        self.token = token
        self.state_dir = state_dir
        self.process = process
        self.live = live
        self.env = {contract.API_URL_ENV: url, contract.API_TOKEN_ENV: token}

    def __repr__(self):
        return "PlaneHandle(%r, live=%r, token=<hidden>)" % (self.url, self.live)

    def client(self, **kwargs):
        from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient
        return ApiClient(self.url, self.token, **kwargs)

    def ws_url(self, session_id, port, prefix=contract.PREFIXES[0]):
        base = self.url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return "%s%s/sessions/%s/port-forward/%d" % (base.rstrip("/"), prefix, session_id, port)

    @property
    def auth_headers(self):
        return {"Authorization": "Bearer " + self.token}


def live_requested():
    return os.environ.get("MICROVM_LIVE") == "1"


def localplane_cache():
    """The base rootfs cache every plane of a test run shares: the Makefile's MICROVM_LOCALPLANE_CACHE, else the
    `localplane` dir of the machine's shared cache (hack/cached_venv.py's cache_root, the one rule)."""
    if os.environ.get("MICROVM_LOCALPLANE_CACHE"):
        return os.environ["MICROVM_LOCALPLANE_CACHE"]
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hack",
                        "cached_venv.py")
    spec = importlib.util.spec_from_file_location("microvm_cached_venv", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return os.path.join(module.cache_root(), "localplane")


def start_local_plane(state_dir, token=None, extra_env=None):
    """Start `serve` on a free port; returns a PlaneHandle once it answers."""
    from microvm_localplane.cli import answers, read_info

    token = token or contract.new_token()
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(microvm_localplane.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in sys.path if p and os.path.isdir(p)])
    env["MICROVM_LOCALPLANE_TOKEN"] = token  # via env, so the token is not in the process list
    # Every plane a test run starts shares one cache: the base template's rootfs is built once (per machine: the
    # shared cache of every clone, as the Makefile's MICROVM_LOCALPLANE_CACHE).
    env.setdefault("MICROVM_LOCALPLANE_CACHE", localplane_cache())
    # The names the documentation's examples allow as egress resolve, as they would for a reader (netns.HOSTS_FILE_ENV).
    env.setdefault("MICROVM_LOCALPLANE_HOSTS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "example-hosts"))
    env.update(extra_env or {})
    log = open(os.path.join(state_dir, "plane.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "microvm_localplane", "serve", "--listen", "127.0.0.1:0",
                             "--state-dir", state_dir, "--no-print-token"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    log.close()
    deadline = time.time() + START_TIMEOUT
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the local control plane exited with %s:\n%s" % (proc.returncode, tail(state_dir)))
        info = read_info(state_dir)
        if info and info.get("pid") == proc.pid and answers(info["url"], token):
            return PlaneHandle(info["url"], token, state_dir, proc)
        time.sleep(0.05)
    stop_local_plane(PlaneHandle("", token, state_dir, proc))
    raise RuntimeError("the local control plane did not answer within %ds:\n%s" % (START_TIMEOUT, tail(state_dir)))


def tail(state_dir, size=4000):
    with contextlib.suppress(OSError), open(os.path.join(state_dir, "plane.log"), "rb") as f:
        return f.read()[-size:].decode("utf-8", "replace")
    return ""


def stop_local_plane(handle, timeout=60):
    """SIGTERM (the plane stops its guests), then SIGKILL the whole process group: nothing is left behind."""
    proc = handle.process
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


@pytest.fixture(scope="session")
def plane():
    if live_requested():
        url, token = os.environ.get(contract.API_URL_ENV), os.environ.get(contract.API_TOKEN_ENV)
        if not url or not token:
            pytest.skip("MICROVM_LIVE=1 needs %s and %s" % (contract.API_URL_ENV, contract.API_TOKEN_ENV))
        yield PlaneHandle(url, token, live=True)
        return
    state_dir = tempfile.mkdtemp(prefix="mvlp-test-")
    handle = start_local_plane(state_dir)
    if run_transport() == "api":
        from microvm_localplane import dataplane
        dataplane.write_settings(state_dir, **team_defaults())
        handle.env["MICROVM_TRANSPORT"] = "api"
    else:
        # The agent road's suites say so: the default, auto, would run them on the api road if the agent broke.
        handle.env["MICROVM_TRANSPORT"] = "agent"
    # One plane per pytest worker (this fixture is per process), and its own mux dir for the playbooks that name
    # none: workers share no multiplexer, and the ones this run started are stopped with it.
    mux_dir = os.path.join(state_dir, "mux")
    handle.env["MICROVM_MUX_DIR"] = mux_dir
    handle.env["MICROVM_PAYLOAD_CACHE"] = os.path.join(state_dir, "payloads")  # not the user's own (core_compat A10)
    try:
        yield handle
    finally:
        stop_muxes(mux_dir)
        stop_local_plane(handle)
        if os.environ.get("MICROVM_KEEP_STATE") != "1":
            shutil.rmtree(state_dir, ignore_errors=True)


MUX_MODULE = b"ansible_collections.microvm.sandbox.plugins.plugin_utils._mux.server"


def mux_pids(mux_dir):
    """The collection's live multiplexers whose pid files are under mux_dir (a pid counts only if it is still a mux)."""
    import glob
    pids = []
    for pid_file in glob.glob(os.path.join(mux_dir, "*", "mux.pid")):
        try:
            pid = int(open(pid_file).read())
            with open("/proc/%d/cmdline" % pid, "rb") as f:
                if MUX_MODULE in f.read():
                    pids.append(pid)
        except (OSError, ValueError):
            pass
    return pids


def stop_muxes(mux_dir):
    """SIGTERM the multiplexers a test or bench started with MICROVM_MUX_DIR=mux_dir."""
    for pid in mux_pids(mux_dir):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)


def unique_name(prefix="t"):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:10])


@pytest.fixture
def sandbox(plane):
    """A READY session (REST object as a dict), deleted after the test.

    From the plane's warm pool (`keep_warm`): a pooled guest is booted exactly like a session's and never shared
    (warmpool.py), so a test that does not test the boot itself need not wait for one; the pool boots the next
    guests while the test runs.
    """
    client = plane.client()
    session = client.create_session({"name": unique_name("sbx"), "agent": "custom", "keep_warm": True})
    try:
        yield client.wait_session(session["session_id"], timeout=120)
    finally:
        from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
        with contextlib.suppress(ApiError):
            client.delete_session(session["session_id"])
