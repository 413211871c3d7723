# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""The multiplexer's configuration: one LinkConfig per session link, built by the worker, read by the mux.

Stdlib only (it is imported by every task's worker, see _shared/frames.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Iterable

from ansible_collections.microvm.sandbox.plugins.module_utils import profile
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import errors
from ansible_collections.microvm.sandbox.plugins.plugin_utils._shared import frames as mp

DEFAULT_POOL_SIZE = min(os.cpu_count() or 1, 4)
# The most stdout + stderr of one command a task holds in memory (option max_output_bytes): a guest printing
# 200 MB took the task's process to 838 MB, as Ansible copies and decodes the output several times over.
DEFAULT_MAX_OUTPUT = 64 * 1024 * 1024
TRANSPORTS = ("agent", "api", "auto")  # the roads into a session (plugin_utils/_mux/api_road.py)


@dataclasses.dataclass(frozen=True)
class LinkConfig:
    """Everything the mux needs to open its link to one session; sent by the worker with "attach".

    `session` is the platform session's id or name (docs/glossary.md); the field names are the attach
    request's wire format, so they stay.
    """

    session: str
    token: str = dataclasses.field(repr=False)
    api_url: str = profile.DEFAULT_API_URL
    prefix: str = profile.DEFAULT_PREFIX
    agent_port: int = profile.AGENT_PORT
    connect_timeout: float = 60.0
    persist: float = 60.0
    scratch_dir: str = profile.SCRATCH_DIR
    validate_certs: bool = True
    host_tag: str = ""
    transport: str = "auto"  # agent, api or auto, the default (_mux/session_link.py picks agent or api)

    def __post_init__(self) -> None:
        # the options may arrive as strings or None (env vars, ini): normalise once, here
        object.__setattr__(self, "agent_port", int(self.agent_port or profile.AGENT_PORT))
        object.__setattr__(self, "connect_timeout", float(self.connect_timeout or 60))
        object.__setattr__(self, "persist", float(self.persist if self.persist is not None else 60))
        object.__setattr__(self, "api_url", self.api_url or profile.DEFAULT_API_URL)
        object.__setattr__(self, "prefix", self.prefix or profile.DEFAULT_PREFIX)
        object.__setattr__(self, "scratch_dir", self.scratch_dir or profile.SCRATCH_DIR)
        if self.validate_certs is None:
            object.__setattr__(self, "validate_certs", True)
        object.__setattr__(self, "transport", (self.transport or "auto").lower())
        if self.transport not in TRANSPORTS:
            raise ValueError("transport must be one of %s, got %r" % (", ".join(TRANSPORTS), self.transport))

    @property
    def key(self) -> str:
        # each road its own link: a play on `api` never rides on a link another opened on the agent
        port = self.agent_port if self.transport == "agent" else "%s/%s" % (self.agent_port, self.transport)
        return mp.link_key(self.api_url, self.prefix, self.session, port, self.token)

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)  # transport always: a request without it means agent (from_wire)

    @classmethod
    def from_wire(cls, data: dict) -> LinkConfig:
        """The config of an attach request; unknown fields are a protocol error, not silently dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise errors.ProtocolMismatch("unknown session settings %s (worker and mux versions differ?)" % ", ".join(unknown))
        if not data.get("session") or not data.get("token"):
            raise errors.ProtocolMismatch("an attach request needs a session and a token")
        # A worker of the same protocol from before `auto` became the default left `agent` off the wire.
        return cls(**dict({"transport": "agent"}, **data))


@dataclasses.dataclass(frozen=True)
class ProcessConfig:
    """What one mux process is given on its standard input when it starts (no secrets)."""

    dir: str
    slot: int = 0

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)


def protocol_digest(version: int = mp.PROTOCOL_VERSION, fields: Iterable[str] | None = None) -> str:
    """A short digest of the protocol a worker speaks: its version and the attach request's settings.

    It names the mux dir, so a collection that adds a setting (or bumps the version) starts its own mux next to
    a running older one, which refuses what it does not know, and leaves that one to idle out.
    """
    names = sorted(f.name for f in dataclasses.fields(LinkConfig)) if fields is None else sorted(fields)
    return hashlib.sha256(("%d:%s" % (version, ",".join(names))).encode("utf-8")).hexdigest()[:10]


PROTOCOL_DIGEST = protocol_digest()
# mux-<uid>-<slot>-p<digest>; the muxes of collections before protocol 4 live in mux-<uid>-<slot>
PROCESS_DIR_NAME = re.compile(r"^mux-(\d+)-(\d+)(?:-p([0-9a-f]+))?$")


def process_dir(base_dir: str, slot: int, uid: int | None = None, digest: str = PROTOCOL_DIGEST) -> str:
    """The private directory of one mux process: <base>/mux-<uid>-<slot>-p<protocol digest>."""
    return os.path.join(base_dir, "mux-%d-%d-p%s" % (os.getuid() if uid is None else uid, slot, digest))
