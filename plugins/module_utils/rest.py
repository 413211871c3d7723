# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""REST client for the platform's control plane, shared by every module and plugin.

One retry policy lives here: idempotent calls (GET, PUT, DELETE) are retried on
connection errors, 429 and 5xx; calls that start work (POST) are retried only
on 429, which the platform answers before doing anything. Every retry waits
what the server asked for (Retry-After; ratelimit-reset only when the quota is
spent: a 429 or ratelimit-remaining 0), or else an exponential backoff, with
jitter, and the number of retries is bounded. A refused connect (nothing listens
at the URL) sent nothing: any call gets one quick retry, then a clear error.

Blocking calls (checkpoint create, rollback, resume, fork) answer only once
the work is done, which can take minutes: they get their own, longer request
timeout, and when no answer comes (or only a gateway's 502 or 504, which says
nothing of the outcome) they are never sent again. The
client looks up whether the work happened instead (`reconcile_*`), and
reports success when it did. The token never appears in a message, a repr or
an exception.
"""

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

import email.utils
import errno
import json
import random
import time
from typing import Any, Callable, Collection, Container, Iterable, Literal, Sequence, overload

from ansible.module_utils.six.moves.urllib.parse import quote, urlencode, urlsplit
from ansible.module_utils.six.moves.urllib.error import HTTPError, URLError

from ansible_collections.microvm.sandbox.plugins.module_utils import profile, spec_yaml
from ansible_collections.microvm.sandbox.plugins.module_utils.advice import hint_for

try:
    from http.client import HTTPException
except ImportError:  # pragma: no cover - Python 2 is not supported, import test only
    HTTPException = Exception  # type: ignore[misc,assignment]

USER_AGENT = "microvm.sandbox-ansible/0.1"
# PATCH sets session settings to given values: sending it twice changes nothing more.
IDEMPOTENT = frozenset(["GET", "PUT", "PATCH", "DELETE", "HEAD"])
# A blocking call (checkpoint, rollback, resume, fork) may take this long by default.
DEFAULT_BLOCKING_TIMEOUT = 900.0
# Statuses a gateway in front of the service answers when it gives up on a call that may go on.
EDGE_STATUSES = frozenset([502, 504])
# A refused connect (nothing listens at the URL) is retried once after this long: the request never left, and a
# plane that is not up will not be up 19 s of backoff later either.
REFUSED_RETRY_DELAY = 0.5
REFUSED_RETRIES = 1
# The size catalog's route under the client's prefix (ApiClient.sizes_route names it whole).
SIZES_PATH = "/sessions/sandbox/sizes"
# ratelimit-reset is a Unix time on the DigitalOcean API; smaller values are read as seconds from now.
_EPOCH_THRESHOLD = 1000000000


class ApiError(Exception):
    """An API call failed. `status` is the HTTP status (0 for a connection error)."""

    def __init__(self, method: str, path: str, status: int, message: str | None, hint: str | None = None, what: str | None = None,
                 ident: str | None = None, attempts: int = 1, not_api: bool = False, refused: bool = False,
                 url_advice: str | None = None) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.server_message = message
        self.hint = hint
        # What the call was about ("session", "template" ...) and the id or name
        # it named, so callers can say which object was missing or busy.
        self.what = what
        self.ident = ident
        self.attempts = attempts
        # The answer was not the API's (an HTML page from some other web server): its 404 says nothing of objects.
        self.not_api = not_api
        # Nothing listened at the API URL (ECONNREFUSED): the request was never sent.
        self.refused = refused
        # About the API URL itself (a path in it), which the status table cannot say: added to the advice.
        self.url_advice = url_advice
        text = "%s %s failed" % (method, path)
        text += (" with HTTP %d" % status) if status else " (no response)"
        if message:
            text += ": %s" % message
        if hint:
            text += ". %s" % hint
        super(ApiError, self).__init__(text)

    @property
    def gone(self) -> bool:
        return self.status in (404, 410) and not self.not_api

    @property
    def no_response(self) -> bool:
        """No HTTP answer came (timeout, cut connection): a POST may or may not have been carried out."""
        return self.status == 0 and self.path != "-"

    @property
    def may_have_happened(self) -> bool:
        """The call may have been carried out (or still be running): no answer came, or an edge gave up on it.

        A 502 or 504 comes from a gateway in front of the service (an edge timeout, a dropped upstream), not
        from the service's refusal, so for a blocking call it says as little as no answer at all.
        """
        return self.no_response or self.status in EDGE_STATUSES


class OutcomeUnknown(ApiError):
    """A blocking call got no answer and the lookup afterwards could not tell whether it happened."""

    def __init__(self, method: str, path: str, what: str | None, ident: str | None, looked_for: str, cause: ApiError) -> None:
        if cause.status:
            got = "HTTP %d from a gateway, which says nothing of the outcome (%s)" % (
                cause.status, cause.server_message or "no message")
        else:
            got = "no answer (%s)" % cause.server_message
        message = ("%s, and %s did not show up within the wait; the call was not sent again, "
                   "since it may still complete" % (got, looked_for))
        hint = ("Look at the %s with the matching _info module before running the task again, or raise "
                "blocking_timeout / wait_timeout" % (what or "object"))
        super(OutcomeUnknown, self).__init__(method, path, 0, message, hint, what=what, ident=ident,
                                             attempts=cause.attempts)


class NotFound(ApiError):
    """A lookup by id or name found nothing (raised by the require_* helpers)."""

    def __init__(self, what: str, ident: str, detail: str | None = None) -> None:
        message = "no %s with id or name %r%s" % (what, ident, (" " + detail) if detail else "")
        super(NotFound, self).__init__("GET", "-", 404, message, None, what=what, ident=ident)


class Refused(Exception):
    """The module will not do what it was asked, for a reason of ours (not the platform's): `details` go to the result."""

    def __init__(self, message: str, **details: Any) -> None:
        super(Refused, self).__init__(message)
        self.details = details


class WaitTimeout(Exception):
    """A wait ran out or ended in a failed state.

    `last` holds the last object seen, `status` its short status, `wanted` the
    statuses waited for and `timeout` the budget in seconds.
    """

    def __init__(self, message: str, last: Any = None, status: str | None = None, wanted: str | None = None, timeout: float | None = None,
                 what: str | None = None) -> None:
        super(WaitTimeout, self).__init__(message)
        self.last = last
        self.status = status
        self.wanted = wanted
        self.timeout = timeout
        self.what = what


# Waiting for a session or a workspace: a poll every POLL_FAST seconds while the wait is young (a boot or a resume
# usually ends within seconds, and each late poll is time added to every create), then a back-off to POLL_SLOW.
POLL_FIRST = 0.05
POLL_FAST = 0.25
POLL_FAST_FOR = 20.0
POLL_SLOW = 2.0


def poll_delay(previous: float, waited: float, slow: float = POLL_SLOW) -> float:
    """The pause before the next poll of a wait that has lasted `waited` seconds, after a pause of `previous`."""
    if waited < POLL_FAST_FOR:
        return min(previous * 1.5, POLL_FAST)
    return min(max(previous, POLL_FAST) * 1.5, slow)


def error_message(body: Any) -> str:
    """Pull the server's message out of an error body: the documented {id, message, request_id}, or the older
    {"error": {code, message}}. The request id is kept: support asks for it."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if body.get("message"):
            text = str(body["message"])
            if body.get("request_id"):
                text += " (request_id %s)" % body["request_id"]
            return text
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8", "replace")
    return str(body or "").strip()[:500]


def ansible_open(url: str, data: bytes | None, headers: dict[str, str], method: str, timeout: float, validate_certs: bool) -> Any:
    """One HTTP request through ansible-core's open_url (proxies, CA bundles, as every module does)."""
    # Imported here: it pulls in ansible.module_utils.basic and cryptography (about 12 MB), which the
    # connection's long-lived multiplexer, passing its own stdlib opener, never needs.
    from ansible.module_utils.urls import open_url
    return open_url(url, data=data, headers=headers, method=method, timeout=timeout, validate_certs=validate_certs,
                    http_agent=USER_AGENT, follow_redirects="none")


STAGED_LISTED_MAX = 20  # staged directories a refusal names; the listing stops there (the guest's answer is untrusted)


class ApiClient(object):
    """Talks to `<api_url><prefix>/...` with a bearer token."""

    def __init__(self, api_url: str | None = None, api_token: str | None = None, prefix: str | None = profile.DEFAULT_PREFIX,
                 timeout: float = 30.0, retries: int = 5, backoff: float = 0.5, max_backoff: float = 30.0, validate_certs: bool = True,
                 blocking_timeout: float = DEFAULT_BLOCKING_TIMEOUT, reconcile_timeout: float = 300.0,
                 opener: Callable[..., Any] | None = None) -> None:
        if not api_token:
            raise ApiError("-", "-", 0, "no API token",
                           "Set option api_token or env %s" % " / ".join(profile.API_TOKEN_ENVS))
        self.api_url = (api_url or profile.DEFAULT_API_URL).rstrip("/")
        problem = profile.token_destination_problem(self.api_url, api_token)
        if problem:
            raise ApiError("-", "-", 0, problem, what="token destination")
        # Before any request: a URL with the API's /v2 in it turns every call into a 404 read as "not found".
        problem = profile.api_url_path_problem(self.api_url, prefix)
        if problem:
            raise ApiError("-", "-", 0, problem, what="api url")
        self._token = api_token
        prefix = "/" + (prefix or profile.DEFAULT_PREFIX).strip("/")
        self.prefix = prefix
        self.timeout = float(timeout)
        # Request timeout of the calls that answer only once their work is done.
        self.blocking_timeout = max(float(blocking_timeout), self.timeout)
        # How long a lookup after an unanswered blocking call waits for its effect to show.
        self.reconcile_timeout = float(reconcile_timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.validate_certs = validate_certs
        # opener(url, data, headers, method, timeout, validate_certs) -> a response with read() and getcode(),
        # raising HTTPError for any status >= 300 (redirects are not followed)
        self._open = opener or ansible_open
        self._sleep = time.sleep
        self._now = time.time

    def __repr__(self) -> str:
        return "ApiClient(%r, prefix=%r, token=<hidden>)" % (self.api_url, self.prefix)

    # -- transport ---------------------------------------------------------
    def url(self, path: str, query: dict[str, Any] | None = None) -> str:
        u = self.api_url + self.prefix + path
        if query:
            q = dict((k, v) for k, v in query.items() if v not in (None, ""))
            if q:
                u += "?" + urlencode(q)
        return u

    def server_wait(self, headers: Any, status: int | None = None) -> float | None:
        """Seconds the server asked us to wait, or None (then the caller backs off on its own).

        Retry-After (seconds or an HTTP date) is always an explicit wish. ratelimit-reset only says when the
        quota refills, so it drives the wait only when the quota is spent: a 429, or ratelimit-remaining 0.
        A 5xx that carries the rate-limit headers with quota left is an ordinary error, backed off as usual.
        """
        asked = retry_after_seconds(_header(headers, "Retry-After"), self._now())
        if asked is not None:
            return asked
        reset = _header(headers, "ratelimit-reset")
        if not reset or not (status == 429 or _quota_spent(_header(headers, "ratelimit-remaining"))):
            return None
        try:
            value = float(str(reset).strip())
        except ValueError:
            return None
        return max(0.0, value - self._now()) if value >= _EPOCH_THRESHOLD else max(0.0, value)

    def _delay(self, attempt: int, headers: Any = None, status: int | None = None) -> float:
        """How long to sleep before retry `attempt`: the server's wish or a backoff, capped, with jitter."""
        asked = self.server_wait(headers, status)
        if asked is not None:
            # A little jitter on top, so parallel tasks told the same time do not come back in step.
            base = min(asked, self.max_backoff)
            return base + random.uniform(0, min(1.0, 0.1 * base + 0.1))
        base = min(self.backoff * (2 ** attempt), self.max_backoff)
        return base / 2 + random.uniform(0, base / 2)

    def request(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None, content_type: str = "application/json",
                raw: bytes | None = None, what: str | None = None, retry: bool | None = None, expect_json: bool = True,
                ident: str | None = None, timeout: float | None = None) -> Any:
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
            status, payload, answer_headers = 0, None, None
            try:
                resp = self._open(url, data, headers, method, timeout or self.timeout, self.validate_certs)
                payload = resp.read()
                status = resp.getcode()
            except HTTPError as e:
                status = e.code
                try:
                    payload = e.read()
                except Exception:
                    payload = b""
                answer_headers = e.headers
            except (URLError, HTTPException, OSError) as e:
                reason = getattr(e, "reason", e)
                if _refused(e):
                    # Nothing was sent, so even a POST may go again; once, quickly, then say what to do.
                    if attempt < min(REFUSED_RETRIES, self.retries):
                        self._sleep(REFUSED_RETRY_DELAY)
                        attempt += 1
                        continue
                    raise ApiError(method, path, 0, "cannot reach %s: connection refused (nothing listens there)"
                                   % self.api_url,
                                   "Start the local control plane (make local-up, then source the env file it "
                                   "writes) or point the option api_url or env %s at the API" % profile.API_URL_ENV,
                                   what=what, ident=ident, attempts=attempt + 1, refused=True) from e
                if retry and attempt < self.retries:
                    self._sleep(self._delay(attempt, None))
                    attempt += 1
                    continue
                raise ApiError(method, path, 0, "cannot reach %s: %s" % (self.api_url, reason),
                               "Check the API URL (option api_url or env %s)" % profile.API_URL_ENV,
                               what=what, ident=ident, attempts=attempt + 1) from e
            if 200 <= status < 300:
                if not expect_json:
                    return payload
                if not payload:
                    return {}
                try:
                    return json.loads(payload.decode("utf-8"))
                except ValueError as e:
                    raise ApiError(method, path, status, "the response is not JSON: %r" % payload[:200]) from e
            retryable = status == 429 or (retry and status >= 500)
            if retryable and attempt < self.retries:
                self._sleep(self._delay(attempt, answer_headers, status))
                attempt += 1
                continue
            try:
                decoded = json.loads(payload.decode("utf-8")) if payload else {}
            except ValueError:
                decoded = payload
            if status < 500 and not isinstance(decoded, dict):
                raise self._not_the_api(method, path, status, answer_headers, payload, what, ident, attempt + 1)
            hint = hint_for(status, what, ident, attempt + 1)
            url_advice = self.path_advice() if status in (404, 405) else None
            if url_advice:
                hint = "%s. %s" % (hint, url_advice) if hint else url_advice
            raise ApiError(method, path, status, error_message(decoded), hint, what=what, ident=ident,
                           attempts=attempt + 1, url_advice=url_advice)

    def path_advice(self) -> str | None:
        """What to check when the API URL carries a path (a 404 may then be the URL's, not the object's), or None."""
        path = urlsplit(self.api_url).path.rstrip("/")
        if not path:
            return None
        return ("The API URL %s carries the path %s, kept before the route prefix %s: unless a gateway mounts the API "
                "there, set the option api_url or env %s to the bare origin %s (the collection adds the route "
                "prefix itself; option route_prefix or env %s)" % (
                    self.api_url, path, self.prefix, profile.API_URL_ENV, _origin(self.api_url), profile.API_PREFIX_ENV))

    def _not_the_api(self, method: str, path: str, status: int, headers: Any, payload: bytes, what: str | None, ident: str | None,
                     attempts: int) -> ApiError:
        """A 4xx whose body is not the API's JSON: the URL points at some other web server (or a wrong path)."""
        ctype = (headers.get("Content-Type") if headers is not None else "") or ""
        head = payload[:64].lstrip().lower()
        kind = ("an HTML page" if "html" in ctype or head.startswith((b"<!doctype", b"<html")) else
                "%d bytes of %s" % (len(payload), ctype.split(";")[0] or "unknown content"))
        message = "the server answered with %s, not the platform API's JSON error body" % kind
        hint = ("%s (option api_url or env %s) does not answer like the platform's API: set it to the API's base "
                "URL (https://api.digitalocean.com, or the local control plane's URL) and the route_prefix to the "
                "API's (%s)" % (self.api_url, profile.API_URL_ENV, self.prefix))
        url_advice = self.path_advice()
        if url_advice:
            hint += ". " + url_advice
        return ApiError(method, path, status, message, hint, what=what, ident=ident, attempts=attempts, not_api=True,
                        url_advice=url_advice)

    # -- sessions ----------------------------------------------------------
    def create_session(self, spec: dict[str, Any], resume_on_topoff: bool | None = None) -> dict[str, Any]:
        """POST the flat environment spec as YAML, the form the platform documents for it (CREATE-SESSION).

        JSON is the other, exclusive form, {name, config_id}; a flat spec sent as JSON is refused.
        `resume_on_topoff` is a query parameter of the create, not a spec field.
        """
        body = dict(spec)
        body.setdefault("agent", profile.DEFAULT_AGENT)
        query = {}
        if resume_on_topoff is not None:
            query["resume_on_topoff"] = "true" if resume_on_topoff else "false"
        return self.request("POST", "/sessions", raw=spec_yaml.dump(body).encode("utf-8"), query=query,
                            content_type="application/yaml", what="session", ident=body.get("name"))["session"]

    def update_session(self, session_id: str, resume_on_topoff: bool) -> dict[str, Any]:
        """PATCH the session-scoped settings; today the platform documents one, resume_on_topoff (UPDATE-SESSION)."""
        return self.request("PATCH", _path("sessions", session_id), body={"resume_on_topoff": bool(resume_on_topoff)},
                            what="session", ident=session_id)["session"]

    def get_session(self, session_id: str) -> dict[str, Any]:
        return self.request("GET", _path("sessions", session_id), what="session", ident=session_id)["session"]

    def list_sessions(self, status: str | None = None, name: str | None = None, search: str | None = None,
                      page_size: int = 50) -> list[dict[str, Any]]:
        """Sessions, newest first. Without `status` the platform hides DESTROYED and FAILED ones;
        profile.STATUS_ALL lists every session. `search` is the platform's own filter."""
        return self._paginate("/sessions", "sessions", {"status": status, "name": name, "search": search,
                                                        "page_size": page_size})

    def list_sizes(self) -> list[dict[str, Any]]:
        """The sandbox size catalog, smallest first (GET <prefix>/sessions/sandbox/sizes; not paginated)."""
        return self.request("GET", SIZES_PATH, what="size catalog").get("sizes") or []

    def sizes_route(self) -> str:
        """'GET /v2/harness-runtime/sessions/sandbox/sizes': the catalog's call under this client's prefix, for messages."""
        return "GET %s%s" % (self.prefix, SIZES_PATH)

    def delete_session(self, session_id: str) -> Any:
        return self.request("DELETE", _path("sessions", session_id), what="session", ident=session_id)

    def pause_session(self, session_id: str) -> Any:
        return self.request("POST", _path("sessions", session_id, "pause"), body={}, what="session", ident=session_id)

    def resume_session(self, session_id: str) -> Any:
        """Blocking: the platform answers once the session is ready. An unanswered call is reconciled."""
        path = _path("sessions", session_id, "resume")
        try:
            return self.request("POST", path, body={}, what="session", ident=session_id,
                                timeout=self.blocking_timeout)
        except ApiError as e:
            if not e.may_have_happened:
                raise
            return self._reconcile(e, "POST", path, "session", session_id, "the session becoming usable",
                                   lambda: self._usable_or_none(session_id))

    def fork_session(self, session_id: str, count: int = 1, from_checkpoint_id: str | None = None) -> list[dict[str, Any]]:
        """Blocking, all or nothing: returns the new sessions. An unanswered call is reconciled by lineage."""
        body: dict[str, Any] = {"count": count}
        if from_checkpoint_id:
            body["from_checkpoint_id"] = from_checkpoint_id
        path = _path("sessions", session_id, "fork")
        known = set(s.get("session_id") for s in self.forks_of(session_id))
        try:
            return self.request("POST", path, body=body, what="session", ident=session_id,
                                timeout=self.blocking_timeout)["sessions"]
        except ApiError as e:
            if not e.may_have_happened:
                raise

            def new_children() -> list[dict[str, Any]] | None:
                fresh = [s for s in self.forks_of(session_id, from_checkpoint_id)
                         if s.get("session_id") not in known]
                return fresh if len(fresh) >= count else None
            return self._reconcile(e, "POST", path, "session", session_id,
                                   "%d new fork(s) of the session" % count, new_children)

    def exec_buffered(self, session_id: str, argv: Sequence[str], timeout_seconds: int = 60) -> dict[str, Any]:
        """Run a short command through the documented buffered exec -> {exit_code, stdout, stderr, duration_ms}.

        Not retried (a command is not idempotent in general); a paused session is woken by it, as by any exec.
        """
        doc = self.request("POST", _path("sessions", session_id, "sandbox", "exec"),
                           body={"argv": list(argv), "timeout_seconds": timeout_seconds}, what="session",
                           ident=session_id, retry=False, timeout=max(self.timeout, timeout_seconds + 10.0))
        if not isinstance(doc, dict) or isinstance(doc.get("exit_code"), bool) or not isinstance(doc.get("exit_code"), int):
            raise ApiError("POST", _path("sessions", session_id, "sandbox", "exec"), 200,
                           "the exec answer has no exit_code: %r" % (str(doc)[:200],), what="session", ident=session_id)
        return doc

    def staged_credentials(self, session_id: str) -> list[str]:
        """The credential directories the credentials role staged in the session and has not removed yet.

        Read from the role's manifest (profile.STAGED_CREDENTIALS_DIR) with one exec; every line of the answer must
        be `staged <absolute path>`, anything else is an error (never taken as "nothing staged").
        """
        script = ('cd -- "$1" 2>/dev/null || exit 0; n=0; for f in * .[!.]*; do [ -L "$f" ] && [ -e "$f" ] || continue; '
                  'n=$((n+1)); [ $n -le %d ] || break; printf "staged %%s\\n" "$(readlink -- "$f")"; done; exit 0'
                  % STAGED_LISTED_MAX)
        answer = self.exec_buffered(session_id, ["/bin/sh", "-c", script, "sh", profile.STAGED_CREDENTIALS_DIR])
        stdout = answer.get("stdout")
        if answer["exit_code"] != 0 or not isinstance(stdout, str):
            raise Refused("could not tell whether credentials are staged in session %s: the check (a listing of %s) "
                          "exited %s: %s" % (session_id, profile.STAGED_CREDENTIALS_DIR, answer["exit_code"],
                                             str(answer.get("stderr") or stdout)[:300]))
        staged = []
        for line in stdout.splitlines():
            if not line.strip():
                continue
            path = line[len("staged "):] if line.startswith("staged ") else ""
            if not path.startswith(profile.TRANSFER_ROOT + "/"):
                raise Refused("could not tell whether credentials are staged in session %s: the check answered %r, "
                              "not a list of staged directories" % (session_id, line[:200]))
            staged.append(path)
        return staged

    def forks_of(self, session_id: str, from_checkpoint_id: str | None = None) -> list[dict[str, Any]]:
        """Live sessions whose parent is `session_id` (and forked from that checkpoint, when given)."""
        out = []
        for s in self.list_sessions():
            if s.get("parent_session_id") != session_id or profile.short_status(s.get("status")) in profile.GONE:
                continue
            if from_checkpoint_id and s.get("fork_from_checkpoint_id") != from_checkpoint_id:
                continue
            out.append(s)
        return out

    def _usable_or_none(self, session_id: str, changed_from: str | None = None) -> dict[str, Any] | None:
        session = self.get_session(session_id)
        status = profile.short_status(session.get("status"))
        if status in profile.GONE:
            raise WaitTimeout("session %s became %s" % (session_id, status), session, status=status,
                              wanted="READY", timeout=self.reconcile_timeout, what="session")
        if status not in profile.USABLE:
            return None
        if changed_from is not None and session.get("sandbox_id") in (changed_from, None, ""):
            return None
        return session

    def _reconcile(self, error: ApiError, method: str, path: str, what: str, ident: str | None, looked_for: str,
                   probe: Callable[[], Any]) -> Any:
        """After a blocking call got no answer (or a 502/504): poll `probe` (None = not yet) until it shows the effect.

        The call itself is never sent again: it may have been carried out, or still be running.
        """
        deadline = self._now() + self.reconcile_timeout
        delay = 0.2
        while True:
            try:
                found = probe()
            except ApiError as e:
                if not e.may_have_happened:
                    raise
                found = None  # the platform or its edge may still be failing: keep looking until the deadline
            if found is not None:
                return found
            if self._now() >= deadline:
                raise OutcomeUnknown(method, path, what, ident, looked_for, error)
            self._sleep(delay)
            delay = min(delay * 1.5, 5.0)

    def find_session(self, name_or_id: str) -> dict[str, Any] | None:
        """Resolve a session by live name or by id (any status); None when there is none.

        Ids are opaque (UUIDs, `sess_abc123` ...): nothing is decided from a value's shape. It is tried as a live
        name first, then as an id.
        """
        found = self.sessions_named(name_or_id, live_only=True)
        if found:
            return found[0]
        return self.session_by_id(name_or_id)

    def session_by_id(self, session_id: str) -> dict[str, Any] | None:
        """The session with this id, or None (an unknown id, or a value the platform refuses as an id)."""
        try:
            return self.get_session(session_id)
        except ApiError as e:
            if not e.gone and e.status != 400:
                raise
            return None

    def sessions_named(self, name: str, status: str | None = None, live_only: bool = False) -> list[dict[str, Any]]:
        """Sessions with exactly this name (case-insensitive), newest first, in the listing `status` asks for."""
        return [s for s in self.list_sessions(status=status, name=name)
                if (s.get("name") or "").lower() == name.lower()
                and not (live_only and profile.short_status(s.get("status")) in profile.GONE)]

    def require_session(self, name_or_id: str, live: bool = False) -> dict[str, Any]:
        """Like find_session, but a missing session (or, with `live`, a gone one) is a NotFound error."""
        session = self.find_session(name_or_id)
        if session is None:
            raise NotFound("session", name_or_id, "(looked for a live session with that name, then for that session id)")
        status = profile.short_status(session.get("status"))
        if live and status in profile.GONE:
            raise NotFound("live session", name_or_id, "(session %s is %s)" % (session.get("session_id"), status))
        return session

    @overload
    def wait_session(self, session_id: str, until: Collection[str] = ..., timeout: float = ...,
                     gone_ok: Literal[False] = ..., observe: Callable[[str], None] | None = ...) -> dict[str, Any]: ...

    @overload
    def wait_session(self, session_id: str, until: Collection[str] = ..., timeout: float = ...,
                     gone_ok: bool = ..., observe: Callable[[str], None] | None = ...) -> dict[str, Any] | None: ...

    def wait_session(self, session_id: str, until: Collection[str] = profile.USABLE, timeout: float = 300.0,
                     gone_ok: bool = False, observe: Callable[[str], None] | None = None) -> dict[str, Any] | None:
        """Poll until the session's status is in `until` (fast at first, then slower).

        With `gone_ok`, a 404 ends the wait (returning None) and gone statuses
        are waited through; otherwise reaching a gone status raises WaitTimeout.
        `observe(status)` hears every status polled (a module's timeline of the wait).
        """
        started = time.time()
        deadline = started + timeout
        delay = POLL_FIRST
        last = None
        wanted = "/".join(sorted(until))
        while True:
            try:
                last = self.get_session(session_id)
            except ApiError as e:
                if e.gone and gone_ok:
                    return None
                raise
            status = profile.short_status(last.get("status"))
            if observe is not None:
                observe(status)
            if status in until:
                return last
            if status in profile.GONE and not gone_ok:
                # The session object carries no error text: its status and warnings are all the platform reports.
                raise WaitTimeout("session %s became %s while waiting for %s%s" % (
                    session_id, status, wanted, profile.warnings_note(last)), last,
                    status=status, wanted=wanted, timeout=timeout, what="session")
            if time.time() >= deadline:
                raise WaitTimeout("timed out after %ss waiting for session %s to be %s; it is %s" % (
                    timeout, session_id, wanted, status), last,
                    status=status, wanted=wanted, timeout=timeout, what="session")
            self._sleep(delay)
            delay = poll_delay(delay, time.time() - started)

    # -- checkpoints -------------------------------------------------------
    def create_checkpoint(self, session_id: str, label: str | None = None) -> dict[str, Any]:
        """Blocking: answers once the checkpoint is taken. An unanswered call is reconciled by listing."""
        body = {"label": label} if label else {}
        path = _path("sessions", session_id, "checkpoints")
        known = set(cp.get("checkpoint_id") for cp in self.list_checkpoints(session_id))
        try:
            return self.request("POST", path, body=body, what="session", ident=session_id,
                                timeout=self.blocking_timeout)["checkpoint"]
        except ApiError as e:
            if not e.may_have_happened:
                raise

            def new_checkpoint() -> dict[str, Any] | None:
                for cp in self.list_checkpoints(session_id):
                    if cp.get("checkpoint_id") not in known and (cp.get("label") or "") == (label or ""):
                        # A checkpoint still being taken is waited for; READY or FAILED is the outcome.
                        return cp if _checkpoint_done(cp) else None
                return None
            return self._reconcile(e, "POST", path, "session", session_id,
                                   "a new checkpoint labelled %r" % (label or ""), new_checkpoint)

    def list_checkpoints(self, session_id: str) -> list[dict[str, Any]]:
        return self._paginate(_path("sessions", session_id, "checkpoints"), "checkpoints", {},
                              what="session", ident=session_id)

    def get_checkpoint(self, session_id: str, checkpoint_id: str) -> dict[str, Any]:
        return self.request("GET", _path("sessions", session_id, "checkpoints", checkpoint_id),
                            what="checkpoint", ident=checkpoint_id)["checkpoint"]

    def delete_checkpoint(self, session_id: str, checkpoint_id: str) -> Any:
        return self.request("DELETE", _path("sessions", session_id, "checkpoints", checkpoint_id),
                            what="checkpoint", ident=checkpoint_id)

    def rollback(self, session_id: str, checkpoint_id: str) -> dict[str, Any]:
        """Blocking: answers with the session booted from the checkpoint (a new sandbox_id).

        An unanswered call is reconciled by waiting for the sandbox id to change.
        """
        path = _path("sessions", session_id, "checkpoints", checkpoint_id, "rollback")
        before = self.get_session(session_id).get("sandbox_id")
        try:
            return self.request("POST", path, body={}, what="checkpoint", ident=checkpoint_id,
                                timeout=self.blocking_timeout)["session"]
        except ApiError as e:
            if not e.may_have_happened:
                raise
            return self._reconcile(e, "POST", path, "session", session_id,
                                   "the session on a new sandbox (rolled back)",
                                   lambda: self._usable_or_none(session_id, changed_from=before))

    def find_checkpoint(self, session_id: str, checkpoint_id: str | None = None, label: str | None = None) -> dict[str, Any] | None:
        """A checkpoint by id, or the newest one with `label`; None when there is none."""
        if checkpoint_id:
            try:
                return self.get_checkpoint(session_id, checkpoint_id)
            except ApiError as e:
                if e.gone or e.status == 400:  # no such id, or a value the platform refuses as one (a label)
                    return None
                raise
        # The list is newest first, so the first match is the newest one.
        for cp in self.list_checkpoints(session_id):
            if cp.get("label") == label:
                return cp
        return None

    # -- templates ---------------------------------------------------------
    def create_template(self, name: str, source_oci_ref: str, base_template: str) -> dict[str, Any]:
        # base_template is required by the platform ("Omitting it causes registration to fail").
        body = {"name": name, "base_template": base_template, "source_oci_ref": source_oci_ref}
        return self.request("POST", "/templates", body=body, what="template", ident=name)["template"]

    def update_template(self, template_id: str, source_oci_ref: str | None = None, base_template: str | None = None) -> dict[str, Any]:
        body = {}
        if source_oci_ref:
            body["source_oci_ref"] = source_oci_ref
        if base_template:
            body["base_template"] = base_template
        return self.request("PUT", _path("templates", template_id), body=body,
                            what="template", ident=template_id)["template"]

    def get_template(self, template_id: str) -> dict[str, Any]:
        return self.request("GET", _path("templates", template_id), what="template", ident=template_id)["template"]

    def list_templates(self) -> list[dict[str, Any]]:
        return self._paginate("/templates", "templates", {})

    def delete_template(self, template_id: str) -> Any:
        return self.request("DELETE", _path("templates", template_id), what="template", ident=template_id)

    def list_builds(self, template_id: str) -> list[dict[str, Any]]:
        return self._paginate(_path("templates", template_id, "builds"), "builds", {},
                              what="template", ident=template_id)

    def get_build(self, template_id: str, build_id: str) -> dict[str, Any]:
        """One build; the reply is wrapped in {"build": ...} (pydo get_template_build)."""
        return self.request("GET", _path("templates", template_id, "builds", build_id), what="build",
                            ident=build_id)["build"]

    def find_template(self, name_or_id: str) -> dict[str, Any] | None:
        """The template named so (or with that id), as GET returns it, or None.

        List items carry no `spec` (pydo list_templates): only the template's own GET says what it was built from.
        """
        for t in self.list_templates():
            if name_or_id in (t.get("template_id"), t.get("name")):
                return self.template_or_none(t["template_id"])
        return None

    def template_or_none(self, template_id: str) -> dict[str, Any] | None:
        """The template as GET returns it (with spec), or None when it is gone (deleted after a list, say)."""
        try:
            return self.get_template(template_id)
        except ApiError as e:
            if e.gone:
                return None
            raise

    def wait_build(self, template_id: str, known_build_ids: Iterable[str] = (), timeout: float = 600.0,
                   observe: Callable[[str], None] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Wait for the template's newest build (one not in `known_build_ids`) to finish; `observe(status)` hears
        every build status polled.

        Returns (template, build). A failed build raises WaitTimeout carrying the
        build's own error. The template's status alone is not enough: a READY
        template stays READY while a rebuild runs.
        """
        deadline = time.time() + timeout
        delay = 0.1
        known = set(known_build_ids)
        while True:
            build = self.newest_build(template_id, exclude=known)
            template = self.get_template(template_id)
            status = build_status(build) if build else template_status(template)
            name = template.get("name") or template_id
            if observe is not None:
                observe(status)
            if status in ("SUCCEEDED", "READY"):
                return template, build
            if status == "FAILED":
                error = (build or {}).get("error") or self.build_error(template_id) or "no error given"
                raise WaitTimeout("the build of template %s failed: %s" % (name, error), template,
                                  status="FAILED", wanted="READY", timeout=timeout, what="template")
            if time.time() >= deadline:
                raise WaitTimeout("timed out after %ss waiting for the build of template %s; it is %s" % (
                    timeout, name, status), template, status=status, wanted="READY", timeout=timeout, what="template")
            self._sleep(delay)
            delay = min(delay * 1.5, 3.0)

    def newest_build(self, template_id: str, exclude: Container[str] = ()) -> dict[str, Any] | None:
        builds = [b for b in self.list_builds(template_id) if b.get("build_id") not in exclude]
        if not builds:
            return None
        # Newest by creation time; on a tie, the later one in the list.
        return max(enumerate(builds), key=lambda ib: (str(ib[1].get("created_at") or ""), ib[0]))[1]

    def build_error(self, template_id: str) -> str | None:
        """The error of the most recent failed build, best effort (None when unknown)."""
        try:
            builds = self.list_builds(template_id)
        except ApiError:
            return None
        failed = [b for b in builds if "FAILED" in str(b.get("status") or "").upper()]
        if not failed:
            return None
        # Newest first when the server says so; otherwise pick by timestamp when there is one.
        failed.sort(key=lambda b: str(b.get("created_at") or b.get("finished_at") or ""), reverse=True)
        return failed[0].get("error") or failed[0].get("error_message")

    # -- persistent workspaces and environment configs (docs-objects) ------
    # How to Use Persistent Workspaces; doctl harness-runtime workspace and config; pydo delete_workspace and
    # create_config. A workspace is attached only to a session created from a saved config (JSON create form).
    def create_workspace(self, size_limit_gib: int, name: str | None = None, idempotency_key: str | None = None) -> dict[str, Any]:
        """POST /workspaces. With an idempotency key a repeat cannot make a second workspace (within 24 hours the
        same key and values return the first), so the call is retried like an idempotent one."""
        body: dict[str, Any] = {"size_limit_gib": size_limit_gib}
        if name:
            body["name"] = name
        if idempotency_key:
            body["idempotency_key"] = idempotency_key
        return self.request("POST", "/workspaces", body=body, what="workspace", ident=name or None,
                            retry=bool(idempotency_key))["workspace"]

    def get_workspace(self, workspace_id: str) -> dict[str, Any]:
        return self.request("GET", _path("workspaces", workspace_id), what="workspace",
                            ident=workspace_id)["workspace"]

    def list_workspaces(self, state: str | None = None) -> list[dict[str, Any]]:
        """Newest first; `state` keeps one state (AVAILABLE, ATTACHING, ATTACHED, RELEASING, FAILED, DELETING)."""
        return self._paginate("/workspaces", "workspaces", {"state": state})

    def delete_workspace(self, workspace_id: str) -> Any:
        return self.request("DELETE", _path("workspaces", workspace_id), what="workspace", ident=workspace_id)

    def wait_workspace(self, workspace_id: str, states: Sequence[str], timeout: float = 300.0,
                       gone_ok: bool = False) -> dict[str, Any] | None:
        """Poll a workspace until its state is one of `states` (a save after a session's removal: RELEASING)."""
        started = time.time()
        deadline = started + timeout
        delay = POLL_FIRST
        while True:
            try:
                ws = self.get_workspace(workspace_id)
            except ApiError as e:
                if gone_ok and e.gone:
                    return None
                raise
            if ws.get("state") in states:
                return ws
            if time.time() >= deadline:
                raise WaitTimeout("timed out after %ss waiting for workspace %s to be %s; it is %s" % (
                    timeout, workspace_id, " or ".join(states), ws.get("state")), ws, status=ws.get("state"),
                    wanted="/".join(states), timeout=timeout, what="workspace")
            self._sleep(delay)
            delay = poll_delay(delay, time.time() - started)

    def create_config(self, name: str, manifest_yaml: str, insights: Any = None) -> dict[str, Any]:
        """POST /configs: an immutable Environment Config from the environment spec's YAML text (pydo create_config)."""
        body = {"name": name, "manifest_yaml": manifest_yaml}
        if insights:
            body["insights"] = insights
        return self.request("POST", "/configs", body=body, what="config", ident=name)["config"]

    def get_config(self, config_id: str) -> dict[str, Any]:
        return self.request("GET", _path("configs", config_id), what="config", ident=config_id)["config"]

    def list_configs(self, search: str | None = None) -> list[dict[str, Any]]:
        return self._paginate("/configs", "configs", {"search": search})

    def delete_config(self, config_id: str) -> Any:
        """A soft delete (pydo delete_config): the name is released; sessions from it keep their config_id."""
        return self.request("DELETE", _path("configs", config_id), what="config", ident=config_id)

    def find_config(self, name_or_id: str) -> dict[str, Any] | None:
        """A config by id or by name (names are unique among a team's active configs, case-insensitively)."""
        low = name_or_id.lower()
        for c in self.list_configs(search=name_or_id if len(name_or_id) <= 64 else None):
            if low == str(c.get("name") or "").lower():
                return self.get_config(c["id"])
        # Not a name: an id (never guessed from its shape).
        try:
            return self.get_config(name_or_id)
        except ApiError as e:
            if e.gone:
                return None
            raise

    def create_session_from_config(self, name: str, config_id: str, workspace_id: str | None = None,
                                   resume_on_topoff: bool | None = None) -> dict[str, Any]:
        """The JSON create form {name, config_id, workspace_id?} (CREATE-SESSION; doctl create --from-config)."""
        body = {"name": name, "config_id": config_id}
        if workspace_id:
            body["workspace_id"] = workspace_id
        query = {}
        if resume_on_topoff is not None:
            query["resume_on_topoff"] = "true" if resume_on_topoff else "false"
        return self.request("POST", "/sessions", body=body, query=query, what="session", ident=name)["session"]

    # -- helpers -----------------------------------------------------------
    def _paginate(self, path: str, key: str, query: dict[str, Any], what: str | None = None,
                  ident: str | None = None) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token = None
        while True:
            q = dict(query)
            if token:
                q["page_token"] = token
            page = self.request("GET", path, query=q, what=what, ident=ident)
            items.extend(page.get(key) or [])
            token = page.get("next_page_token")
            if not token:
                return items


def _refused(error: BaseException) -> bool:
    """The connect was refused (ECONNREFUSED), directly or as a URLError's reason: nothing was sent."""
    for e in (error, getattr(error, "reason", None)):
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED):
            return True
    return False


def _origin(url: str) -> str:
    """'https://api.example.com/v2' -> 'https://api.example.com'."""
    parts = urlsplit(url)
    return "%s://%s" % (parts.scheme, parts.netloc)


def retry_after_seconds(value: Any, now: float) -> float | None:
    """A Retry-After header's wait in seconds (delta-seconds or an HTTP date), or None when absent or unreadable."""
    text = str(value or "").strip()
    if not text:
        return None
    try:
        return max(0.0, float(text))
    except ValueError:
        when = email.utils.parsedate_tz(text)  # the HTTP-date form
        return None if when is None else max(0.0, email.utils.mktime_tz(when) - now)


def _header(headers: Any, name: str) -> Any:
    """A response header by name, case-insensitively (HTTPMessage is; a plain dict is not)."""
    if not headers:
        return None
    value = headers.get(name)
    if value is None:
        low = name.lower()
        for key in headers.keys():
            if str(key).lower() == low:
                return headers[key]
    return value


def _quota_spent(remaining: Any) -> bool:
    """ratelimit-remaining says no request is left (a missing or unreadable value says nothing)."""
    try:
        return remaining is not None and int(str(remaining).strip()) <= 0
    except ValueError:
        return False


def _path(*parts: Any) -> str:
    """'/sessions/<id>/pause' with every id quoted, so a name can never change the route."""
    return "/" + "/".join(quote(str(p), safe="") for p in parts)


def _checkpoint_done(cp: dict[str, Any]) -> bool:
    status = str(cp.get("status") or "").upper()
    return status.endswith("READY") or status.endswith("FAILED")


def build_status(build: dict[str, Any] | None) -> str:
    s = str((build or {}).get("status") or "").upper()
    return s[len("BUILD_STATUS_"):] if s.startswith("BUILD_STATUS_") else s


def template_status(template: dict[str, Any] | None) -> str:
    """'TEMPLATE_STATUS_READY' -> 'READY' (and unknown values pass through upper-cased)."""
    s = str((template or {}).get("status") or "").upper()
    return s[len("TEMPLATE_STATUS_"):] if s.startswith("TEMPLATE_STATUS_") else s
