# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The options every module (and the inventory plugin) uses to reach the control plane."""

from __future__ import absolute_import, division, print_function

__metaclass__ = type


class ModuleDocFragment(object):

    # The API options of every module. Modules read the environment variables
    # through argument_spec fallbacks (module docs cannot carry env entries).
    DOCUMENTATION = r"""
options:
  api_url:
    description:
      - Base URL of the control plane, for example V(https://api.digitalocean.com) or the URL of the local control plane.
      - A path in the URL is kept, and O(route_prefix) is appended to it. A path with the API's own V(/v2) in it
        (V(https://api.example.com/v2), V(.../v2/harness-runtime)) fails the task before any request; give the bare
        origin, the collection adds O(route_prefix) itself.
      - If not set, the environment variable E(DO_AGENTS_API_URL) is used, then the default.
    type: str
    default: https://api.digitalocean.com
  api_token:
    description:
      - Bearer token for the control plane.
      - If not set, the first of the environment variables E(DO_AGENTS_API_TOKEN), E(DIGITALOCEAN_TOKEN) (doctl's)
        and E(DIGITALOCEAN_ACCESS_TOKEN) (community.digitalocean's) that is set is used.
      - The token is never printed, logged or returned.
    type: str
  route_prefix:
    description:
      - Path prefix of the API routes under O(api_url).
      - The platform's newest pages use V(/v2/harness-runtime), the default; the older V(/v2/agents) is still
        answered and can be chosen here.
      - If not set, the environment variable E(DO_AGENTS_API_PREFIX) is used, then the default.
    type: str
    default: /v2/harness-runtime
  request_timeout:
    description:
      - Timeout in seconds of one HTTP request (blocking calls use O(blocking_timeout) instead).
      - Idempotent calls (GET, PUT, DELETE) are retried on connection errors, HTTP 429 and 5xx;
        calls that start work (POST) are retried only on HTTP 429. A retry waits what the platform asks for in
        C(Retry-After), else in C(ratelimit-reset), or an exponential backoff, always with jitter and at most
        5 times. A refused connection (nothing listens at O(api_url)) is retried once, after half a second, for
        any call, since nothing was sent.
      - Greater than 0 and at most 3600; a value out of range fails the task naming this option.
    type: float
    default: 30
  blocking_timeout:
    description:
      - Timeout in seconds of the calls that answer only once their work is done, which can take minutes
        (checkpoint create, rollback, resume and fork).
      - When such a call gets no answer in time, it is B(not) sent again. The module looks up whether it happened
        (for up to O(wait_timeout) seconds) and reports success when it did, or fails saying the outcome is unknown.
      - Greater than 0 and at most 86400; a value out of range fails the task naming this option.
    type: float
    default: 900
  wait_timeout:
    description:
      - How many seconds to wait for an object to reach the wanted state when the module waits
        (a session to become usable, paused or gone, a template build to finish).
      - Accepted by every module so that it can be set once in C(module_defaults); modules that do not wait ignore it.
      - From 0 to 604800 (a week); a value out of range fails the task naming this option.
    type: int
    default: 600
  validate_certs:
    description:
      - Whether to verify the TLS certificate of O(api_url).
      - Only set to V(false) for a local control plane with a self-signed certificate.
    type: bool
    default: true
notes:
  - All API options can be set once for every module of this collection with
    C(module_defaults) and the action group C(group/microvm.sandbox.api).
  - The modules run on the controller (or wherever they are delegated); they only need network access to O(api_url).
seealso:
  - name: Platform contract
    description: What the control plane exposes, and what the collection assumes.
    link: https://github.com/microvm/sandbox/tree/main/docs
"""

    # The same options for controller plugins (inventory), where the
    # environment variables are read by Ansible's configuration system.
    PLUGIN = r"""
options:
  api_url:
    description:
      - Base URL of the control plane, for example V(https://api.digitalocean.com) or the URL of the local control plane.
    type: str
    default: https://api.digitalocean.com
    env:
      - name: DO_AGENTS_API_URL
  api_token:
    description:
      - Bearer token for the control plane. It is never put into host variables.
      - Read from E(DO_AGENTS_API_TOKEN), else E(DIGITALOCEAN_TOKEN), else E(DIGITALOCEAN_ACCESS_TOKEN).
    type: str
    env:
      - name: DIGITALOCEAN_ACCESS_TOKEN
      - name: DIGITALOCEAN_TOKEN
      - name: DO_AGENTS_API_TOKEN
  route_prefix:
    description:
      - Path prefix of the API routes under O(api_url); V(/v2/agents) selects the older routes.
    type: str
    default: /v2/harness-runtime
    env:
      - name: DO_AGENTS_API_PREFIX
  request_timeout:
    description:
      - Timeout in seconds of one HTTP request; idempotent calls are retried with backoff.
    type: float
    default: 30
  validate_certs:
    description:
      - Whether to verify the TLS certificate of O(api_url).
    type: bool
    default: true
"""

    # Attribute descriptions shared by the modules (community.docker style).
    ATTRIBUTES = r"""
options: {}
attributes:
  check_mode:
    description: Can run in C(check_mode) and return changed status prediction without modifying the platform.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in C(check_mode)), when in diff mode.
  action_group:
    description: Use C(group/microvm.sandbox.api) in C(module_defaults) to set defaults for this module.
    support: full
    membership:
      - microvm.sandbox.api
"""

    # For modules that only read.
    INFO_MODULE = r"""
options: {}
attributes:
  check_mode:
    support: full
    details:
      - This action does not modify state.
  diff_mode:
    support: N/A
    details:
      - This action does not modify state.
"""
