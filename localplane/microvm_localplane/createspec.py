"""Validate the flat session create body (the environment spec) at least as strictly as the platform does."""
from . import contract
from .baseimage import ACCOUNT_PASSWORD_VARS
from .contract import SHOWN_MAX, shown
from .httputil import ApiFailure


def _string_map(doc, field):
    """env and secrets: a map of variable names to strings."""
    values = doc.get(field) or {}
    if not isinstance(values, dict):
        raise ApiFailure(400, "%s must be a map of strings, got %s" % (field, type(values).__name__))
    if len(values) > contract.MAX_ENV_ENTRIES:
        raise ApiFailure(400, "%s has %d entries; at most %d are accepted" % (field, len(values), contract.MAX_ENV_ENTRIES))
    for k, v in values.items():
        if not isinstance(k, str) or not contract.ENV_KEY_RE.match(k):
            raise ApiFailure(400, "%s key %s is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)" % (field, shown(k)))
        if not isinstance(v, str):
            # Never echo a secret's value.
            echoed = "" if field == "secrets" else " " + shown(v)
            raise ApiFailure(400, "%s value of %s must be a string, got %s%s (quote it)" % (field, k[:SHOWN_MAX], type(v).__name__, echoed))
        if "\x00" in v:
            raise ApiFailure(400, "%s value of %s contains a NUL byte" % (field, k[:SHOWN_MAX]))
        if k in dict(ACCOUNT_PASSWORD_VARS) and (not v or "\n" in v or "\r" in v):
            raise ApiFailure(400, "%s value of %s is a password of the guest's user %s: it must be one line, not empty"
                             % (field, k, dict(ACCOUNT_PASSWORD_VARS)[k]))
    return dict(values)


def parse_create(doc, prefix=contract.DEFAULT_PREFIX):
    """Return a normalized spec dict from a create body (already checked for unknown keys).

    `prefix` is the route prefix the request came in under: a refusal names routes under it.
    """
    unsupported = sorted(k for k in doc if k in contract.DOCUMENTED_UNSUPPORTED_KEYS)
    if unsupported:
        raise ApiFailure(400, "field%s %s configure%s an agent adapter, which the local control plane does not run: "
                              "remove %s" % ("s" if len(unsupported) > 1 else "", ", ".join(unsupported),
                                             "" if len(unsupported) > 1 else "s", "them" if len(unsupported) > 1 else "it"))
    name = doc.get("name")
    problem = contract.name_problem(name)
    if problem:
        raise ApiFailure(400, problem)

    agent = doc.get("agent")
    if agent is None:
        raise ApiFailure(400, "agent is required: one of %s (custom is a bare sandbox)" % ", ".join(contract.ADAPTERS))
    if agent not in contract.ADAPTERS:
        raise ApiFailure(400, "unknown agent %s: use one of %s" % (shown(agent), ", ".join(contract.ADAPTERS)))
    if agent not in contract.LOCAL_ADAPTERS:
        raise ApiFailure(400, "agent %r is a platform adapter the local control plane cannot run: use agent: custom "
                              "(a bare sandbox)" % (agent,))

    persistent = doc.get("persistent_workspace", False)
    if persistent is None:
        persistent = False
    if not isinstance(persistent, bool):
        raise ApiFailure(400, "persistent_workspace must be true or false, got %s" % (shown(persistent),))

    keep_warm = doc.get("keep_warm", False)
    if keep_warm is None:
        keep_warm = False
    if not isinstance(keep_warm, bool):
        raise ApiFailure(400, "keep_warm must be true or false, got %s" % (shown(keep_warm),))

    template = doc.get("template", contract.DEFAULT_TEMPLATE)
    if template is None:
        template = contract.DEFAULT_TEMPLATE
    if not isinstance(template, str) or not template:
        raise ApiFailure(400, "template must be a template name (a string), got %s" % (shown(template),))

    size = doc.get("size", contract.DEFAULT_SIZE)
    if size is None:
        size = contract.DEFAULT_SIZE
    if size not in contract.SIZE_SLUGS:
        # The catalog's route under the prefix the create came in on, the one the caller can list.
        raise ApiFailure(400, "unknown size %s: use a slug of GET %s%s (%s)"
                         % (shown(size), prefix, contract.SIZES_PATH, ", ".join(contract.SIZE_SLUGS)))

    idle = contract.DEFAULT_IDLE_TIMEOUT_SECONDS
    if doc.get("idle_timeout") is not None:
        raw = doc["idle_timeout"]
        seconds = contract.parse_duration(raw) if isinstance(raw, str) else None
        if seconds is None:
            raise ApiFailure(400, "idle_timeout must be a duration string such as \"600s\" or \"10m\", got %s" % (shown(raw),))
        if seconds != int(seconds) or not contract.MIN_IDLE_TIMEOUT_SECONDS <= seconds <= contract.MAX_IDLE_TIMEOUT_SECONDS:
            raise ApiFailure(400, "idle_timeout %s must be a whole number of seconds between %ds and %ds" % (
                shown(raw), contract.MIN_IDLE_TIMEOUT_SECONDS, contract.MAX_IDLE_TIMEOUT_SECONDS))
        idle = int(seconds)

    env = _string_map(doc, "env")
    secrets = _string_map(doc, "secrets")
    both = sorted(set(env) & set(secrets))
    if both:
        raise ApiFailure(400, "%s set in both env and secrets: give each variable once" % ", ".join(both))

    egress = doc.get("egress")
    if egress is None or egress == contract.EGRESS_UNRESTRICTED:
        egress = None
    elif isinstance(egress, list):
        if len(egress) > contract.MAX_EGRESS_HOSTS:
            raise ApiFailure(400, "egress lists %d hosts; at most %d are accepted" % (len(egress), contract.MAX_EGRESS_HOSTS))
        for host in egress:
            if not isinstance(host, str) or not contract.HOST_RE.match(host):
                raise ApiFailure(400, "egress entry %s is not a host name" % (shown(host),))
        egress = [h.lower() for h in egress]
    else:
        raise ApiFailure(400, "egress must be omitted, \"unrestricted\" or a list of hosts, got %s" % (shown(egress),))

    check_repos(doc.get("repos"))

    return {"name": name, "agent": agent, "template": template, "size_slug": size, "idle_timeout_seconds": idle,
            "persistent_workspace": persistent, "keep_warm": keep_warm, "env": env, "secrets": secrets, "egress": egress,
            "permissions": parse_permissions(doc.get("permissions"))}


def parse_permissions(value):
    """The spec's permission policy (Permission Policies page), with an omitted default resolved to `ask`.

    Decision: the local plane runs no agent adapter, so nothing consults the policy; like the platform on an
    unattended run, commands are not held. It is checked and kept, never silently dropped.
    """
    if value is None:
        return {"default": contract.PERMISSION_DEFAULT, "rules": []}
    if not isinstance(value, dict):
        raise ApiFailure(400, "permissions must be a mapping with default (allow, ask or deny) and rules, got %s"
                         % type(value).__name__)
    unknown = sorted(str(k) for k in value if k not in contract.PERMISSIONS_KEYS)
    if unknown:
        raise ApiFailure(400, "permissions: unknown field %s (known: default, rules)" % ", ".join(unknown))
    default = value.get("default")
    if default is None:
        default = contract.PERMISSION_DEFAULT
    if default not in contract.PERMISSION_DECISIONS:
        raise ApiFailure(400, "permissions.default %s: use one of %s" % (shown(default), ", ".join(contract.PERMISSION_DECISIONS)))
    rules = value.get("rules") or []
    if not isinstance(rules, list):
        raise ApiFailure(400, "permissions.rules must be a list of rules, got %s" % type(rules).__name__)
    for i, rule in enumerate(rules):
        if not isinstance(rule, dict) or rule.get("action") not in contract.PERMISSION_DECISIONS:
            raise ApiFailure(400, "permissions.rules[%d] needs an action: one of %s"
                             % (i, ", ".join(contract.PERMISSION_DECISIONS)))
    return {"default": default, "rules": rules}


def check_repos(repos):
    """`repos`: a list of GitHub owner/repo (Refactor a Repository), cloned by the platform at session start.

    The local plane checks the documented shape, then refuses any repository by name: it has no network to
    clone from, and pretending to would leave a sandbox without the code the spec asked for.
    """
    if repos is None or repos == []:
        return
    if not isinstance(repos, list):
        raise ApiFailure(400, "repos must be a list of GitHub repositories (owner/repo), got %s" % type(repos).__name__)
    for repo in repos:
        if not isinstance(repo, str) or not contract.REPO_RE.match(repo):
            raise ApiFailure(400, "repos entry %s is not a GitHub repository: use owner/repo, for example "
                                  "your-org/your-service" % (shown(repo),))
    raise ApiFailure(400, "repos (%s): the local control plane has no network to clone GitHub repositories from, "
                          "so it refuses them rather than start a sandbox without the code; remove repos and put the "
                          "code into the sandbox yourself (microvm.sandbox.sync, or a workspace archive)"
                     % ", ".join(repos))


def parse_config_form(doc):
    """The JSON create form {name, config_id} -> (name, config_id); both are required (doctl config start-session)."""
    name = doc.get("name")
    problem = contract.name_problem(name)
    if problem:
        raise ApiFailure(400, problem)
    config_id = doc.get("config_id")
    if not isinstance(config_id, str) or not config_id:
        raise ApiFailure(400, "config_id is required in the JSON create form {name, config_id}: the id of an "
                              "Environment Config (a session created from a YAML spec reports one)")
    return name, config_id
