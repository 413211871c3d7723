"""Environment Configs: a saved environment spec that sessions start from (How to Use Environment Configs).

Documented (pydo create_config; doctl harness-runtime config; the Harness Runtime MCP tools): create takes
{name, manifest_yaml, insights?}: a name case-insensitively unique among the team's active configs (1-64
characters) and the environment-spec YAML (at most 512 KiB); configs are immutable; list (paginated, a
case-insensitive `search` on the name, manifests not returned), get, delete (refused while sessions started
from the config are still active). A session starts from one with the JSON create {name, config_id}, and
only such a session can hold a persistent workspace.

The object (pydo get_config and list_configs response examples): get and create answer {"config": {id, name,
agentspec_schema_version, content_hash, created_by, created_at, updated_at, credentials}}, credentials being the
redacted slot metadata (name, source, provider; never a value); list items carry region instead of credentials.
Delete is a soft delete (pydo delete_config): the name is released and the config leaves the list, while
sessions created from it keep a resolvable config_id.

Records share the store's configs (a YAML session create saves one for its session too, without a name:
those are not listed). Decisions where the docs are silent: agentspec_schema_version is "flat" for the flat
spec (the documented value, agents.digitalocean.com/v1alpha1, names the legacy envelope, which the local plane
refuses); content_hash is the sha256 of the manifest text; created_by is "local"; a secret's slot is
{name, source: "tenantSecret", provider: ""}; the manifest is never echoed (it may hold secrets; the platform
shows a sanitized one); a session cannot start from a deleted config (404).
"""
import hashlib
import uuid

from . import contract
from .createspec import parse_create
from .httputil import ApiFailure, now_rfc3339, parse_body, refuse_unknown

CREATE_KEYS = frozenset(["name", "manifest_yaml", "insights"])
INSIGHTS_KEYS = frozenset(["metrics", "logs", "traces"])
MAX_NAME_CHARS = 64
MAX_MANIFEST_BYTES = 512 * 1024
MAX_SEARCH_CHARS = 64
SCHEMA_VERSION = "flat"
CREATED_BY = "local"
SECRET_SOURCE = "tenantSecret"


def public_view(rec: dict) -> dict:
    """The config as get and create answer it."""
    secrets = sorted((rec.get("spec") or {}).get("secrets") or {})
    return {"id": rec["config_id"], "name": rec.get("name") or "",
            "agentspec_schema_version": rec.get("schema_version") or SCHEMA_VERSION,
            "content_hash": rec.get("content_hash") or "", "created_by": rec.get("created_by") or CREATED_BY,
            "created_at": rec.get("created_at") or "", "updated_at": rec.get("created_at") or "",
            "credentials": [{"name": k, "source": SECRET_SOURCE, "provider": ""} for k in secrets]}


def list_view(rec: dict) -> dict:
    """A list item: lightweight metadata, region instead of credentials (list_configs)."""
    out = public_view(rec)
    del out["credentials"]
    out["region"] = contract.REGION
    return out


class Configs:
    def __init__(self, store, sessions):
        self.store = store
        self.sessions = sessions

    def named(self) -> list:
        """The team's saved configs (those a YAML session create made for itself have no name)."""
        return sorted((r for r in self.store.configs.values() if r.get("name") and not r.get("deleted")),
                      key=lambda r: (r["created_at"], r["config_id"]), reverse=True)

    def listing(self, search: str = "") -> list:
        """Newest first; soft-deleted configs are excluded."""
        if len(search) > MAX_SEARCH_CHARS:
            raise ApiFailure(400, "search is at most %d characters" % MAX_SEARCH_CHARS)
        low = search.lower()
        return [r for r in self.named() if low in r["name"].lower()]

    def get(self, config_id: str) -> dict:
        rec = self.store.configs.get((config_id or "").lower())
        if rec is None:
            raise ApiFailure(404, "config %r not found (give its id)" % (config_id or "")[:100])
        return rec

    def create(self, doc: dict, prefix: str = contract.DEFAULT_PREFIX) -> dict:
        name = doc.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS or not name.isprintable():
            raise ApiFailure(400, "name is required: a config name of 1 to %d printable characters" % MAX_NAME_CHARS)
        if any(r["name"].lower() == name.lower() for r in self.named()):
            raise ApiFailure(409, "a config named %r already exists (names are unique, case-insensitively; configs "
                                  "are immutable: create one with a new name to change the manifest)" % name)
        manifest = doc.get("manifest_yaml")
        if not isinstance(manifest, str) or not manifest.strip():
            raise ApiFailure(400, "manifest_yaml is required: the environment spec as YAML text")
        if len(manifest.encode("utf-8")) > MAX_MANIFEST_BYTES:
            raise ApiFailure(400, "manifest_yaml is %d bytes; at most %d are accepted"
                             % (len(manifest.encode("utf-8")), MAX_MANIFEST_BYTES))
        insights = doc.get("insights")
        if insights is not None:
            if not isinstance(insights, dict):
                raise ApiFailure(400, "insights must be a mapping of metrics, logs and traces (true, false or null)")
            refuse_unknown(insights, INSIGHTS_KEYS, "insights")
            bad = sorted(k for k, v in insights.items() if v is not None and not isinstance(v, bool))
            if bad:
                raise ApiFailure(400, "insights.%s must be true, false or null" % bad[0])
        spec_doc = parse_body(manifest.encode("utf-8"), "application/yaml", "manifest_yaml")
        if contract.LEGACY_ENVELOPE_KEY in spec_doc:
            raise ApiFailure(400, "manifest_yaml: a top-level %s selects the deprecated legacy envelope, which the "
                                  "local control plane does not take: give the flat spec" % contract.LEGACY_ENVELOPE_KEY)
        refuse_unknown(spec_doc, contract.CREATE_KEYS | contract.DOCUMENTED_UNSUPPORTED_KEYS, "manifest_yaml")
        spec = parse_create(spec_doc, prefix)
        # The templates of the spec must exist now, as they must for a session create.
        self.sessions.templates.rootfs_for_session(spec["template"])
        rec = {"config_id": str(uuid.uuid4()), "name": name, "spec": spec, "schema_version": SCHEMA_VERSION,
               "content_hash": hashlib.sha256(manifest.encode("utf-8")).hexdigest(), "created_by": CREATED_BY,
               "created_at": now_rfc3339(), "insights": insights or {}}
        self.store.save_config(rec)
        return rec

    def delete(self, rec: dict) -> None:
        active = [r["session_id"] for r in self.store.sessions.values()
                  if r.get("config_id") == rec["config_id"] and r["status"] not in contract.GONE]
        if active:
            raise ApiFailure(409, "config %s still has %d active session%s (%s): delete is blocked until they are "
                                  "removed" % (rec["config_id"], len(active), "" if len(active) == 1 else "s",
                                               ", ".join(sorted(active)[:5])))
        if rec.get("name"):
            # A soft delete: the name is free again, and sessions created from it keep a resolvable config_id.
            self.store.save_config(dict(rec, deleted=True))
        else:
            self.store.forget_config(rec["config_id"])
