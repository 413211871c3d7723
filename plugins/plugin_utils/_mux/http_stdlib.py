# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The multiplexer's HTTP opener for the REST client (module_utils/rest.py), on the standard library.

The mux lives for hours and serves a fleet: ansible-core's open_url would cost each mux process
about 12 MB (it imports ansible.module_utils.basic and cryptography) for the few REST calls it
makes (look a session up, check it, resume it). This opener keeps open_url's behaviour that the
client relies on: proxies from the environment, certificate checks unless validate_certs is off,
the client's User-Agent, and redirects never followed (a 3xx is an HTTPError, as with
follow_redirects="none"), so the bearer token never goes to another host.
"""

from __future__ import annotations

import functools
import http.client
import ssl
import urllib.request
from email.message import Message as HTTPMessage
from typing import IO

from ansible_collections.microvm.sandbox.plugins.module_utils.rest import USER_AGENT


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage,
                         newurl: str) -> None:
        return None  # urllib then raises HTTPError with the 3xx


@functools.lru_cache(maxsize=None)  # built on first use: loading the CA bundle is not free, and http:// needs none
def _opener(validate_certs: bool) -> urllib.request.OpenerDirector:
    context = ssl.create_default_context()
    if not validate_certs:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return urllib.request.build_opener(urllib.request.HTTPSHandler(context=context), _NoRedirect())


def stdlib_open(url: str, data: bytes | None, headers: dict[str, str], method: str, timeout: float,
                validate_certs: bool) -> http.client.HTTPResponse:
    """One request, as rest.ApiClient's `opener`; raises HTTPError for statuses >= 300."""
    request = urllib.request.Request(url, data=data, headers=dict(headers, **{"User-Agent": USER_AGENT}),
                                     method=method)
    return _opener(bool(validate_certs)).open(request, timeout=timeout)
