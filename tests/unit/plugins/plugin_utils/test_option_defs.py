"""option_defs: the connection's options, parsed with libyaml, are exactly what ansible-core's own parse gives."""
import pytest
import yaml

from ansible import constants as C
from ansible.parsing.yaml.loader import AnsibleLoader
from ansible.utils.plugin_docs import add_fragments
from ansible.plugins.loader import connection_loader, fragment_loader

from ansible_collections.microvm.sandbox.plugins.connection import agent
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import option_defs

FQCN = "microvm.sandbox.agent"
CORE_NAME = agent.__name__  # core files a collection plugin's options under its module name


def core_options(documentation, path):
    doc = yaml.load(documentation, Loader=AnsibleLoader)
    add_fragments(doc, path, fragment_loader=fragment_loader, is_module=False)
    return doc["options"]


def test_fast_parse_equals_core_parse():
    fast = option_defs.parsed_options(agent.DOCUMENTATION)
    assert fast is not None
    assert fast == core_options(agent.DOCUMENTATION, agent.__file__)
    assert set(fast) >= {"api_url", "api_token", "warm_runner", "scratch_dir"}


def test_importing_the_plugin_defined_its_options():
    assert CORE_NAME == "ansible_collections.microvm.sandbox.plugins.connection.agent"
    assert C.config.has_configuration_definition("connection", CORE_NAME)
    expected = core_options(agent.DOCUMENTATION, agent.__file__)
    assert C.config.get_configuration_definitions("connection", CORE_NAME) == expected
    # core finds them under the name it loads the plugin by, and does not parse DOCUMENTATION again
    calls = []
    original = connection_loader._load_config_defs
    connection_loader._load_config_defs = lambda name, module, path: calls.append(name) or original(name, module, path)
    try:
        assert connection_loader.get(FQCN, class_only=True) is not None
    finally:
        connection_loader._load_config_defs = original
    assert calls in ([CORE_NAME], [])


def test_registered_once_and_core_keeps_what_it_has():
    assert option_defs.register("connection", CORE_NAME, agent.DOCUMENTATION) is False  # already defined


@pytest.mark.parametrize("doc", [
    "options:\n  x:\n    default: '{{ lookup(\"env\", \"HOME\") }}'\n",   # a template core must mark trusted
    "extends_documentation_fragment: [microvm.sandbox.api]\noptions:\n  x: {}\n",  # fragments core must merge
    "short_description: no options\n",
    "- not a mapping\n",
])
def test_unusual_documentation_is_left_to_core(doc):
    assert option_defs.parsed_options(doc) is None
    assert option_defs.register("connection", "microvm.sandbox.test_%d" % abs(hash(doc)), doc) is False


def test_the_first_worker_parses_the_others_read_the_runs_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "DEFAULT_LOCAL_TMP", str(tmp_path))
    first = option_defs.cached_options(agent.DOCUMENTATION)
    assert first == option_defs.parsed_options(agent.DOCUMENTATION)
    (cache,) = tmp_path.glob("microvm-options-*.json")
    monkeypatch.setattr(option_defs, "parsed_options", lambda doc: pytest.fail("parsed again"))
    assert option_defs.cached_options(agent.DOCUMENTATION) == first
    cache.write_text("{not json")  # a damaged copy is parsed anew, never trusted
    monkeypatch.undo()
    monkeypatch.setattr(C, "DEFAULT_LOCAL_TMP", str(tmp_path))
    assert option_defs.cached_options(agent.DOCUMENTATION) == first
