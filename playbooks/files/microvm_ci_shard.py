# Copyright (c) 2026, microvm.sandbox contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A pytest plugin the microvm.sandbox.ci playbook puts into each shard (`-p microvm_ci_shard`).

Keeps every SHARD_COUNT-th collected test from position SHARD_INDEX on and deselects the rest, so the shards
together run the whole suite exactly once (same sources, same collection order in every fork). Round robin over
the collected items, not whole files, so a suite with a few large files still splits evenly.
"""
from __future__ import annotations

import os
from typing import Any


def _shard() -> tuple[int, int]:
    try:
        index = int(os.environ.get("SHARD_INDEX", "0"))
        count = int(os.environ.get("SHARD_COUNT", "1"))
    except ValueError as e:
        raise SystemExit("microvm_ci_shard: SHARD_INDEX and SHARD_COUNT must be whole numbers: %s" % e) from e
    if count < 1 or not 0 <= index < count:
        raise SystemExit("microvm_ci_shard: need 0 <= SHARD_INDEX < SHARD_COUNT, got %d and %d" % (index, count))
    return index, count


def pytest_report_header(config: Any) -> str:
    index, count = _shard()
    return "microvm_ci_shard: shard %d of %d (SHARD_INDEX=%d)" % (index + 1, count, index)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    index, count = _shard()
    if count == 1:
        return
    kept = [item for n, item in enumerate(items) if n % count == index]
    dropped = [item for n, item in enumerate(items) if n % count != index]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
