# SPDX-License-Identifier: GPL-3.0-or-later
"""egressdns and netns's pure pieces: what a restricted guest's DNS answers, and what a create refuses."""
from __future__ import annotations

import socket
import struct

import pytest
from microvm_localplane import contract, egressdns, netns

NAMES = {"a.example": ["203.0.113.9"]}


def query(name: str, qtype: int = 1, flags: int = 0x0100, qclass: int = 1, ident: int = 7) -> bytes:
    labels = b"".join(bytes([len(label)]) + label.encode() for label in name.split("."))
    return struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, qclass)


def rcode(answer: bytes) -> int:
    return answer[3] & 0xF


def addresses(answer: bytes, question_len: int) -> list[str]:
    count = struct.unpack_from("!H", answer, 6)[0]
    pos = 12 + question_len
    out = []
    for _answer in range(count):
        out.append(socket.inet_ntoa(answer[pos + 12:pos + 16]))
        pos += 16
    return out


def answer_to(data: bytes, names: dict[str, list[str]] | None = None) -> bytes:
    names = NAMES if names is None else names
    parsed = egressdns.parse_query(data)
    assert parsed is not None
    return egressdns.build_answer(parsed, names)


def test_an_allowlisted_name_is_answered_with_its_addresses_case_and_id_kept() -> None:
    data = query("A.Example", ident=4242)
    out = answer_to(data)
    assert struct.unpack_from("!H", out)[0] == 4242 and rcode(out) == 0
    assert out[12:len(data)] == data[12:]  # the question echoed as sent (0x20 case randomization survives)
    assert addresses(out, len(data) - 12) == ["203.0.113.9"]
    assert out[2] & 0x80 and out[2] & 0x01  # a response, recursion desired echoed


def test_another_name_is_nxdomain_even_one_sharing_the_address() -> None:
    out = answer_to(query("b.example"))
    assert rcode(out) == 3 and struct.unpack_from("!H", out, 6)[0] == 0
    assert rcode(answer_to(query("x.a.example"))) == 3  # a subdomain is another name


def test_other_types_of_an_allowlisted_name_are_no_data() -> None:
    out = answer_to(query("a.example", qtype=28))  # AAAA
    assert rcode(out) == 0 and struct.unpack_from("!H", out, 6)[0] == 0


def test_another_class_is_refused() -> None:
    assert rcode(answer_to(query("a.example", qclass=3))) == 5


def test_answers_stay_within_512_bytes() -> None:
    many = {"a.example": ["10.0.%d.%d" % (i // 256, i % 256) for i in range(1000)]}
    out = answer_to(query("a.example"), many)
    assert len(out) <= egressdns.MAX_ANSWER and len(addresses(out, len(query("a.example")) - 12)) == egressdns.MAX_ANSWERS
    long_name = ".".join(["x" * 63] * 3) + ".example"
    out = answer_to(query(long_name), {long_name: many["a.example"]})
    assert len(out) <= egressdns.MAX_ANSWER


@pytest.mark.parametrize("data", [
    b"",
    b"\0" * 11,
    query("a.example") + b"\0" * 600,                      # over 512 bytes
    query("a.example", flags=0x8100),                      # a response, not a query
    query("a.example", flags=0x2800),                      # opcode 5 (UPDATE)
    struct.pack("!HHHHHH", 1, 0x100, 2, 0, 0, 0) + query("a.example")[12:],   # two questions
    struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\xc0\x0c" + b"\0\1\0\1",  # a compression pointer
    struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\x05ab",                 # cut short
    struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\x3fx" * 5 + b"\0\0\1\0\1",  # labels past the data
    struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + (b"\x3f" + b"x" * 63) * 5 + b"\0\0\1\0\1",  # a name over 255
])
def test_malformed_or_unusual_queries_are_not_answered(data: bytes) -> None:
    assert egressdns.parse_query(data) is None


def test_a_guest_is_answered_only_from_its_own_address_and_interface_within_its_rate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    r = egressdns.Responder()
    r.register("10.213.0.2", 41, NAMES)
    data = query("a.example")
    assert r.handle(data, "10.213.0.2", 41) is not None
    assert r.handle(data, "10.213.0.6", 41) is None   # not a registered guest
    assert r.handle(data, "10.213.0.2", 57) is None   # its address, another interface
    clock = [1000.0]
    monkeypatch.setattr(egressdns.time, "monotonic", lambda: clock[0])
    r.register("10.213.0.2", 41, NAMES)
    answered = sum(r.handle(data, "10.213.0.2", 41) is not None for _query in range(int(egressdns.BURST) * 3))
    assert answered <= egressdns.BURST + 1
    clock[0] += 1.0
    assert r.handle(data, "10.213.0.2", 41) is not None  # refilled over time
    r.unregister("10.213.0.2", 57)   # another interface's stop leaves this guest alone
    assert r.handle(data, "10.213.0.2", 41) is not None
    r.unregister("10.213.0.2", 41)
    assert r.handle(data, "10.213.0.2", 41) is None


def test_the_dns_table_holds_names_only() -> None:
    assert netns.dns_table({"A.Example.": ["203.0.113.9"], "192.0.2.1": ["192.0.2.1"]}) == {"a.example": ["203.0.113.9"]}


def test_unresolvable_names_each_host_that_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"a.example": ["203.0.113.9"]}

    def lookup(host: str) -> tuple[list[str], Exception | None]:
        if host in table:
            return table[host], None
        try:
            return [str(netns.ipaddress.IPv4Address(host))], None
        except ValueError:
            return [], OSError("no such name")
    monkeypatch.setattr(netns, "_lookup", lookup)
    hosts = ["a.example", "nope.example", "*.b.example", "192.0.2.1", "gone.example", "nope.example"]
    assert netns.unresolvable(hosts, timeout=5) == ["nope.example", "gone.example"]
    assert netns.unresolvable(None, timeout=5) == []
    logged: list[str] = []
    assert netns.resolve_names(hosts, logged.append) == {"a.example": ["203.0.113.9"], "192.0.2.1": ["192.0.2.1"]}
    assert len(logged) == 2 and "nope.example" in logged[0]


def test_a_lookup_past_the_deadline_counts_as_unresolvable(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    release = threading.Event()

    def slow(host: str) -> tuple[list[str], Exception | None]:
        release.wait(5)
        return ["203.0.113.9"], None
    monkeypatch.setattr(netns, "_lookup", slow)
    try:
        assert netns.unresolvable(["slow.example"], timeout=0.05) == ["slow.example"]
    finally:
        release.set()


def test_the_refusal_names_the_hosts() -> None:
    assert contract.egress_unresolvable_message(["nope.example"]) == (
        "egress host 'nope.example' does not resolve: the session could not reach it; fix or remove it")
    many = contract.egress_unresolvable_message(["h%d.example" % i for i in range(12)])
    assert "'h9.example'" in many and "h10.example" not in many and "and 2 more" in many and "do not resolve" in many


def test_a_restricted_guest_names_the_planes_dns_an_open_one_the_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "resolvers", lambda: ["127.0.0.53", "192.0.2.53"])
    assert netns.guest_resolvers(["a.example"]) == [netns.GUEST_DNS]
    assert netns.guest_resolvers(None) == ["192.0.2.53"]
    assert netns.guest_resolvers("unrestricted") == ["192.0.2.53"]


def test_the_policy_batch_points_a_restricted_guest_at_the_responder() -> None:
    batch = netns._policy_batch("10.213.0.2", ["203.0.113.9"], [], 5353)
    assert "add element ip %s dnsports { 10.213.0.2 : 5353 }" % netns.TABLE in batch
    assert "dnsports" not in netns._policy_batch("10.213.0.2", None, [], None)


def test_a_hosts_file_answers_before_the_system_resolver(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts"
    hosts.write_text("# comment\n192.0.2.10 Packages.Example.com alias.example\n::1 six.example\n192.0.2.11 packages.example.com\n"
                     "not-an-address x.example\n")
    assert netns.static_hosts(str(hosts)) == {"packages.example.com": ["192.0.2.10", "192.0.2.11"],
                                              "alias.example": ["192.0.2.10"]}
    monkeypatch.setenv(netns.HOSTS_FILE_ENV, str(hosts))
    assert netns._lookup("PACKAGES.example.com.") == (["192.0.2.10", "192.0.2.11"], None)
    assert netns.static_hosts(str(tmp_path / "missing")) == {}
