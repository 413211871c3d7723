# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import absolute_import, annotations, division, print_function

__metaclass__ = type

DOCUMENTATION = r"""
name: sessions
short_description: Sandbox sessions of the managed microVM platform as inventory hosts
version_added: 0.1.0
description:
  - Lists the sessions of the control plane (the platform or the local control plane) and adds one host per
    session, named after the session, reached with the C(microvm.sandbox.agent)
    connection plugin (C(ansible_connection=microvm.sandbox.agent), C(ansible_host) = the session id).
  - Reads configuration files whose name ends with C(.microvm_sessions.yml) or C(.microvm_sessions.yaml); a file
    that names this plugin under another name fails with a message naming the suffix.
  - Every session field becomes a host variable with the prefix O(host_var_prefix), for example C(microvm_session_id),
    C(microvm_name), C(microvm_status) (short form, such as C(READY)), C(microvm_agent_kind),
    C(microvm_parent_session_id), C(microvm_workspace_id). The platform reports no template or size.
  - Values that come from the API are marked unsafe, so they are never evaluated as templates.
  - When O(api_url) or O(route_prefix) differ from their defaults, they are passed to the connection plugin as the
    host variables C(ansible_microvm_api_url) and C(ansible_microvm_route_prefix). The API token never is; the
    connection plugin reads it from its own option or E(DO_AGENTS_API_TOKEN) (or E(DIGITALOCEAN_TOKEN),
    E(DIGITALOCEAN_ACCESS_TOKEN)).
author:
  - microvm.sandbox maintainers (@microvm)
extends_documentation_fragment:
  - microvm.sandbox.api.plugin
  - ansible.builtin.constructed
  - ansible.builtin.inventory_cache
options:
  plugin:
    description: The name of this plugin; it must be V(microvm.sandbox.sessions) for the file to be read by it.
    type: str
    required: true
    choices: [microvm.sandbox.sessions]
  statuses:
    description:
      - Only sessions in these statuses become hosts, as short names (V(READY)) or in full (V(SESSION_STATUS_READY)).
      - V(usable) stands for V(READY) and V(DETACHED); V(gone) for V(DESTROYING), V(DESTROYED) and V(FAILED).
      - The platform lists V(DESTROYED) and V(FAILED) sessions only when asked for them; naming them here (or
        V(gone)) asks for them.
      - A paused session is resumed by the connection when it is first used.
    type: list
    elements: str
    default: [usable, PAUSED]
  name_prefix:
    description: Only sessions whose name starts with this prefix.
    type: str
  search:
    description: The platform's own search filter of the session list (its C(search) parameter).
    type: str
  name_regex:
    description: Only sessions whose name matches this Python regular expression (searched, not anchored).
    type: str
  host_var_prefix:
    description: Prefix of the host variables made from session fields.
    type: str
    default: microvm_
  connection_plugin:
    description: The connection plugin set as C(ansible_connection) for every host.
    type: str
    default: microvm.sandbox.agent
  python_interpreter:
    description:
      - Set as C(ansible_python_interpreter) for every host. The default discovers the template's Python without
        the discovery warning (templates differ in where their Python lives); give a path such as
        V(/usr/bin/python3) to skip discovery, or override it per host with O(compose).
    type: str
    default: auto_silent
"""

EXAMPLES = r"""
# file: sandboxes.microvm_sessions.yml
# API URL and token come from DO_AGENTS_API_URL and DO_AGENTS_API_TOKEN.
plugin: microvm.sandbox.sessions

---
# file: ci.microvm_sessions.yml
# Only the CI sessions, grouped by adapter and status, with a cache.
plugin: microvm.sandbox.sessions
name_prefix: ci-
statuses: [READY, DETACHED, PAUSED]
keyed_groups:
  - key: microvm_agent_kind | lower
    prefix: kind
  - key: microvm_status | lower
    prefix: status
groups:
  paused: microvm_status == 'PAUSED'
compose:
  forked_from: microvm_parent_session_id
cache: true
cache_plugin: ansible.builtin.jsonfile
cache_connection: ~/.cache/microvm-inventory
cache_timeout: 60
"""

import re  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from ansible.errors import AnsibleError  # noqa: E402
from ansible.plugins.inventory import BaseInventoryPlugin, Cacheable, Constructable  # noqa: E402
from ansible.utils.unsafe_proxy import wrap_var  # noqa: E402

from ansible_collections.microvm.sandbox.plugins.module_utils import profile  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.api_module import describe_error  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.rest import ApiClient, ApiError  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.module_utils.views import expand_statuses, select_sessions  # noqa: E402
from ansible_collections.microvm.sandbox.plugins.plugin_utils._worker import preload  # noqa: E402

if TYPE_CHECKING:
    from ansible.inventory.data import InventoryData

CONNECTION_VARS = {
    # option -> host variable read by the connection plugin
    "api_url": "ansible_microvm_api_url",
    "route_prefix": "ansible_microvm_route_prefix",
}
DEFAULTS = {"api_url": profile.DEFAULT_API_URL, "route_prefix": profile.DEFAULT_PREFIX}


SUFFIXES = (".microvm_sessions.yml", ".microvm_sessions.yaml")
_PLUGIN_LINE = re.compile(r"""^plugin:\s*["']?microvm\.sandbox\.sessions["']?\s*(#.*)?$""", re.M)


def _names_this_plugin(path: str) -> bool:
    """Whether a YAML file says `plugin: microvm.sandbox.sessions` (read cheaply, never fails)."""
    if not path.endswith((".yml", ".yaml")):
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(65536).decode("utf-8", "replace")
    except OSError:
        return False
    return bool(_PLUGIN_LINE.search(head))


def _suggested_name(path: str) -> str:
    stem = re.sub(r"\.ya?ml$", "", path)
    return stem + SUFFIXES[0]


class InventoryModule(BaseInventoryPlugin, Constructable, Cacheable):

    NAME = "microvm.sandbox.sessions"
    inventory: InventoryData  # the base class's Optional: parse() sets it before anything here reads it

    def verify_file(self, path: str) -> bool:
        # A file that names this plugin but has another suffix is accepted too, so that
        # parse() can say which suffix it needs instead of core's generic refusal.
        return super(InventoryModule, self).verify_file(path) and \
            (path.endswith(SUFFIXES) or _names_this_plugin(path))

    def parse(self, inventory: InventoryData, loader: Any, path: str, cache: bool = True) -> None:
        if not path.endswith(SUFFIXES):
            raise AnsibleError(
                "%s names the %s inventory plugin, which reads only files whose names end in %s: rename it, "
                "for example to %s" % (path, self.NAME, " or ".join(SUFFIXES), _suggested_name(path)))
        super(InventoryModule, self).parse(inventory, loader, path, cache)
        self._read_config_data(path)
        sessions = self._sessions(self.get_cache_key(path), cache)
        selected = self._select(sessions)
        self._populate(selected)
        if selected:  # in ansible-playbook's own process: each task's worker inherits it
            preload.load_connection(self.get_option("connection_plugin"))

    # -- data --------------------------------------------------------------
    def _sessions(self, cache_key: str, cache: bool) -> list[dict[str, Any]]:
        """The unfiltered session list, from the cache when allowed and present."""
        use_cache = self.get_option("cache")
        if use_cache and cache:
            try:
                return self._cache[cache_key]
            except KeyError:
                pass  # not cached yet (or expired): fetch and store
        sessions = self._fetch()
        if use_cache:
            self._cache[cache_key] = sessions
        return sessions

    def _fetch(self) -> list[dict[str, Any]]:
        client = None
        try:
            client = ApiClient(api_url=self.get_option("api_url"), api_token=self.get_option("api_token"),
                               prefix=self.get_option("route_prefix"), timeout=self.get_option("request_timeout"),
                               validate_certs=self.get_option("validate_certs"))
            try:
                statuses = expand_statuses(self.get_option("statuses"))
            except ValueError:
                statuses = None  # refused, naming the value, by _select
            # The platform hides DESTROYED and FAILED sessions unless asked for them (the `gone` group).
            return client.list_sessions(status=profile.list_status_filter(statuses), search=self.get_option("search"))
        except ApiError as e:
            # from None: describe_error words the server's answer; ansible-core would append the raw ApiError again
            raise AnsibleError("microvm.sandbox.sessions: %s" % describe_error(e, client)[0]) from None

    def _select(self, sessions: list[dict[str, Any]]) -> list[dict[str, Any]]:
        try:
            statuses = expand_statuses(self.get_option("statuses"))
            regex = re.compile(self.get_option("name_regex")) if self.get_option("name_regex") else None
        except (ValueError, re.error) as e:
            raise AnsibleError("microvm.sandbox.sessions: bad filter: %s" % e) from e
        return select_sessions(sessions, statuses=statuses, name_prefix=self.get_option("name_prefix"),
                               name_regex=regex)

    # -- hosts -------------------------------------------------------------
    def _populate(self, sessions: list[dict[str, Any]]) -> None:
        strict = self.get_option("strict")
        connection_vars = self._connection_vars()
        taken: set[str] = set()
        # Live sessions first, so a live session always gets its plain name as host name.
        for session in sorted(sessions, key=lambda s: profile.short_status(s.get("status")) in profile.GONE):
            host = self._host_name(session, taken)
            self.inventory.add_host(host)
            hostvars = self._host_vars(session)
            hostvars.update(connection_vars)
            for key, value in hostvars.items():
                self.inventory.set_variable(host, key, value)
            self._set_composite_vars(self.get_option("compose"), hostvars, host, strict=strict)
            self._add_host_to_composed_groups(self.get_option("groups"), hostvars, host, strict=strict)
            self._add_host_to_keyed_groups(self.get_option("keyed_groups"), hostvars, host, strict=strict)

    @staticmethod
    def _host_name(session: dict[str, Any], taken: set[str]) -> str:
        """The session name; a gone session sharing a live one's name gets its id appended.

        A name the platform would never issue (wrong characters, such as template
        braces) is not used as a host name: the session id is, and the name stays
        available, unsafe, in the host variables.
        """
        name = session.get("name") or ""
        if profile.session_name_problem(name):
            name = str(session.get("session_id"))
        if name.lower() in taken:
            name = "%s_%s" % (name, session.get("session_id"))
        taken.add(name.lower())
        return name

    def _host_vars(self, session: dict[str, Any]) -> dict[str, Any]:
        prefix = self.get_option("host_var_prefix")
        hostvars = dict((prefix + key, value) for key, value in session.items())
        hostvars[prefix + "status"] = profile.short_status(session.get("status"))
        hostvars = wrap_var(hostvars)  # API data is never a template
        hostvars["ansible_host"] = wrap_var(session.get("session_id"))
        hostvars["ansible_connection"] = self.get_option("connection_plugin")
        hostvars["ansible_python_interpreter"] = self.get_option("python_interpreter")
        return hostvars

    def _connection_vars(self) -> dict[str, Any]:
        out = {}
        for option, var in CONNECTION_VARS.items():
            value = self.get_option(option)
            if value and value.rstrip("/") != DEFAULTS[option]:
                out[var] = wrap_var(value)
        return out
