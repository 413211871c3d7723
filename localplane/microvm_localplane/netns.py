"""Guest egress: a veth pair per guest, NAT to the host's uplink, nftables allow-lists.

Every guest has its own network namespace (bwrap --unshare-net): loopback only
until this module gives it an `eth0`. Egress modes (the session's `egress`):

- None or "unrestricted": open egress, NAT through the host's default route,
  DNS from the host's resolvers.
- a list of hosts (names or IPv4 addresses): names are resolved on the host
  once, at boot. The guest reaches only those addresses, and its DNS is the
  plane's own responder (egressdns.py): every UDP query to port 53 is
  redirected there, and it answers the allowlisted names (with exactly the
  addresses the allow set holds) and NXDOMAIN for any other name; the host's
  resolvers are out of the guest's reach. A name that no longer resolves at
  boot is skipped and logged to the guest's log (the session's create checks
  every name first: `unresolvable`).

"Filtered by name" means the guest learns addresses only for allowlisted
names; it does not mean the connection is checked against the name. Another
name served from an allowlisted address does not resolve in the guest, but
the address is reachable whatever name the guest puts on it (its own
/etc/hosts, an HTTP Host header, a TLS SNI): nothing here reads those.
`*.` wildcards match nothing (there is no name to resolve at boot).

Whatever the mode, a guest can reach neither the host itself (no service of
the control plane, no other listener) nor another guest. If anything fails
the guest keeps no network at all: never more open than asked.

Addressing: guest i gets 10.213.0.0/16's i-th /30 (host side .1, guest .2);
interfaces are `mvl<i>` on the host and `eth0` in the guest. The veth pair
vanishes with the guest's namespace; the nftables elements are removed on stop.
Slots are machine-wide (several control planes may run), taken under a lock.
The nftables table is machine-wide too; each plane's responder has its own
port, which the guest's `dnsports` element names.
"""
import fcntl
import ipaddress
import os
import re
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from . import egressdns

TABLE = "microvm_localplane"
SUBNET = ipaddress.ip_network("10.213.0.0/16")
IF_PREFIX = "mvl"
SLOTS = SUBNET.num_addresses // 4
LOCK_FILE = "/run/microvm-localplane-net.lock"
TOOLS = {"ip": "/usr/sbin/ip", "nft": "/usr/sbin/nft", "nsenter": "/usr/bin/nsenter"}
# The nameserver a restricted guest's resolv.conf names. Any address would do (all its UDP port 53 goes to the
# plane's responder); a link-local one is never a real destination of a guest (the forward chain drops them).
GUEST_DNS = "169.254.53.53"

# `resolvers` is no longer used by this version; it stays declared because planes of an older version on the same
# host add the host's resolvers to it and would fail on a table without it.
RULESET = """
table ip %(table)s {
    set restricted { type ipv4_addr; }
    set allowed { type ipv4_addr . ipv4_addr; }
    set resolvers { type ipv4_addr; }
    map dnsports { type ipv4_addr : inet_service; }
    chain forward {
        type filter hook forward priority 0; policy accept;
        iifname "%(prefix)s*" oifname "%(prefix)s*" drop
        iifname "%(prefix)s*" ip saddr != %(subnet)s drop
        iifname "%(prefix)s*" ip daddr { 127.0.0.0/8, 169.254.0.0/16 } drop
        oifname "%(prefix)s*" ct state established,related accept
        oifname "%(prefix)s*" drop
        iifname "%(prefix)s*" ip saddr . ip daddr @allowed accept
        iifname "%(prefix)s*" ip saddr @restricted drop
    }
%(dns)s
    chain input {
        type filter hook input priority 0; policy accept;
        iifname "%(prefix)s*" ct state established,related accept
%(dns_input)s
        iifname "%(prefix)s*" drop
    }
    chain postrouting {
        type nat hook postrouting priority 100; policy accept;
        ip saddr %(subnet)s oifname != "%(prefix)s*" masquerade
    }
}
"""
# A restricted guest's DNS: its UDP port 53, to any address, goes to its plane's responder (the port its dnsports
# element names) on the host end of its veth; the input chain lets exactly those redirected queries in.
DNS_CHAIN = """    chain prerouting {
        type nat hook prerouting priority -100; policy accept;
        iifname "%(prefix)s*" meta l4proto udp udp dport 53 ip saddr @dnsports redirect to : ip saddr map @dnsports
    }"""
DNS_INPUT = '''        iifname "%(prefix)s*" meta l4proto udp ct status dnat ct original proto-dst 53 ip saddr @dnsports accept'''


def _ruleset() -> str:
    names = {"table": TABLE, "prefix": IF_PREFIX, "subnet": SUBNET}
    return RULESET % dict(names, dns=DNS_CHAIN % names, dns_input=DNS_INPUT % names)


# IPv6: guests get no IPv6 route, and their veths none at all (disable_ipv6 on both ends);
# this table drops whatever IPv6 a guest's interface could still send (link-local fe80::/10
# to the host, or to another guest), whatever the guest does inside.
GUARD6 = """
table ip6 %(table)s {
    chain input { type filter hook input priority 0; policy accept; iifname "%(prefix)s*" drop; }
    chain forward { type filter hook forward priority 0; policy accept; iifname "%(prefix)s*" drop; oifname "%(prefix)s*" drop; }
}
"""


class EgressError(Exception):
    pass


def parse_egress(egress):
    """-> None for open egress, else the list of allowed hosts. Refuses anything else."""
    if egress is None or egress == "unrestricted":
        return None
    if isinstance(egress, (list, tuple)) and all(isinstance(h, str) and h.strip() for h in egress):
        return [h.strip() for h in egress]
    raise EgressError("egress must be omitted, \"unrestricted\" or a list of hosts, got %r" % (egress,))


def available():
    return all(os.access(p, os.X_OK) for p in TOOLS.values())


def _run(argv, stdin=None, check=True):
    proc = subprocess.run(argv, input=stdin, capture_output=True, check=False, text=True)
    if check and proc.returncode != 0:
        raise EgressError("%s failed: %s" % (" ".join(argv[:3]), (proc.stderr or proc.stdout).strip()[-300:]))
    return proc


def guest_resolvers(egress: object = None) -> list[str]:
    """The nameservers of a guest's resolv.conf. Open egress: the host's resolvers a guest can use (not the host's
    loopback: a guest never reaches it). An allowlist: the plane's responder, whatever the address (GUEST_DNS)."""
    if parse_egress(egress) is not None:
        return [GUEST_DNS]
    return [r for r in resolvers() if not ipaddress.ip_address(r).is_loopback]


def resolvers():
    found = []
    try:
        with open("/etc/resolv.conf") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    try:
                        if ipaddress.ip_address(parts[1]).version == 4:
                            found.append(parts[1])
                    except ValueError:
                        pass
    except OSError:
        pass
    return found


# A hosts file (the /etc/hosts format) the plane reads before the system's resolver: names a private network
# resolves for its own sessions, or, in the tests, the example names the documentation uses. IPv4 entries only.
HOSTS_FILE_ENV = "MICROVM_LOCALPLANE_HOSTS"


def static_hosts(path: str | None = None) -> dict[str, list[str]]:
    """name (lower case) -> sorted IPv4 addresses, from MICROVM_LOCALPLANE_HOSTS (empty when unset or unreadable)."""
    path = path if path is not None else os.environ.get(HOSTS_FILE_ENV, "")
    found: dict[str, set[str]] = {}
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return {}
    for line in lines:
        words = line.split("#", 1)[0].split()
        if len(words) < 2:
            continue
        try:
            address = str(ipaddress.IPv4Address(words[0]))
        except ValueError:
            continue
        for name in words[1:]:
            found.setdefault(name.lower().rstrip("."), set()).add(address)
    return {name: sorted(addrs) for name, addrs in found.items()}


def _lookup(host: str) -> tuple[list[str], Exception | None]:
    try:
        return [str(ipaddress.IPv4Address(host))], None
    except ValueError:
        pass
    listed = static_hosts().get(host.lower().rstrip("."))
    if listed:
        return listed, None
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos}), None
    except (socket.gaierror, UnicodeError, OSError) as e:
        return [], e


# Lookups of every create and boot share these few threads: a flood of names queues, never spawns threads.
_LOOKUPS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="egress-lookup")


def is_wildcard(host: str) -> bool:
    return host.startswith("*.")


def resolve_names(hosts: list[str], log: Callable[[str], None]) -> dict[str, list[str]]:
    """Allowed hosts -> {host: its IPv4 addresses} (resolved now, once; in parallel). A host that does not
    resolve is left out and logged; wildcards have nothing to resolve."""
    wanted = [h for h in dict.fromkeys(hosts) if not is_wildcard(h)]
    names: dict[str, list[str]] = {}
    for host, (found, error) in zip(wanted, _LOOKUPS.map(_lookup, wanted)):
        if error is not None or not found:
            log("egress: %s does not resolve (%s); not allowed" % (host, error))
        else:
            names[host] = found
    return names


def resolve(hosts: list[str], log: Callable[[str], None]) -> list[str]:
    """Allowed hosts -> sorted IPv4 addresses (resolved now, once; names in parallel)."""
    return sorted({a for found in resolve_names(hosts, log).values() for a in found})


def unresolvable(hosts: list[str] | None, timeout: float) -> list[str]:
    """The hosts of an allowlist that do not resolve on this host now (within `timeout` seconds in all), in order.
    Wildcards and IPv4 addresses are never among them."""
    wanted = [h for h in dict.fromkeys(hosts or []) if not is_wildcard(h)]
    futures = [(h, _LOOKUPS.submit(_lookup, h)) for h in wanted]
    deadline = time.monotonic() + timeout
    missing = []
    for host, future in futures:
        try:
            found, error = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            found, error = [], TimeoutError()
        if error is not None or not found:
            missing.append(host)
    return missing


def dns_table(names: dict[str, list[str]]) -> dict[str, list[str]]:
    """What the guest's DNS answers: allowlisted names only (an IPv4 address is no name to answer for)."""
    out = {}
    for host, found in names.items():
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            out[host.rstrip(".").lower()] = list(found)
    return out


def uplink_mtu():
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1] == "00000000":
                    with open("/sys/class/net/%s/mtu" % fields[0]) as m:
                        return int(m.read())
    except (OSError, ValueError, IndexError):
        pass
    return 1500


_host_ready = False


def ensure_host_setup() -> None:
    """Forwarding on, our nftables table present and current (idempotent; checked once per process)."""
    global _host_ready
    if _host_ready:
        return
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        if f.read().strip() != "1":
            with open("/proc/sys/net/ipv4/ip_forward", "w") as w:
                w.write("1")
    if _run([TOOLS["nft"], "list", "table", "ip", TABLE], check=False).returncode != 0:
        _run([TOOLS["nft"], "-f", "-"], stdin=_ruleset())
    else:
        _upgrade_table()
    if _run([TOOLS["nft"], "list", "table", "ip6", TABLE], check=False).returncode != 0:
        _run([TOOLS["nft"], "-f", "-"], stdin=GUARD6 % {"table": TABLE, "prefix": IF_PREFIX})
    _host_ready = True


def _upgrade_table() -> None:
    """A table an older plane made (the table is machine-wide): bring its rules to this version's, in place."""
    forward = _run([TOOLS["nft"], "-a", "list", "chain", "ip", TABLE, "forward"], check=False).stdout
    names = {"table": TABLE, "prefix": IF_PREFIX}
    if "169.254.0.0/16" not in forward:
        # a table from before link-local was refused: add the rule at the top of the chain
        _run([TOOLS["nft"], "insert", "rule", "ip", TABLE, "forward", "iifname", '"%s*"' % IF_PREFIX, "ip", "daddr",
              "{ 127.0.0.0/8, 169.254.0.0/16 }", "drop"])
    batch = []
    if _run([TOOLS["nft"], "list", "map", "ip", TABLE, "dnsports"], check=False).returncode != 0:
        # before the plane's own DNS: a restricted guest's queries went to the host's resolvers, which resolve
        # any name. Add the redirect and its input rule; the resolvers rule goes (below).
        batch.append("add map ip %s dnsports { type ipv4_addr : inet_service; }" % TABLE)
        batch.append("add chain ip %s prerouting { type nat hook prerouting priority -100; policy accept; }" % TABLE)
        batch.append("add rule ip %s prerouting %s" % (TABLE, DNS_CHAIN.split("\n")[2].strip() % names))
        batch.append("insert rule ip %s input %s" % (TABLE, DNS_INPUT.strip() % names))
    for handle in re.findall(r"@resolvers .*# handle (\d+)", forward):
        batch.append("delete rule ip %s forward handle %s" % (TABLE, handle))
    if batch:
        _run([TOOLS["nft"], "-f", "-"], stdin="\n".join(batch) + "\n")


def slot_addresses(slot):
    base = int(SUBNET.network_address) + slot * 4
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


def _policy_batch(guest_ip: str, allowed: list[str] | None, stale: list[str], dns_port: int | None = None) -> str:
    """One nft transaction: forget whatever an earlier guest with this address left, then
    restrict this one if it has an allow-list. (add-then-delete never fails on a missing element.)
    The caller has removed the address's dnsports element first (_forget_dns_port): a map element cannot be
    added over one with another value."""
    lines = ["add element ip %s restricted { %s }" % (TABLE, guest_ip),
             "delete element ip %s restricted { %s }" % (TABLE, guest_ip)]
    for old in stale:
        lines.append("delete element ip %s allowed { %s . %s }" % (TABLE, guest_ip, old))
    if allowed is not None:
        lines.append("add element ip %s restricted { %s }" % (TABLE, guest_ip))
        if allowed:
            lines.append("add element ip %s allowed { %s }" % (TABLE, ", ".join("%s . %s" % (guest_ip, a) for a in allowed)))
        if dns_port is not None:
            lines.append("add element ip %s dnsports { %s : %d }" % (TABLE, guest_ip, dns_port))
    return "\n".join(lines) + "\n"


def _forget_dns_port(guest_ip: str) -> None:
    """Remove the address's dnsports element, whatever port it names (absent is fine)."""
    _run([TOOLS["nft"], "delete", "element", "ip", TABLE, "dnsports", "{ %s }" % guest_ip], check=False)


def stale_allowed(guest_ip):
    listing = _run([TOOLS["nft"], "list", "set", "ip", TABLE, "allowed"], check=False).stdout
    return sorted({b for a, b in re.findall(r"(\d+\.\d+\.\d+\.\d+) \. (\d+\.\d+\.\d+\.\d+)", listing)
                   if a == guest_ip})


def clear_elements(guest_ip, allowed):
    """Remove a guest's policy entries on stop."""
    batch = ["add element ip %s restricted { %s }" % (TABLE, guest_ip),
             "delete element ip %s restricted { %s }" % (TABLE, guest_ip)]
    for a in allowed or []:
        batch += ["add element ip %s allowed { %s . %s }" % (TABLE, guest_ip, a),
                  "delete element ip %s allowed { %s . %s }" % (TABLE, guest_ip, a)]
    _run([TOOLS["nft"], "-f", "-"], stdin="\n".join(batch) + "\n", check=False)
    _forget_dns_port(guest_ip)


def setup(pid, egress, log):
    """Give the guest whose PID 1 is pid its eth0 and egress policy; -> record for teardown()."""
    hosts = parse_egress(egress)
    if not available():
        raise EgressError("ip, nft and nsenter are needed for guest networking")
    names = resolve_names(hosts, log) if hosts is not None else None
    allowed = sorted({a for found in names.values() for a in found}) if names is not None else None
    dns = egressdns.responder() if names is not None else None
    ensure_host_setup()
    os.makedirs(os.path.dirname(LOCK_FILE), exist_ok=True)
    with open(LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        slot = next((i for i in range(SLOTS) if not os.path.exists("/sys/class/net/%s%d" % (IF_PREFIX, i))), None)
        if slot is None:
            raise EgressError("no free guest network slot")
        host_if = "%s%d" % (IF_PREFIX, slot)
        host_ip, guest_ip = slot_addresses(slot)
        mtu = uplink_mtu()
        # The policy goes in before the guest has a route, so it never sees an open moment.
        # Stale allow entries only matter to a restricted guest (an open one is not filtered).
        stale = stale_allowed(guest_ip) if allowed is not None else []
        _forget_dns_port(guest_ip)
        _run([TOOLS["nft"], "-f", "-"], stdin=_policy_batch(guest_ip, allowed, stale, dns.port if dns else None))
        _run([TOOLS["ip"], "link", "add", host_if, "mtu", str(mtu), "type", "veth", "peer", "name", "eth0",
              "mtu", str(mtu), "netns", str(pid)])
        ifindex = _ifindex(host_if)
        _disable_ipv6("/proc/sys/net/ipv6/conf/%s/disable_ipv6" % host_if)
        _run([TOOLS["ip"], "-batch", "-"], stdin="addr add %s/30 dev %s\nlink set %s up\n" % (host_ip, host_if, host_if))
    record = {"slot": slot, "host_if": host_if, "guest_ip": guest_ip, "allowed": allowed, "ifindex": ifindex,
              "names": dns_table(names) if names is not None else None}
    if dns is not None:
        dns.register(guest_ip, ifindex, record["names"])
    try:
        _run([TOOLS["nsenter"], "--net=/proc/%d/ns/net" % pid, "sh", "-c",
              "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6 && exec %s -batch -" % TOOLS["ip"]],
             stdin="addr add %s/30 dev eth0\nlink set eth0 up\nroute add default via %s\n" % (guest_ip, host_ip))
    except Exception:
        teardown(record)
        raise
    return record


def reattach(record: dict | None) -> None:
    """A live guest of an earlier plane process (adopted): its DNS is this process's responder from now on."""
    if not record or record.get("allowed") is None:
        return
    os.makedirs(os.path.dirname(LOCK_FILE), exist_ok=True)
    with open(LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now, ours = _ifindex(record["host_if"]), record.get("ifindex")
        if now is None or (ours is not None and now != ours):
            return  # its link is gone, or the slot is another guest's now
        ensure_host_setup()
        dns = egressdns.responder()
        dns.register(record["guest_ip"], ours, record.get("names") or {})
        _forget_dns_port(record["guest_ip"])
        _run([TOOLS["nft"], "add", "element", "ip", TABLE, "dnsports", "{ %s : %d }" % (record["guest_ip"], dns.port)])


def _disable_ipv6(path):
    try:
        with open(path, "w") as f:
            f.write("1")
    except FileNotFoundError:
        pass  # a kernel without IPv6


def _ifindex(name):
    """The host interface's index (never reused soon on a host), or None when there is no such interface."""
    try:
        with open("/sys/class/net/%s/ifindex" % name) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def teardown(record):
    """Remove this guest's veth and policy elements, and nothing of a guest that took its slot since.

    The veth vanishes with the guest's namespace, which frees the slot at once: by the time a stop gets here,
    another guest (of this plane or of another on the host) may hold the same `mvl<i>` and guest address. Under
    the slot lock, the interface is ours only if its index is the one recorded at setup.
    """
    if not record:
        return
    os.makedirs(os.path.dirname(LOCK_FILE), exist_ok=True)
    with open(LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = _ifindex(record["host_if"])
        ours = record.get("ifindex")
        if now is not None and ours is not None and now != ours:
            return  # the slot is another guest's now: its link and its policy elements are not ours to remove
        if now is not None:
            _run([TOOLS["ip"], "link", "del", record["host_if"]], check=False)
        clear_elements(record["guest_ip"], record.get("allowed"))
        if record.get("allowed") is not None:
            egressdns.forget(record["guest_ip"], ours)
