"""Resolving a `dns:` target to the addresses behind it, as gRPC's own resolver reads the name:
`dns:///host:port` through the system resolver, `dns://AUTHORITY/host:port` by asking the DNS
server AUTHORITY (host:port, port 53 by default) for the name's A and AAAA records.

gRPC Python resolves names only inside a channel and does not tell the application which addresses
it found; the gateway needs each address as a replica of its own (placement, health, metrics), so
it resolves here. No DNS client is among the run-time dependencies, and an A/AAAA query is small,
hence `_query` below.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import struct
from dataclasses import dataclass

DNS_PORT = 53
_A, _AAAA, _IN = 1, 28, 1


@dataclass(frozen=True)
class DnsName:
    """A `dns:[//AUTHORITY]/host:port` target; `authority` "" is the system resolver."""

    text: str
    authority: str
    host: str
    port: int


def parse_targets(spec: str, key: str) -> list[str | DnsName]:
    """A `verifier_address` / `drafter_address` value as its targets; ValueError naming `key`."""
    targets: list[str | DnsName] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise ValueError(f"[gateway] {key}: empty address in {spec!r}")
        try:
            targets.append(parse_dns(part) if part.startswith("dns:") else part)
        except ValueError as exc:
            raise ValueError(f"[gateway] {key}: {exc}") from None
    return targets


def parse_dns(target: str) -> DnsName:
    """A `dns:` target's parts; ValueError saying what is missing."""
    rest = target[len("dns:"):]
    authority = ""
    if rest.startswith("//"):
        authority, _, rest = rest[2:].partition("/")
    else:
        rest = rest.lstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{target!r}: expected dns:///HOST:PORT or dns://DNS-SERVER/HOST:PORT")
    return DnsName(target, authority, host.strip("[]"), int(port))


async def resolve(name: DnsName, timeout: float = 2.0) -> list[str]:
    """The name's addresses as gRPC targets ("ip:port", "[ip6]:port"), sorted; OSError / TimeoutError
    when the resolver cannot be asked or does not answer. A name that does not exist resolves to []."""
    if name.authority:
        loop = asyncio.get_running_loop()
        ips = await loop.run_in_executor(None, _query_all, name.authority, name.host, timeout)
    else:
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(name.host, name.port, type=socket.SOCK_STREAM), timeout
            )
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            raise
        ips = {info[4][0] for info in infos}
    return sorted(_target(ip, name.port) for ip in ips)


def _target(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


def _query_all(authority: str, host: str, timeout: float) -> set[str]:
    server, sep, port = authority.rpartition(":")
    if not sep or not port.isdigit():  # no port given
        server, port = authority, str(DNS_PORT)
    return _query(server.strip("[]"), int(port), host, _A, timeout) | _query(
        server.strip("[]"), int(port), host, _AAAA, timeout
    )


def _query(server: str, port: int, host: str, qtype: int, timeout: float) -> set[str]:
    """One UDP question (RFC 1035 section 4): the addresses of `host`'s records of `qtype`."""
    ident = secrets.randbits(16)
    question = b"".join(bytes([len(label)]) + label.encode("idna") for label in host.rstrip(".").split("."))
    packet = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + b"\0" + struct.pack(">HH", qtype, _IN)
    family = socket.AF_INET6 if ":" in server else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(packet, (server, port))
        while True:
            reply, _ = sock.recvfrom(4096)
            if len(reply) >= 12 and struct.unpack(">H", reply[:2])[0] == ident:
                break
    _, flags, qd, an, _, _ = struct.unpack(">HHHHHH", reply[:12])
    rcode = flags & 0xF
    if rcode == 3:  # NXDOMAIN: the name does not exist (no replicas)
        return set()
    if rcode:
        raise OSError(f"DNS server {server}:{port} answered rcode {rcode} for {host}")
    at = 12
    for _ in range(qd):
        at = _skip_name(reply, at) + 4
    found = set()
    for _ in range(an):
        at = _skip_name(reply, at)
        rtype, _rclass, _ttl, length = struct.unpack(">HHIH", reply[at : at + 10])
        data = reply[at + 10 : at + 10 + length]
        at += 10 + length
        if rtype == qtype == _A and length == 4:
            found.add(socket.inet_ntop(socket.AF_INET, data))
        elif rtype == qtype == _AAAA and length == 16:
            found.add(socket.inet_ntop(socket.AF_INET6, data))
    return found


def _skip_name(packet: bytes, at: int) -> int:
    """The offset just past the (possibly compressed) name at `at`."""
    while True:
        length = packet[at]
        if length & 0xC0 == 0xC0:  # a pointer ends the name
            return at + 2
        if length == 0:
            return at + 1
        at += 1 + length
