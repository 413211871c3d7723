"""spec_yaml: the environment spec as YAML that parses back to exactly the same values, whatever they hold."""
import pytest
import yaml

from ansible_collections.microvm.sandbox.plugins.module_utils import spec_yaml

TRICKY = ["yes", "no", "null", "~", "010", "0x1f", "1e3", "true", "", " leading", "trailing ", "a: b", "- x",
          "# not a comment", "{braces}", "[list]", "quote\"s and \\backslash", "tab\there", "line\nbreak",
          "crlf\r\n", "nul\x00byte", "bell\x07", "del\x7f", "nel\x85", "nbsp\xa0", "ünïcödé", "emoji \U0001F600",
          "line sep\u2028para sep\u2029", "bom\ufeff", "c1\x9b", "${ANTHROPIC_API_KEY}", "{{ not_a_template }}",
          "*alias", "&anchor", "!tag", "%directive", "@at", "`tick`", "'single'", "---", "..."]


@pytest.mark.parametrize("value", TRICKY)
def test_every_string_round_trips(value):
    doc = {"name": "x", "env": {"V": value}, "egress": [value], "template": value}
    assert yaml.safe_load(spec_yaml.dump(doc)) == doc


def test_types_and_nesting_round_trip():
    doc = {"name": "n", "persistent_workspace": True, "flag": False, "count": 3, "ratio": 0.5, "none": None,
           "empty_map": {}, "empty_list": [], "repos": ["org/a", "org/b"],
           "nested": [{"a": "1", "b": ["x", {"c": "d"}]}, "plain"], "env": {"A": "1", "B": "two words"}}
    assert yaml.safe_load(spec_yaml.dump(doc)) == doc


def test_block_style_and_no_json():
    text = spec_yaml.dump({"name": "n", "egress": ["a.example.com"]})
    assert text == '"name": "n"\n"egress":\n  - "a.example.com"\n'


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": object()}, {1: "a"}, ["not", "a", "mapping"]])
def test_what_a_spec_cannot_carry_is_refused(bad):
    with pytest.raises((TypeError, ValueError)):
        spec_yaml.dump(bad)
