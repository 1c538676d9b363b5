"""This host's own addresses: the one its packets to a peer leave from, and the network
interface that holds an address.

A host's name is no guide to its routable address: Debian maps it to 127.0.1.1, a container
may not map it at all. What other nodes can reach is the address of the interface that routes
towards them, which the kernel tells without sending anything (a UDP socket's ``connect``
only looks up the route).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def route_to(host: str, port: int = 9) -> str:
    """The local address this host uses to reach ``host`` (a name or an address)."""
    family, _, _, _, peer = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(peer)
        return probe.getsockname()[0]


def interface_of(host: str) -> str | None:
    """The name of the interface holding ``host``'s address (Linux), or None if no interface does."""
    ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    if ip.version == 6:
        for line in _read("/proc/net/if_inet6").splitlines():
            fields = line.split()
            if len(fields) == 6 and ipaddress.ip_address(bytes.fromhex(fields[0])) == ip:
                return fields[5]
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == str(ip):
                return name
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def quiet_port_band() -> range:
    """Ports above Ray's worker ports (10002-19999) and below the kernel's ephemeral range (Linux:
    from 32768), where no outgoing connection or bind to port 0 takes one: ports drawn here and
    bound a little later stay free meanwhile. Empty where the range cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return range(20000, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return range(0)
