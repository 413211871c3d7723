"""The November 2026 documentation's rules in the client's pure helpers (agent_kind names, list filters, errors)."""
import pytest

from ansible_collections.microvm.sandbox.plugins.module_utils import profile, rest
from ansible_collections.microvm.sandbox.plugins.module_utils.views import agent_kind, same_adapter


@pytest.mark.parametrize("kind, adapter", [
    ("AGENT_KIND_CODEX_CLI", "codex"), ("AGENT_KIND_CODEX", "codex"), ("AGENT_KIND_OPENAI_CODEX", "codex-agentapi"),
    ("AGENT_KIND_CUSTOM", "custom"), ("AGENT_KIND_CLAUDE_CODE", "claude-code"), ("AGENT_KIND_UNSPECIFIED", "codex"),
    ("", "custom"),
])
def test_the_sdks_agent_kind_names_match_their_adapter(kind, adapter):
    assert same_adapter(kind, adapter)


@pytest.mark.parametrize("kind, adapter", [
    ("AGENT_KIND_CODEX_CLI", "custom"), ("AGENT_KIND_OPENAI_CODEX", "codex"), ("AGENT_KIND_CUSTOM", "codex"),
])
def test_other_adapters_differ(kind, adapter):
    assert not same_adapter(kind, adapter)


def test_the_predicted_kind_is_the_sdks_name():
    assert agent_kind("codex") == "AGENT_KIND_CODEX_CLI"
    assert agent_kind("codex-agentapi") == "AGENT_KIND_OPENAI_CODEX"
    assert agent_kind("custom") == "AGENT_KIND_CUSTOM"


@pytest.mark.parametrize("statuses, query", [
    (None, None),  # the platform's default listing
    (frozenset(["READY", "DETACHED"]), None),
    (frozenset(["FAILED"]), "SESSION_STATUS_FAILED"),
    (frozenset(["READY", "FAILED"]), "SESSION_STATUS_ALL"),
    (frozenset(["DESTROYING", "DESTROYED", "FAILED"]), "SESSION_STATUS_ALL"),
])
def test_the_list_asks_for_hidden_statuses(statuses, query):
    assert profile.list_status_filter(statuses) == query


def test_the_documented_error_body_keeps_its_request_id():
    body = {"id": "not_found", "message": "The resource you were accessing could not be found.",
            "request_id": "4851a473-1621-42ea-b2f9-5071c0ea8414"}
    assert rest.error_message(body) == ("The resource you were accessing could not be found. "
                                        "(request_id 4851a473-1621-42ea-b2f9-5071c0ea8414)")
    assert rest.error_message({"error": {"code": 404, "message": "gone"}}) == "gone"


def test_the_token_names_in_order():
    assert profile.API_TOKEN_ENVS == ("DO_AGENTS_API_TOKEN", "DIGITALOCEAN_TOKEN", "DIGITALOCEAN_ACCESS_TOKEN")
    assert profile.DEFAULT_PREFIX == "/v2/harness-runtime"
