"""``hybridlb serve``'s entry point: run this node's ``Node`` until a signal, and start it
again from scratch when it must rejoin a restarted head under a new key (``Node._head_back``)."""

from __future__ import annotations

import errno
import logging

import zmq

from hybridlb import lifecycle
from hybridlb.config import Config
from hybridlb.launch.node import Node, NodeStartError
from hybridlb.plan import ClusterPlan, NodePlan

log = logging.getLogger("hybridlb.serve")
PORT_ERRORS = (OSError, zmq.ZMQError)  # what the launcher's own listeners (supervisor, handshake) raise


def _ready_line(node: NodePlan) -> str:
    ranks = f"rank{'s' if len(node.ranks) > 1 else ''} {node.ranks[0]}" + (
        f"..{node.ranks[-1]}" if len(node.ranks) > 1 else "")
    if node.headless:
        return f"node {node.index} (headless) is up with {ranks}"
    urls = sorted({f"http://{a.host}:{a.port}/v1" for a in node.api_servers})
    supervisor = "" if node.supervisor_port is None else \
        f"; its supervisor answers at http://{node.api_servers[0].host}:{node.supervisor_port}/readyz"
    return f"node {node.index} serves {ranks} at {', '.join(urls)}{supervisor}"


def serve(config: Config, plan: ClusterPlan, node: NodePlan, sockets: dict | None = None) -> int:
    """Run this node until SIGTERM / Ctrl-C; return the process exit code. A signal while it
    starts stops what started so far; a second one kills it all at once. ``sockets``: the API
    servers' listening sockets by name, bound before anything started (``launch.ports``)."""
    lifecycle.set_title("hybridlb:serve")
    lifecycle.configure_logging(f"hybridlb:serve:{node.index}")
    while True:
        runner = Node(config, plan, node, sockets)
        sockets = None  # a node started anew binds its ports again
        code = _run(runner, config, node)
        if runner.restart_anew is None or runner.exit_reason is not None:
            return code


def _run(runner: Node, config: Config, node: NodePlan) -> int:
    """``serve`` for one ``Node``'s life."""
    grace = config.api.shutdown_timeout_s
    signals = lifecycle.StopSignals(
        f"node {node.index} (its engines, API servers and coordinator)"
        + (f" once its requests in flight end (at most {grace:g} s; new connections are refused)" if grace else ""),
        runner.kill, on_stop=runner.request_stop)
    try:
        runner.start()
        signals.starting = False
        simulated = ", SIMULATED engines: no model runs" if config.engine.simulate is not None else ""
        print(f"hybridlb is ready: {_ready_line(node)} (model {config.served_model_name!r}{simulated})", flush=True)
        code = runner.wait()
        if runner.exit_reason:
            log.error("%s", runner.exit_reason)
        return code
    except lifecycle.Interrupted as exc:
        log.info("%s: nothing served", exc)
        return 1
    except PORT_ERRORS as exc:
        if getattr(exc, "errno", None) != errno.EADDRINUSE or not signals.starting:
            raise
        log.error("a port this node listens on was taken after the start-up check (%s); nothing is served: "
                  "start it again, or move the port", exc)
        return 2
    except NodeStartError as exc:
        if signals.requested:  # a start-up wait that gave up because of the stop
            log.info("stopped while starting")
            return 1
        log.error("%s", exc)
        return 1
    finally:
        signals.starting = False
        runner.stop()
