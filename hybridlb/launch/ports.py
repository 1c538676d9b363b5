"""The ports a node listens on, tried before it starts anything.

``hybridlb serve`` (its ``--dry-run`` too) and ``hybridlb up`` try every TCP port this machine
will listen on (``plan.listeners``, and the KV-event endpoints an engine binds) before any
process starts or any weight loads: a port in use is one line naming it and the option that
moves it, not a traceback once the model has loaded. ``serve`` then binds its API servers'
sockets itself and hands them to the API server processes, so the port a user connects to
cannot be taken between the check and the start; a port taken in that moment is the same one
line.
"""

from __future__ import annotations

import errno
import socket

from hybridlb.config import Config
from hybridlb.plan import ClusterPlan, Listener, NodePlan, listeners


class PortTaken(RuntimeError):
    """A port of this node cannot be listened on; the message says which and what to do."""


def node_listeners(config: Config, plan: ClusterPlan, node: NodePlan, head_block: bool = True) -> list[Listener]:
    """Every TCP port ``node`` listens on: the plan's (``plan.listeners``), then its engines' KV-event endpoints."""
    return listeners(plan, node, head_block) + _kv_event_listeners(config, node)


def try_ports(wanted: list[Listener]) -> tuple[list[str], list[str]]:
    """Listen on each port for a moment: (problems, warnings), one line each. A host that is not
    this machine's, or does not resolve here, cannot be tried: one warning per host says so."""
    problems = []
    untried: dict[tuple[str, str], list[Listener]] = {}  # (host, why) → its ports
    for listener in wanted:
        if listener.port == 0:  # the kernel picks a free one
            continue
        try:
            _listen(listener.host, listener.port).close()
        except socket.gaierror:
            untried.setdefault((listener.host, "it does not resolve here"), []).append(listener)
        except OSError as exc:
            if exc.errno != errno.EADDRNOTAVAIL:
                problems.append(port_problem(listener, exc))
                continue
            why = ("it is not an address of this machine, so nothing here can listen on it (run this node where it "
                   "is, or fix the address)")
            untried.setdefault((listener.host, why), []).append(listener)
    warnings = [f"port{'s' * (len(group) > 1)} {', '.join(str(each.port) for each in group)} on {host} "
                f"({', '.join(each.what for each in group)}) not checked: {why}"
                for (host, why), group in untried.items()]
    return problems, warnings


def port_problem(listener: Listener, exc: OSError) -> str:
    """One line: the port that cannot be listened on, why, and the fix."""
    port, host = listener.port, listener.host
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use (wanted by {listener.what}: stop what holds it, "
                f"`ss -ltnp 'sport = :{port}'` names it, or pick another with {listener.option})")
    if exc.errno == errno.EACCES:
        return (f"port {port} on {host} needs privileges (wanted by {listener.what}: ports below 1024 need root or "
                f"CAP_NET_BIND_SERVICE; pick one above 1023 with {listener.option})")
    return f"cannot listen on port {port} on {host} ({listener.what}): {exc.strerror}; pick another with " \
           f"{listener.option}"


def bind_api_servers(node: NodePlan) -> dict[str, socket.socket]:
    """The listening socket of each of ``node``'s API servers (by name), bound now, before the
    engines load; raise PortTaken with one line if one cannot be."""
    from hybridlb.api.http_server import listen

    ports = [api.port for api in node.api_servers]
    bound: dict[str, socket.socket] = {}
    for api in node.api_servers:
        try:
            bound[api.name] = listen(api.host, api.port, ports.count(api.port) > 1)
        except OSError as exc:
            for sock in bound.values():
                sock.close()
            wanted = Listener(api.host, api.port, f"API server {api.name}", "--port (api.port)")
            raise PortTaken(port_problem(wanted, exc)) from None
    return bound


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port with the options every hybridlb listener sets (SO_REUSEADDR:
    a connection of a process that exited does not hold the port)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1)
    except OSError:
        sock.close()
        raise
    return sock


def _kv_event_listeners(config: Config, node: NodePlan) -> list[Listener]:
    """The tcp endpoints this node's engines bind for KV-cache events (``engine.kv_events``)."""
    from hybridlb.engine.kv_events import DEFAULT_ENDPOINT, binds_endpoint, rank_endpoint

    events = config.engine.kv_events
    if events is None or not events.enabled:
        return []
    option = "--kv-events-config (engine.kv_events; rank r takes the port + r)"
    found = []
    for rank in node.ranks:
        endpoint = rank_endpoint(events.endpoint or DEFAULT_ENDPOINT, rank)
        if events.endpoint is None or binds_endpoint(endpoint):
            found += _tcp(endpoint, f"the KV events of engine {rank}", option)
        if events.replay_endpoint:
            found += _tcp(rank_endpoint(events.replay_endpoint, rank), f"the KV-event replay of engine {rank}", option)
    return found


def _tcp(endpoint: str, what: str, option: str) -> list[Listener]:
    """A ZMQ tcp:// endpoint as a Listener (none for ipc:// or inproc://)."""
    if not endpoint.startswith("tcp://"):
        return []
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    if not port.isdigit():
        return []
    return [Listener("0.0.0.0" if host == "*" else host, int(port), what, option)]
