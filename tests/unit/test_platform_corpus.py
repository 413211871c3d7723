"""The corpus of documented examples is well formed, and the loader refuses a malformed file by name."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))

import platform_corpus as pc  # noqa: E402


def test_every_example_names_its_page_and_routes_to_its_own_operation():
    examples = pc.load()
    for ex in examples:
        assert ex.source["page"].startswith("https://"), ex.file
        if ex.status >= 400:
            continue
        concrete = ex.route.replace("{session_id}", "sess_abc123").replace("{checkpoint_id}", "cp_9f2c1a4b") \
            .replace("{template_id}", "t1").replace("{build_id}", "b1")
        assert pc.match(examples, ex.method, concrete)[0] == ex.operation, ex.file


def test_the_sizes_route_is_not_a_session_named_sandbox():
    assert pc.match(pc.load(), "GET", "/sessions/sandbox/sizes")[0] == "sessions.list_sizes"


def test_key_differences_name_both_directions_and_recurse():
    documented = {"a": 1, "items": [{"x": 1, "y": {"z": 1}}]}
    assert pc.key_differences(documented, {"a": 2, "items": [{"x": 1, "y": {"z": 2}}]}) == []
    problems = pc.key_differences(documented, {"a": 1, "b": 2, "items": [{"y": {"z": 1, "w": 0}}]})
    assert problems == ["body: key 'b' is not documented", "body.items[0]: documented key 'x' is missing",
                        "body.items[0].y: key 'w' is not documented"]


@pytest.mark.parametrize("name, doc, word", [
    ("sessions.get.json", {}, "named"),
    ("sessions.get.1.json", {"source": {}, "operation": "sessions.get", "request": {}, "response": {}}, "source.page"),
    ("sessions.get.1.json", {"source": {"page": "p", "version": "v", "date": "d"}, "operation": "sessions.list",
                             "request": {"path": "/v2/agents/sessions"}, "response": {}}, "does not match"),
    ("sessions.get.1.json", {"source": {"page": "p", "version": "v", "date": "d"}, "operation": "sessions.get",
                             "request": {"path": "/v1/sessions"}, "response": {}}, "no documented prefix"),
])
def test_a_malformed_file_is_refused_by_name(tmp_path, name, doc, word):
    (tmp_path / name).write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=word):
        pc.load(str(tmp_path))
