# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""REST client for the platform's control plane, shared by every module and plugin.

One retry policy lives here: idempotent calls (GET, PUT, DELETE) are retried on
connection errors, 429 and 5xx with exponential backoff that honours
Retry-After; calls that start work (POST) are retried only on 429, which
the platform answers before doing anything. The token never appears in a
message, a repr or an exception.
"""

from __future__ import absolute_import, division, print_function

__metaclass__ = type

import json
import random
import time

from ansible.module_utils.six.moves.urllib.parse import quote, urlencode
from ansible.module_utils.six.moves.urllib.error import HTTPError, URLError
from ansible.module_utils.urls import open_url

from ansible_collections.microvm.sandbox.plugins.module_utils import profile

try:
    from http.client import HTTPException
except ImportError:  # pragma: no cover - Python 2 is not supported, import test only
    HTTPException = Exception

USER_AGENT = "microvm.sandbox-ansible/0.1"
IDEMPOTENT = frozenset(["GET", "PUT", "DELETE", "HEAD"])


class ApiError(Exception):
    """An API call failed. `status` is the HTTP status (0 for a connection error)."""

    def __init__(self, method, path, status, message, hint=None):
        self.method = method
        self.path = path
        self.status = status
        self.server_message = message
        self.hint = hint
        text = "%s %s failed" % (method, path)
        text += (" with HTTP %d" % status) if status else " (no response)"
        if message:
            text += ": %s" % message
        if hint:
            text += ". %s" % hint
        super(ApiError, self).__init__(text)

    @property
    def gone(self):
        return self.status in (404, 410)


class WaitTimeout(Exception):
    """A wait ran out; `last` holds the last object seen."""

    def __init__(self, message, last=None):
        super(WaitTimeout, self).__init__(message)
        self.last = last


def error_message(body):
    """Pull the server's message out of either error shape the platform uses."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("message"):
            return str(body["message"])
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8", "replace")
    return str(body or "").strip()[:500]


def hint_for(status, what):
    if status == 401:
        return "Check the API token (option api_token or env %s)" % profile.API_TOKEN_ENV
    if status == 403:
        return "The token is not entitled to this call; check its scopes"
    if status in (404, 410):
        return "No such %s: check the id or name" % what if what else "Not found"
    if status == 409:
        return "The %s is in a state that does not allow this call" % (what or "object")
    if status == 429:
        return "Rate limited; gave up after retries"
    if status >= 500:
        return "The platform had an error; gave up after retries"
    return None


class ApiClient(object):
    """Talks to `<api_url><prefix>/...` with a bearer token."""

    def __init__(self, api_url=None, api_token=None, prefix=profile.DEFAULT_PREFIX, timeout=30.0,
                 retries=5, backoff=0.5, max_backoff=20.0, validate_certs=True):
        if not api_token:
            raise ApiError("-", "-", 0, "no API token",
                           "Set option api_token or env %s" % profile.API_TOKEN_ENV)
        self.api_url = (api_url or profile.DEFAULT_API_URL).rstrip("/")
        self._token = api_token
        prefix = "/" + (prefix or profile.DEFAULT_PREFIX).strip("/")
        self.prefix = prefix
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.validate_certs = validate_certs
        self._sleep = time.sleep

    def __repr__(self):
        return "ApiClient(%r, prefix=%r, token=<hidden>)" % (self.api_url, self.prefix)

    # -- transport ---------------------------------------------------------
    def url(self, path, query=None):
        u = self.api_url + self.prefix + path
        if query:
            q = dict((k, v) for k, v in query.items() if v not in (None, ""))
            if q:
                u += "?" + urlencode(q)
        return u

    def _delay(self, attempt, retry_after):
        if retry_after:
            try:
                return min(float(retry_after), self.max_backoff)
            except ValueError:
                pass
        base = min(self.backoff * (2 ** attempt), self.max_backoff)
        return base / 2 + random.uniform(0, base / 2)

    def request(self, method, path, body=None, query=None, content_type="application/json",
                raw=None, what=None, retry=None, expect_json=True):
        """Perform a call, returning the decoded JSON body (or {} when empty)."""
        if retry is None:
            retry = method in IDEMPOTENT
        headers = {"Authorization": "Bearer " + self._token, "Accept": "application/json"}
        data = raw
        if body is not None:
            data = json.dumps(body).encode("utf-8")
        if data is not None:
            headers["Content-Type"] = content_type
        url = self.url(path, query)
        attempt = 0
        while True:
            status, payload, retry_after = 0, None, None
            try:
                resp = open_url(url, data=data, headers=headers, method=method, timeout=self.timeout,
                                validate_certs=self.validate_certs, http_agent=USER_AGENT,
                                follow_redirects="none")
                payload = resp.read()
                status = resp.getcode()
            except HTTPError as e:
                status = e.code
                try:
                    payload = e.read()
                except Exception:
                    payload = b""
                retry_after = e.headers.get("Retry-After") if e.headers else None
            except (URLError, HTTPException, OSError) as e:
                reason = getattr(e, "reason", e)
                if retry and attempt < self.retries:
                    self._sleep(self._delay(attempt, None))
                    attempt += 1
                    continue
                raise ApiError(method, path, 0, "cannot reach %s: %s" % (self.api_url, reason),
                               "Check the API URL (option api_url or env %s)" % profile.API_URL_ENV)
            if 200 <= status < 300:
                if not expect_json:
                    return payload
                if not payload:
                    return {}
                try:
                    return json.loads(payload.decode("utf-8"))
                except ValueError:
                    raise ApiError(method, path, status, "the response is not JSON: %r" % payload[:200])
            retryable = status == 429 or (retry and status >= 500)
            if retryable and attempt < self.retries:
                self._sleep(self._delay(attempt, retry_after))
                attempt += 1
                continue
            try:
                decoded = json.loads(payload.decode("utf-8")) if payload else {}
            except ValueError:
                decoded = payload
            raise ApiError(method, path, status, error_message(decoded), hint_for(status, what))

    # -- sessions ----------------------------------------------------------
    def create_session(self, spec):
        # JSON is YAML: the platform takes the flat create body as application/yaml.
        body = dict(spec)
        body.setdefault("agent", "none")
        return self.request("POST", "/sessions", body=body, content_type="application/yaml",
                            what="session")["session"]

    def get_session(self, session_id):
        return self.request("GET", "/sessions/%s" % quote(session_id, safe=""), what="session")["session"]

    def list_sessions(self, status=None, name=None, page_size=50):
        return self._paginate("/sessions", "sessions", {"status": status, "name": name, "page_size": page_size})

    def delete_session(self, session_id):
        return self.request("DELETE", "/sessions/%s" % quote(session_id, safe=""), what="session")

    def pause_session(self, session_id):
        return self.request("POST", "/sessions/%s/pause" % quote(session_id, safe=""), body={}, what="session")

    def resume_session(self, session_id):
        return self.request("POST", "/sessions/%s/resume" % quote(session_id, safe=""), body={}, what="session")

    def fork_session(self, session_id, count=1, from_checkpoint_id=None):
        body = {"count": count}
        if from_checkpoint_id:
            body["from_checkpoint_id"] = from_checkpoint_id
        return self.request("POST", "/sessions/%s/fork" % quote(session_id, safe=""), body=body,
                            what="session")["sessions"]

    def find_session(self, name_or_id):
        """Resolve a live session by id or by name; None when there is none."""
        try:
            return self.get_session(name_or_id)
        except ApiError as e:
            if not e.gone and e.status != 400:
                raise
        found = [s for s in self.list_sessions(name=name_or_id)
                 if profile.short_status(s.get("status")) not in profile.GONE]
        return found[0] if found else None

    def wait_session(self, session_id, until=profile.USABLE, timeout=300.0, gone_ok=False):
        """Poll until the session's status is in `until` (fast at first, then slower)."""
        deadline = time.time() + timeout
        delay = 0.05
        last = None
        while True:
            try:
                last = self.get_session(session_id)
            except ApiError as e:
                if e.gone and gone_ok:
                    return None
                raise
            status = profile.short_status(last.get("status"))
            if status in until:
                return last
            if status in profile.GONE and not gone_ok:
                raise WaitTimeout("session %s became %s while waiting for %s%s" % (
                    session_id, status, "/".join(sorted(until)),
                    (": " + last["error_message"]) if last.get("error_message") else ""), last)
            if time.time() >= deadline:
                raise WaitTimeout("timed out after %ss waiting for session %s to be %s; it is %s" % (
                    timeout, session_id, "/".join(sorted(until)), status), last)
            self._sleep(delay)
            delay = min(delay * 1.5, 2.0)

    # -- checkpoints -------------------------------------------------------
    def create_checkpoint(self, session_id, label=None):
        body = {"label": label} if label else {}
        return self.request("POST", "/sessions/%s/checkpoints" % quote(session_id, safe=""), body=body,
                            what="session")["checkpoint"]

    def list_checkpoints(self, session_id):
        return self._paginate("/sessions/%s/checkpoints" % quote(session_id, safe=""), "checkpoints", {})

    def get_checkpoint(self, session_id, checkpoint_id):
        return self.request("GET", "/sessions/%s/checkpoints/%s" % (quote(session_id, safe=""),
                                                                   quote(checkpoint_id, safe="")),
                            what="checkpoint")["checkpoint"]

    def delete_checkpoint(self, session_id, checkpoint_id):
        return self.request("DELETE", "/sessions/%s/checkpoints/%s" % (quote(session_id, safe=""),
                                                                      quote(checkpoint_id, safe="")),
                            what="checkpoint")

    def rollback(self, session_id, checkpoint_id):
        return self.request("POST", "/sessions/%s/checkpoints/%s/rollback" % (
            quote(session_id, safe=""), quote(checkpoint_id, safe="")), body={}, what="checkpoint")["session"]

    # -- templates ---------------------------------------------------------
    def create_template(self, name, source_oci_ref, base_template=None):
        body = {"name": name, "source_oci_ref": source_oci_ref}
        if base_template:
            body["base_template"] = base_template
        return self.request("POST", "/templates", body=body, what="template")["template"]

    def update_template(self, template_id, source_oci_ref=None, base_template=None):
        body = {}
        if source_oci_ref:
            body["source_oci_ref"] = source_oci_ref
        if base_template:
            body["base_template"] = base_template
        return self.request("PUT", "/templates/%s" % quote(template_id, safe=""), body=body,
                            what="template")["template"]

    def get_template(self, template_id):
        return self.request("GET", "/templates/%s" % quote(template_id, safe=""), what="template")["template"]

    def list_templates(self):
        return self._paginate("/templates", "templates", {})

    def delete_template(self, template_id):
        return self.request("DELETE", "/templates/%s" % quote(template_id, safe=""), what="template")

    def list_builds(self, template_id):
        return self._paginate("/templates/%s/builds" % quote(template_id, safe=""), "builds", {})

    def get_build(self, template_id, build_id):
        return self.request("GET", "/templates/%s/builds/%s" % (quote(template_id, safe=""),
                                                               quote(build_id, safe="")), what="build")

    def find_template(self, name_or_id):
        for t in self.list_templates():
            if name_or_id in (t.get("template_id"), t.get("name")):
                return t
        return None

    # -- helpers -----------------------------------------------------------
    def _paginate(self, path, key, query):
        items, token = [], None
        while True:
            q = dict(query)
            if token:
                q["page_token"] = token
            page = self.request("GET", path, query=q)
            items.extend(page.get(key) or [])
            token = page.get("next_page_token")
            if not token:
                return items
