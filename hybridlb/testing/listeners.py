"""The listening TCP sockets of a process tree, read from /proc (Linux)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from hybridlb.lifecycle import descendants
from hybridlb.testing.servers import Server


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    return [pid, *descendants(pid)]


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except FileNotFoundError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6} local address (host-order 32-bit words in hex) → text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket of the process tree under ``pid``."""
    inodes = set().union(*(_socket_inodes(p) for p in _tree(pid)))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                host, port = local.split(":")
                found.add((_address(host), int(port, 16)))
    return found


def assert_loopback_only(server: Server, expected_ports: set[int]) -> None:
    found = listeners(server.process.pid)
    assert expected_ports <= {port for _, port in found}, f"missing listeners: {found}"
    exposed = [(host, port) for host, port in found if not ipaddress.ip_address(host).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {found})"
