# SPDX-License-Identifier: GPL-3.0-or-later
"""The DNS a restricted guest sees: the session's allowlisted names, and nothing else.

A guest with an egress allowlist gets no path to the host's resolvers. Its
UDP port 53 traffic, to whatever address, is redirected by nftables
(netns.py) to this process's one responder socket, which answers from a
table fixed at boot (netns.resolve):

- an allowlisted name, type A (or ANY): its IPv4 addresses, those the host
  resolved at boot and that the guest's nft allow set holds;
- an allowlisted name, any other type (AAAA, ...): no data (NOERROR, empty);
- any other name: NXDOMAIN. Nothing is ever looked up on the guest's behalf
  (no recursion), so a guest can neither resolve nor tunnel through DNS.

A guest is hostile: a query is read only if it is at most 512 bytes, one
question, no compression; anything else is dropped unanswered. Each guest
has a token bucket (RATE queries/s, BURST at once); past it, queries are
dropped. An answer never exceeds 512 bytes. A query is answered only when it
comes from a registered guest address on the host interface recorded for
that guest (IP_PKTINFO), so a stale entry or another interface gets nothing.
"""
from __future__ import annotations

import ipaddress
import logging
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

MAX_QUERY = 512          # classic DNS over UDP; the guest's resolver sends far less
MAX_ANSWER = 512
MAX_ANSWERS = 16         # addresses per name in one answer
RATE = 50.0              # queries per second per guest, refilled continuously
BURST = 100.0
TTL = 300
TYPE_A, TYPE_ANY, CLASS_IN = 1, 255, 1
RCODE_NOERROR, RCODE_NXDOMAIN, RCODE_REFUSED = 0, 3, 5
# Linux's IP_PKTINFO (the socket module names it from Python 3.12 only)
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
_HEADER = struct.Struct("!HHHHHH")
_PKTINFO = struct.Struct("=I4s4s")  # struct in_pktinfo: ifindex, spec_dst, addr
_logger = logging.getLogger("microvm_localplane.egressdns")


@dataclass(frozen=True)
class Query:
    ident: int
    flags: int
    name: str            # lower-cased, without the trailing dot
    qtype: int
    qclass: int
    question: bytes      # the question section as sent (echoed verbatim, case included)


def parse_query(data: bytes) -> Query | None:
    """A standard query with one question, or None (then nothing is answered)."""
    if len(data) < _HEADER.size or len(data) > MAX_QUERY:
        return None
    ident, flags, qdcount, ancount, nscount, _arcount = _HEADER.unpack_from(data)
    if flags & 0x8000 or (flags >> 11) & 0xF != 0 or qdcount != 1 or ancount or nscount:
        return None  # a response, another opcode, or not one question
    pos, labels, length = _HEADER.size, [], 0
    while True:
        if pos >= len(data):
            return None
        n = data[pos]
        pos += 1
        if n == 0:
            break
        if n > 63:
            return None  # a compression pointer or a reserved label type: never in a query's question
        label = data[pos:pos + n]
        if len(label) != n:
            return None
        length += n + 1
        if length > 254:
            return None
        labels.append(label)
        pos += n
    if pos + 4 > len(data):
        return None
    qtype, qclass = struct.unpack_from("!HH", data, pos)
    try:
        name = b".".join(labels).decode("ascii").lower()
    except UnicodeDecodeError:
        name = ""  # not a host name of any allowlist
    return Query(ident, flags, name, qtype, qclass, data[_HEADER.size:pos + 4])


def build_answer(query: Query, names: dict[str, list[str]]) -> bytes:
    """The answer to a parsed query from the guest's table of allowlisted names -> IPv4 addresses."""
    flags = 0x8000 | 0x0400 | (query.flags & 0x0100)  # QR, AA, RD as asked; RA unset: there is no recursion
    answers: list[str] = []
    if query.qclass != CLASS_IN:
        rcode = RCODE_REFUSED
    elif query.name in names:
        rcode = RCODE_NOERROR
        if query.qtype in (TYPE_A, TYPE_ANY):
            room = (MAX_ANSWER - _HEADER.size - len(query.question)) // 16
            answers = names[query.name][:max(0, min(MAX_ANSWERS, room))]
    else:
        rcode = RCODE_NXDOMAIN
    out = [_HEADER.pack(query.ident, flags | rcode, 1, len(answers), 0, 0), query.question]
    for address in answers:
        # the name as a pointer to the question's (offset 12), type A, class IN, TTL, 4 bytes of address
        out.append(struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, TTL, 4) + ipaddress.IPv4Address(address).packed)
    return b"".join(out)


@dataclass
class _Guest:
    ifindex: int | None
    names: dict[str, list[str]]
    tokens: float = BURST
    stamp: float = field(default_factory=lambda: time.monotonic())  # pylint: disable=unnecessary-lambda  # late-bound: tests patch the clock

    def admit(self, now: float) -> bool:
        self.tokens = min(BURST, self.tokens + (now - self.stamp) * RATE)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Responder:
    """One UDP socket and one thread for every restricted guest of this process, keyed by guest address."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        # Any address: nftables' redirect rewrites a guest's query to its veth's host address. Packets from
        # elsewhere are never answered (unknown source, or not the recorded interface).
        self._sock.bind(("0.0.0.0", 0))
        self.port: int = self._sock.getsockname()[1]
        self._guests: dict[str, _Guest] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="egress-dns", daemon=True)
        self._thread.start()

    def register(self, guest_ip: str, ifindex: int | None, names: dict[str, list[str]]) -> None:
        with self._lock:
            self._guests[guest_ip] = _Guest(ifindex, {k: list(v) for k, v in names.items()})

    def unregister(self, guest_ip: str, ifindex: int | None) -> None:
        """Forget a guest, unless its address now belongs to a guest on another interface."""
        with self._lock:
            current = self._guests.get(guest_ip)
            if current is not None and (ifindex is None or current.ifindex in (None, ifindex)):
                del self._guests[guest_ip]

    def handle(self, data: bytes, source: str, ifindex: int | None) -> bytes | None:
        with self._lock:
            guest = self._guests.get(source)
            if guest is None or (guest.ifindex is not None and ifindex != guest.ifindex):
                return None
            if not guest.admit(time.monotonic()):
                return None
            names = guest.names
        query = parse_query(data)
        return None if query is None else build_answer(query, names)

    def _loop(self) -> None:
        space = socket.CMSG_SPACE(_PKTINFO.size)
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            while True:
                sel.select()
                try:
                    # one byte more than the largest query read: a longer datagram shows as truncated, dropped
                    data, ancillary, msg_flags, (source, port) = self._sock.recvmsg(MAX_QUERY + 1, space)
                except OSError:
                    continue
                if msg_flags & socket.MSG_TRUNC or len(data) > MAX_QUERY:
                    continue
                ifindex = None
                for level, kind, payload in ancillary:
                    if level == socket.IPPROTO_IP and kind == IP_PKTINFO and len(payload) >= _PKTINFO.size:
                        ifindex = _PKTINFO.unpack_from(payload)[0]
                try:
                    answer = self.handle(data, source, ifindex)
                    if answer is not None:
                        self._sock.sendto(answer, (source, port))
                except Exception:  # one bad packet never stops every guest's DNS
                    _logger.exception("egress DNS: a query from %s failed", source)


_responder: Responder | None = None
_responder_lock = threading.Lock()


def responder() -> Responder:
    """This process's responder, started on first use."""
    global _responder
    with _responder_lock:
        if _responder is None:
            _responder = Responder()
        return _responder


def forget(guest_ip: str, ifindex: int | None) -> None:
    """A stopped guest's entry, if this process has a responder at all (a sweep never starts one)."""
    with _responder_lock:
        current = _responder
    if current is not None:
        current.unregister(guest_ip, ifindex)
