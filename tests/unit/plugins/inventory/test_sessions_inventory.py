"""The sessions inventory plugin with the fake transport: naming, variables, filters, unsafe data."""
import pytest
import yaml

from ansible.errors import AnsibleError
from ansible.inventory.data import InventoryData
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar
from ansible.template import is_trusted_as_template, trust_as_template

from ansible_collections.microvm.sandbox.plugins.inventory import sessions as plugin_module
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiError
from microvm_fake_plane import FakeClient, FakePlane


@pytest.fixture
def plane(monkeypatch):
    plane = FakePlane()
    FakeClient.plane = plane
    monkeypatch.setattr(plugin_module, "ApiClient", FakeClient)
    return plane


# The plugin's documented defaults, and the constructed/cache options it extends.
DEFAULTS = dict(
    (name, spec.get("default")) for name, spec in yaml.safe_load(plugin_module.DOCUMENTATION)["options"].items())
DEFAULTS.update(api_url="https://api.digitalocean.com", api_token="t", route_prefix="/v2/harness-runtime",
                request_timeout=30.0, validate_certs=True, compose={}, groups={}, keyed_groups=[], strict=False,
                cache=False, use_extra_vars=False, leading_separator=True)


def build(tmp_path, config):
    """Run the plugin's selection and population with these options (no config file, no loader)."""
    options = dict(DEFAULTS, **(yaml.safe_load(config) or {}))
    inv = plugin_module.InventoryModule()
    inv.get_option = options.__getitem__
    data = InventoryData()
    inv.inventory = data
    inv.templar = Templar(loader=DataLoader())
    inv._populate(inv._select(inv._fetch()))
    return data


def hostvars(data, host):
    return data.get_host(host).get_vars()


def test_verify_file(tmp_path):
    inv = plugin_module.InventoryModule()
    good = tmp_path / "a.microvm_sessions.yml"
    bad = tmp_path / "a.yml"
    other = tmp_path / "hosts.yml"
    good.write_text("plugin: microvm.sandbox.sessions\n")
    bad.write_text("plugin: microvm.sandbox.sessions\n")
    other.write_text("all:\n  hosts:\n    web: {}\n")
    assert inv.verify_file(str(good))
    assert not inv.verify_file(str(other))
    # A file that names the plugin under the wrong name is taken, so that parse can name the suffix.
    assert inv.verify_file(str(bad))
    with pytest.raises(AnsibleError, match=r"\.microvm_sessions\.yml or \.microvm_sessions\.yaml.*a\.microvm_sessions\.yml"):
        inv.parse(InventoryData(), DataLoader(), str(bad))


def test_hosts_and_vars(tmp_path, plane):
    ready = plane.add_session("web-1")
    plane.add_session("web-2", status="PAUSED")
    plane.add_session("gone", status="DESTROYED")
    plane.add_session("boot", status="PROVISIONING")
    data = build(tmp_path, "api_url: http://plane:1\n")
    assert sorted(h for h in data.hosts) == ["web-1", "web-2"]  # default: usable + paused
    v = hostvars(data, "web-1")
    assert v["ansible_host"] == ready["session_id"]
    assert v["ansible_connection"] == "microvm.sandbox.agent"
    assert v["ansible_python_interpreter"] == "auto_silent"
    assert v["microvm_status"] == "READY" and v["microvm_name"] == "web-1"
    assert v["ansible_microvm_api_url"] == "http://plane:1"
    assert "ansible_microvm_route_prefix" not in v
    assert not any("token" in k for k in v)


def test_prefix_regex_status_and_var_prefix(tmp_path, plane):
    for name in ("ci-1", "ci-2", "dev-1"):
        plane.add_session(name)
    data = build(tmp_path, "name_prefix: ci-\nname_regex: '2$'\nstatuses: [READY]\nhost_var_prefix: mv_\n")
    assert list(data.hosts) == ["ci-2"]
    assert hostvars(data, "ci-2")["mv_status"] == "READY"


def test_duplicate_names_keep_the_live_one(tmp_path, plane):
    gone = plane.add_session("web", status="DESTROYED")
    live = plane.add_session("web")
    data = build(tmp_path, "statuses: [usable, gone]\n")
    assert hostvars(data, "web")["ansible_host"] == live["session_id"]
    assert "web_%s" % gone["session_id"] in data.hosts


def test_api_values_are_unsafe(tmp_path, plane):
    plane.add_session("web", repo_hint=trust_as_template("{{ 7 * 7 }}"))
    plane.add_session("{{ bad }}")
    data = build(tmp_path, "")
    value = hostvars(data, "web")["microvm_repo_hint"]
    assert value == "{{ 7 * 7 }}"
    # Even a value that arrived marked as trusted is stripped of that trust.
    assert not is_trusted_as_template(value)
    # An impossible name does not become a host name.
    assert "{{ bad }}" not in data.hosts


def test_bad_filter_and_api_errors(tmp_path, plane):
    with pytest.raises(AnsibleError, match="unknown session status 'sleepy'"):
        build(tmp_path, "statuses: [sleepy]\n")
    with pytest.raises(AnsibleError, match="bad filter"):
        build(tmp_path, "name_regex: '('\n")
    plane.fail_next.append(("GET", "/sessions", 401, "bad token"))
    with pytest.raises(AnsibleError, match="refused the API token") as e:
        build(tmp_path, "")
    # The error is worded once: ansible-core would append a chained cause's text to the message.
    assert isinstance(e.value.__context__, ApiError) and str(e.value.__context__) not in str(e.value)
