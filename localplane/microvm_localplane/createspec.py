"""Validate the flat session create body exactly as strictly as the platform does."""
from . import contract
from .httputil import ApiFailure


def parse_create(doc):
    """Return a normalized spec dict from a create body (already checked for unknown keys)."""
    name = doc.get("name")
    problem = contract.name_problem(name)
    if problem:
        raise ApiFailure(400, problem)

    agent = doc.get("agent", contract.AGENT_NONE)
    if agent != contract.AGENT_NONE:
        raise ApiFailure(400, "agent %r is not available on the local control plane: only agent: none "
                              "(a bare sandbox) is supported here" % (agent,))

    template = doc.get("template", contract.DEFAULT_TEMPLATE)
    if template is None:
        template = contract.DEFAULT_TEMPLATE
    if not isinstance(template, str) or not template:
        raise ApiFailure(400, "template must be a template name (a string), got %r" % (template,))

    size = doc.get("size", contract.DEFAULT_SIZE)
    if size is None:
        size = contract.DEFAULT_SIZE
    if not isinstance(size, str) or not contract.SIZE_RE.match(size):
        raise ApiFailure(400, "size must be a size slug such as %r, got %r" % (contract.DEFAULT_SIZE, size))

    idle = contract.DEFAULT_IDLE_TIMEOUT_SECONDS
    if doc.get("idle_timeout") is not None:
        raw = doc["idle_timeout"]
        seconds = contract.parse_duration(raw) if isinstance(raw, str) else None
        if seconds is None:
            raise ApiFailure(400, "idle_timeout must be a duration string such as \"600s\" or \"10m\", got %r" % (raw,))
        if seconds != int(seconds) or not contract.MIN_IDLE_TIMEOUT_SECONDS <= seconds <= contract.MAX_IDLE_TIMEOUT_SECONDS:
            raise ApiFailure(400, "idle_timeout %r must be a whole number of seconds between %ds and %ds" % (
                raw, contract.MIN_IDLE_TIMEOUT_SECONDS, contract.MAX_IDLE_TIMEOUT_SECONDS))
        idle = int(seconds)

    env = doc.get("env") or {}
    if not isinstance(env, dict):
        raise ApiFailure(400, "env must be a map of strings, got %s" % type(env).__name__)
    if len(env) > contract.MAX_ENV_ENTRIES:
        raise ApiFailure(400, "env has %d entries; at most %d are accepted" % (len(env), contract.MAX_ENV_ENTRIES))
    for k, v in env.items():
        if not isinstance(k, str) or not contract.ENV_KEY_RE.match(k):
            raise ApiFailure(400, "env key %r is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)" % (k,))
        if not isinstance(v, str):
            raise ApiFailure(400, "env value of %s must be a string, got %s %r (quote it)" % (k, type(v).__name__, v))
        if "\x00" in v:
            raise ApiFailure(400, "env value of %s contains a NUL byte" % k)

    egress = doc.get("egress")
    if egress is None or egress == contract.EGRESS_UNRESTRICTED:
        egress = None
    elif isinstance(egress, list):
        if len(egress) > contract.MAX_EGRESS_HOSTS:
            raise ApiFailure(400, "egress lists %d hosts; at most %d are accepted" % (len(egress), contract.MAX_EGRESS_HOSTS))
        for host in egress:
            if not isinstance(host, str) or not contract.HOST_RE.match(host):
                raise ApiFailure(400, "egress entry %r is not a host name" % (host,))
        egress = [h.lower() for h in egress]
    else:
        raise ApiFailure(400, "egress must be omitted, \"unrestricted\" or a list of hosts, got %r" % (egress,))

    return {"name": name, "template": template, "size_slug": size, "idle_timeout_seconds": idle,
            "env": dict(env), "egress": egress}
