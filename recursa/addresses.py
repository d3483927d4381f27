"""Which network addresses are public: what a URL someone else chose may reach from this host.

Loopback, private, link-local (cloud metadata at 169.254.169.254), unique-local, carrier-grade NAT,
multicast, reserved and every other range Python's `ipaddress` does not call global are not. IPv4
inside IPv6 (mapped, 6to4, NAT64) is judged by the IPv4 address. This host's own addresses are
never public, whatever their range: a service bound to 0.0.0.0 answers on every one of them, a
public one included, as it does on loopback. Used by the servers' context URLs
(recursa.serve.urls) and by image URLs that sub-calls send to a provider (recursa.lm.images); and
`is_loopback_name`, which names a request may address a server by on loopback
(recursa.asgi.local_only, the trace viewer).
"""

from __future__ import annotations

import ipaddress

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # a NAT64 gateway reaches the IPv4 address inside

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_problem(ip: IPAddress) -> str | None:
    """What kind of non-public address `ip` is ("loopback", "link-local", ...), None when public."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            return address_problem(inner)
    kinds = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
        ("non-public", not ip.is_global),
    )
    kind = next((kind for kind, hit in kinds if hit), None)
    if kind is None and ip in own_addresses():
        return OWN
    return kind


OWN = "this server's own"


def own_addresses() -> frozenset[IPAddress]:
    """The addresses of this host's interfaces (read when asked: they change with DHCP and VPNs).
    Linux lists them in /proc (the kernel's local routing table, and every interface's IPv6
    addresses); elsewhere only loopback is known, besides what the classification refuses."""
    found: set[IPAddress] = {ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1")}
    try:
        with open("/proc/net/fib_trie", encoding="ascii") as fh:
            last = ""
            for line in fh:
                text = line.strip()
                if text.startswith("|--"):
                    last = text[3:].strip()
                elif text.endswith("host LOCAL") and last:
                    found.add(ipaddress.IPv4Address(last))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as fh:
            for line in fh:
                word = line.split(maxsplit=1)[0] if line.strip() else ""
                if len(word) == 32:
                    found.add(ipaddress.IPv6Address(int(word, 16)))
    except (OSError, ValueError):
        pass
    return frozenset(found)


def is_loopback_name(host: str | None) -> bool:
    """Whether a host name (no port, IPv6 with or without brackets) names this machine's loopback."""
    if not host:
        return False
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
