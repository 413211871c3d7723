"""HTTP plumbing shared by every route: the service error shape, strict bodies, paging tokens, times."""
import base64
import binascii
import datetime
import json
import uuid

import yaml
from aiohttp import web

from . import contract


class ApiFailure(Exception):
    """A refusal with the platform's status and a message meant for the caller."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


# The documented error model's `id` per status (DigitalOcean API: {id, message, request_id}).
ERROR_IDS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
             409: "conflict", 410: "gone", 413: "request_entity_too_large", 415: "unsupported_media_type",
             422: "unprocessable_entity", 429: "too_many_requests", 500: "server_error", 501: "not_implemented",
             503: "service_unavailable"}


def error_response(status, message):
    """The documented error body {id, message, request_id}."""
    return web.json_response({"id": ERROR_IDS.get(status, "error"), "message": message,
                              "request_id": str(uuid.uuid4())}, status=status)


def now_rfc3339():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def media_type(request):
    return (request.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()


async def read_limited(request, limit=contract.MAX_BODY_BYTES):
    """The raw body, refusing more than `limit` bytes with 413 before reading it all."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiFailure(413, "request body is %d bytes; at most %d bytes are accepted" % (request.content_length, limit))
    chunks, size = [], 0
    while True:
        chunk = await request.content.read(65536)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ApiFailure(413, "request body is larger than %d bytes" % limit)
        chunks.append(chunk)
    return b"".join(chunks)


class _TooManyNodes(Exception):
    pass


def _expanded_nodes(root: yaml.Node, limit: int) -> int:
    """How many nodes the document has once every alias is expanded (a shared node counts once per use).

    Sizes are memoized per node, so a billion-node alias bomb is counted in a few hundred steps; a node that
    contains itself (an anchor used inside its own value) would expand forever and is refused too.
    """
    sizes: dict = {}
    in_progress: set = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in in_progress:
            raise _TooManyNodes("an anchor is used inside its own value (a recursive alias)")
        in_progress.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = ()
        for child in children:
            total += size(child)
            if total > limit:
                raise _TooManyNodes("it expands to more than %d nodes once its aliases are expanded" % limit)
        in_progress.discard(key)
        sizes[key] = total
        return total

    return size(root)


def load_yaml(text: str, what: str):
    """yaml.safe_load with the expansion of aliases bounded (contract.MAX_YAML_NODES): nested anchors make a body
    of a few hundred bytes a structure of billions of nodes, which any later walk, copy or message would expand."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            _expanded_nodes(node, contract.MAX_YAML_NODES)
        except _TooManyNodes as e:
            raise ApiFailure(400, "%s body refused: %s (the limit is %d nodes; write the values out instead of "
                                  "using YAML anchors and aliases)" % (what, e, contract.MAX_YAML_NODES)) from e
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_constant(name):
    raise ValueError("%s is not JSON" % name)


def parse_body(raw, ctype, what):
    """The mapping in a body: YAML for the YAML media types, strict JSON for application/json."""
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiFailure(400, "%s body is not UTF-8 text" % what) from e
    if ctype == contract.JSON_TYPE:
        try:
            doc = json.loads(text, parse_constant=_refuse_constant)
        except RecursionError as e:
            raise ApiFailure(400, "malformed %s body: nested too deeply" % what) from e
        except ValueError as e:
            raise ApiFailure(400, "malformed %s body (JSON): %s" % (what, e)) from e
    else:
        try:
            doc = load_yaml(text, what)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = " at line %d column %d" % (mark.line + 1, mark.column + 1) if mark else ""
            raise ApiFailure(400, "malformed %s body%s: %s" % (what, where, getattr(e, "problem", None) or e)) from e
        except (RecursionError, ValueError, OverflowError) as e:
            raise ApiFailure(400, "malformed %s body: %s" % (what, type(e).__name__)) from e
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ApiFailure(400, "%s body must be a mapping, not %s" % (what, type(doc).__name__))
    return doc


def refuse_unknown(doc, allowed_keys, what, advice=""):
    unknown = sorted(str(k) for k in doc if k not in allowed_keys)
    if unknown:
        raise ApiFailure(400, "unknown field%s in %s body: %s (allowed: %s)%s" % (
            "s" if len(unknown) > 1 else "", what, ", ".join(unknown), ", ".join(sorted(allowed_keys)), advice))


async def read_document(request, allowed_keys, what, required_type=True):
    """A strict JSON mapping body (every call but the session create): unknown keys and wrong types are refused.

    An empty body is an empty mapping (the platform's `{}` calls).
    """
    ctype = media_type(request)
    raw = await read_limited(request)
    if ctype and ctype != contract.JSON_TYPE:
        raise ApiFailure(415, "unsupported content type %r for %s: send the body as application/json" % (ctype, what))
    if not ctype and raw.strip() and required_type:
        raise ApiFailure(415, "missing content type for %s: send the body as application/json" % what)
    doc = parse_body(raw, contract.JSON_TYPE, what)
    refuse_unknown(doc, allowed_keys, what)
    return doc


async def read_create(request, spec_keys):
    """The session create body -> ("spec", doc) for the YAML environment spec, ("config", doc) for JSON.

    The two forms are mutually exclusive and chosen by Content-Type (harness-create-session): a flat spec sent
    as JSON is refused naming its first spec key, as the JSON form's strict decoding would.
    """
    ctype = media_type(request)
    if ctype not in contract.CREATE_YAML_TYPES and ctype != contract.JSON_TYPE:
        raise ApiFailure(415, "unsupported content type %r: send the environment spec as YAML (%s), or "
                              "{name, config_id} as application/json" % (
                                  ctype, ", ".join(sorted(contract.CREATE_YAML_TYPES))))
    raw = await read_limited(request)
    if ctype == contract.JSON_TYPE:
        doc = parse_body(raw, ctype, "session create (JSON form)")
        refuse_unknown(doc, contract.CREATE_CONFIG_KEYS, "session create (JSON form)",
                       ". The JSON form is {name, config_id}; send the environment spec as YAML "
                       "(Content-Type: application/yaml)")
        return "config", doc
    doc = parse_body(raw, ctype, "session create")
    if contract.LEGACY_ENVELOPE_KEY in doc:
        raise ApiFailure(400, "a top-level %s selects the legacy agents.digitalocean.com/v1alpha1 envelope, which is "
                              "deprecated and which the local control plane does not take: send the flat spec "
                              "(name, agent, size, ...)" % contract.LEGACY_ENVELOPE_KEY)
    refuse_unknown(doc, spec_keys, "session create")
    return "spec", doc


def query_bool(request, name):
    """A boolean query parameter (absent = False); anything but a boolean is a 400 naming it."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return False
    if raw in contract.QUERY_TRUE:
        return True
    if raw in contract.QUERY_FALSE:
        return False
    raise ApiFailure(400, "query parameter %s must be true or false, got %r" % (name, raw[:40]))


# -- paging -------------------------------------------------------------------
def page_size(request):
    raw = request.query.get("page_size", "")
    if raw == "":
        return contract.DEFAULT_PAGE_SIZE
    try:
        n = int(raw)
    except ValueError as e:
        raise ApiFailure(400, "page_size must be a positive integer, got %r" % raw) from e
    if n <= 0:  # clamped, not refused, like the platform's own bounds
        return contract.DEFAULT_PAGE_SIZE
    return min(n, contract.MAX_PAGE_SIZE)


def encode_page_token(offset, scope):
    data = json.dumps({"o": offset, "s": scope}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def decode_page_token(token, scope):
    """Offset from an opaque token; a token from another listing or forged is a 400."""
    if not token:
        return 0
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        offset = data["o"]
        if data["s"] != scope or not isinstance(offset, int) or offset < 0:
            raise ValueError
        return offset
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError) as e:
        raise ApiFailure(400, "invalid page_token %r: pass back the next_page_token of the previous page" % token[:100]) from e


def paginate(request, items, key, scope):
    """One page of `items` as the platform shapes it: {key: [...], next_page_token}."""
    size = page_size(request)
    offset = decode_page_token(request.query.get("page_token", ""), scope)
    page = items[offset:offset + size]
    nxt = encode_page_token(offset + size, scope) if offset + size < len(items) else ""
    return {key: page, "next_page_token": nxt}


def check_id(value, what):
    """Ids are opaque strings (the docs show UUIDs, `cp_9f2c1a4b` and `sess_abc123`): any value is looked up, and
    an unknown one is a 404. The plane's own UUIDs are stored lower-case, so lookups are too."""
    if not value or len(value) > 200:
        raise ApiFailure(404, "%s %r not found" % (what, (value or "")[:100]))
    return value.lower()
