"""netns.teardown: a stopping guest removes its own veth and policy, never those of a guest that took its slot."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from microvm_localplane import netns


def record(ifindex: int) -> dict[str, Any]:
    return {"slot": 2, "host_if": "mvl2", "guest_ip": "10.213.0.10", "allowed": ["192.0.2.1"], "ifindex": ifindex}


def fake_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, now: int | None) -> list[tuple[str, object]]:
    done: list[tuple[str, object]] = []
    monkeypatch.setattr(netns, "LOCK_FILE", str(tmp_path / "net.lock"))
    monkeypatch.setattr(netns, "_ifindex", lambda name: now)
    monkeypatch.setattr(netns, "_run", lambda argv, stdin=None, check=True: done.append(("run", argv[1:])))
    monkeypatch.setattr(netns, "clear_elements", lambda ip, allowed: done.append(("clear", ip)))
    return done


def test_its_own_link_and_elements_are_removed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    done = fake_host(monkeypatch, tmp_path, now=41)
    netns.teardown(record(41))
    assert done == [("run", ["link", "del", "mvl2"]), ("clear", "10.213.0.10")]


def test_a_link_gone_with_the_namespace_leaves_only_the_elements_to_clear(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    done = fake_host(monkeypatch, tmp_path, now=None)
    netns.teardown(record(41))
    assert done == [("clear", "10.213.0.10")]


def test_a_slot_another_guest_took_since_is_left_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # the guest's namespace died (its veth with it), another guest booted into mvl2: its link and its
    # egress policy (same guest address) must survive this late teardown
    done = fake_host(monkeypatch, tmp_path, now=57)
    netns.teardown(record(41))
    assert done == []
