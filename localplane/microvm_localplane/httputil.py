"""HTTP plumbing shared by every route: the service error shape, strict bodies, paging tokens, times."""
import base64
import binascii
import datetime
import json

import yaml
from aiohttp import web

from . import contract


class ApiFailure(Exception):
    """A refusal with the platform's status and a message meant for the caller."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status, message):
    return web.json_response({"error": {"code": status, "message": message}}, status=status)


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


async def read_document(request, allowed_keys, what, required_type=True):
    """A strict YAML/JSON mapping body: unknown keys, malformed text and wrong types are refused.

    JSON is YAML, so both are parsed with yaml.safe_load. An empty body is an
    empty mapping (the platform's `{}` calls).
    """
    ctype = media_type(request)
    raw = await read_limited(request)
    if ctype and ctype not in contract.CREATE_CONTENT_TYPES:
        raise ApiFailure(415, "unsupported content type %r for %s: use application/yaml or application/json"
                         % (ctype, what))
    if not ctype and raw.strip() and required_type:
        raise ApiFailure(415, "missing content type for %s: use application/yaml or application/json" % what)
    if not raw.strip():
        return {}
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiFailure(400, "%s body is not UTF-8 text" % what)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = " at line %d column %d" % (mark.line + 1, mark.column + 1) if mark else ""
        raise ApiFailure(400, "malformed %s body%s: %s" % (what, where, getattr(e, "problem", None) or e))
    except (RecursionError, ValueError, OverflowError) as e:
        raise ApiFailure(400, "malformed %s body: %s" % (what, type(e).__name__))
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ApiFailure(400, "%s body must be a mapping, not %s" % (what, type(doc).__name__))
    unknown = sorted(str(k) for k in doc if k not in allowed_keys)
    if unknown:
        raise ApiFailure(400, "unknown field%s in %s body: %s (allowed: %s)" % (
            "s" if len(unknown) > 1 else "", what, ", ".join(unknown), ", ".join(sorted(allowed_keys))))
    return doc


# -- paging -------------------------------------------------------------------
def page_size(request):
    raw = request.query.get("page_size", "")
    if raw == "":
        return contract.DEFAULT_PAGE_SIZE
    try:
        n = int(raw)
    except ValueError:
        raise ApiFailure(400, "page_size must be a positive integer, got %r" % raw)
    if n < 0:
        raise ApiFailure(400, "page_size must be a positive integer, got %r" % raw)
    if n == 0:
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
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeDecodeError):
        raise ApiFailure(400, "invalid page_token %r: pass back the next_page_token of the previous page" % token[:100])


def paginate(request, items, key, scope):
    """One page of `items` as the platform shapes it: {key: [...], next_page_token}."""
    size = page_size(request)
    offset = decode_page_token(request.query.get("page_token", ""), scope)
    page = items[offset:offset + size]
    nxt = encode_page_token(offset + size, scope) if offset + size < len(items) else ""
    return {key: page, "next_page_token": nxt}


def check_id(value, what):
    """Ids are UUIDs; anything else cannot name an object (404, like an unknown id)."""
    if not contract.UUID_RE.match(value or ""):
        raise ApiFailure(404, "%s %r not found" % (what, value[:100]))
    return value.lower()
