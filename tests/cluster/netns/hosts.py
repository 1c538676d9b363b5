"""Hosts on one machine: Linux network namespaces joined by a bridge.

Each host is a namespace with its own network stack: one veth link to a bridge in the
root namespace, an address from the test-bed range 198.18.0.0/15 (RFC 2544: never a real
network; the links route nowhere else), its own hostname (a UTS namespace per command), and
an ``/etc/hosts`` of its own (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over
it) in which every other host resolves by name. A host's own name resolves to 127.0.1.1,
Debian's default, so code that trusts "my hostname is my address" fails here as it does on
such a machine. The tests reach every host from the root namespace through the bridge's
address; cutting a host's link (``cut``) makes it unreachable from everyone, alive but silent.

Everything is removed at ``close()``, also after a failed test; names carry this process's
id, and ``sweep()`` removes what an earlier, killed run of the same process id left.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


class HostNetworkUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, no kernel support)."""


@dataclass(frozen=True)
class Host:
    name: str  # its DNS name on the test bed
    hostname: str  # what it calls itself (resolves to 127.0.1.1 on it)
    netns: str
    address: str
    outer: str  # its link's end on the bridge: down cuts the host off


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class HostNetwork:
    def __init__(self, count: int, tag: str = ""):
        """``count`` hosts named node-a, node-b, ...; ``tag`` tells apart networks of one process."""
        if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
            raise HostNetworkUnavailable("network namespaces need root, iproute2's `ip` and util-linux's `unshare`")
        self.prefix = f"hlb{os.getpid() % 100000}{tag}"
        subnet = 18 + (os.getpid() % 200)  # a /24 of 198.18.0.0/15 per process, so parallel runs never clash
        self.bridge = f"{self.prefix}br"
        self.bridge_address = f"198.18.{subnet}.254"
        letters = [chr(ord("a") + i) for i in range(count)]
        self.hosts = [Host(f"node-{x}", f"host-{x}", f"{self.prefix}n{i}", f"198.18.{subnet}.{i + 1}",
                           f"{self.prefix}v{i}") for i, x in enumerate(letters)]
        self.sweep()
        try:
            self._build()
        except (subprocess.CalledProcessError, OSError) as exc:
            self.close()
            detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            raise HostNetworkUnavailable(f"could not build the namespaces: {detail}") from None

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            inner = f"{self.prefix}i{i}"
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", host.netns)
            _ip("link", "set", host.outer, "master", self.bridge)
            _ip("link", "set", host.outer, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", inner)
            _ip("-n", host.netns, "link", "set", inner, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            etc = NETNS_ETC / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            names = [f"{h.address} {h.name}" for h in self.hosts]
            (etc / "hosts").write_text("\n".join(["127.0.0.1 localhost", f"127.0.1.1 {host.hostname}", *names]) + "\n")

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def command(self, host: Host, argv: list[str], mounts: dict[str, str] | None = None) -> list[str]:
        """``argv`` as run on ``host``: in its namespace, with its hostname and, in its own mount
        namespace (``ip netns exec`` makes one), ``mounts`` (path there → directory here) bound
        in place, as a kubelet mounts a pod's volumes. One exec chain, so the process id the
        caller gets is the command's own."""
        binds = "".join(f" && mount --bind {shlex.quote(source)} {shlex.quote(target)}"
                        for target, source in (mounts or {}).items())
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--", "sh", "-c",
                f'hostname "$0"{binds} && exec "$@"', host.hostname, *argv]

    @contextlib.contextmanager
    def resolving(self, host: Host, name: str, address: str):
        """Within the block, processes on ``host`` resolve ``name`` to ``address`` (e.g. a proxy
        standing in for that name's host) instead of what it was."""
        hosts = NETNS_ETC / host.netns / "hosts"
        before = hosts.read_text()
        others = [line for line in before.splitlines() if name not in line.split()[1:]]
        hosts.write_text("\n".join([*others, f"{address} {name}"]) + "\n")
        try:
            yield
        finally:
            hosts.write_text(before)

    def alias(self, host: Host, name: str) -> None:
        """Make ``name`` resolve to ``host`` on every host (a DNS record, e.g. a pod's service name)."""
        for each in self.hosts:
            with open(NETNS_ETC / each.netns / "hosts", "a") as hosts:
                hosts.write(f"{host.address} {name}\n")

    def run(self, host: Host, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)

    def cut(self, host: Host) -> None:
        """Take the host's link down: it stays alive, its connections half-open, but nothing gets through."""
        _ip("link", "set", host.outer, "down")

    def heal(self, host: Host) -> None:
        _ip("link", "set", host.outer, "up")

    def close(self) -> None:
        self.sweep()

    def sweep(self) -> None:
        """Remove every namespace, link and hosts file with this test bed's prefix."""
        for host in self.hosts:
            # Whatever still runs in the namespace was started there by a test (Ray daemons, say).
            for pid in _ip("netns", "pids", host.netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", host.netns, check=False)  # takes the inner veth end, and so the pair, with it
            _ip("link", "del", host.outer, check=False)
            shutil.rmtree(NETNS_ETC / host.netns, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
