"""Who may talk on hybridlb's TCP sockets: CURVE keys derived from the cluster token.

With a cluster token (``data_parallel.cluster_token`` or ``HYBRIDLB_CLUSTER_TOKEN``) every
ZMQ socket that listens on TCP — the handshake, the coordinator's three, engines in
internal-LB mode — is a CURVE server whose key pair is derived from the token, and every
socket connecting to one is a CURVE client of it. Only a process that knows the token can
compute the server's public key, so a stray process cannot even finish the ZMTP handshake:
it can neither join nor inject anything, and traffic between nodes is encrypted. IPC
sockets (one node, in a private 0700 directory) stay plain. torch.distributed's store (MoE
rendezvous) is outside ZMQ and not covered.

Without a configured token, a cluster that spans nodes still gets one, drawn for the run:
``serve``'s head draws it and hands it to each node the handshake accepts (``NodeAccepted``);
``up``'s driver draws it and passes it to the actors. Every socket but the handshake is
then keyed as above, so a process that did not join cannot feed the coordinator stats or
waves. The handshake itself stays open (anyone who reaches it could register a node whose
ranks are free): the configured token is what closes it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time

import zmq
from zmq.utils import z85

_DOMAIN = b"hybridlb-curve-v1:"


def cluster_token(configured: str | None) -> str | None:
    """The token in force: the config's, else the environment's, else none."""
    return configured or os.environ.get("HYBRIDLB_CLUSTER_TOKEN") or None


def _server_keys(token: str) -> tuple[bytes, bytes]:
    secret = z85.encode(hashlib.sha256(_DOMAIN + token.encode()).digest())
    return zmq.curve_public(secret), secret


def _guarded(address: str, token: str | None) -> bool:
    return token is not None and address.startswith("tcp://")


def serve_securely(sock: zmq.Socket, address: str, token: str | None) -> None:
    """Before ``sock.bind(address)``: require the token's key from every peer (TCP only)."""
    if _guarded(address, token):
        public, secret = _server_keys(token)
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret


def connect_securely(sock: zmq.Socket, address: str, token: str | None) -> None:
    """Before ``sock.connect(address)``: speak CURVE to a server keyed by the token (TCP only)."""
    if _guarded(address, token):
        sock.curve_serverkey = _server_keys(token)[0]
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()


# ZMTP 3's greeting: a 10-byte signature, the major version, then minor version, the mechanism's
# name (20 bytes, NUL-padded), as-server and filler: 64 bytes. A peer sends its own remainder
# once it has our signature and major version.
_ZMTP_OPENING = b"\xff" + bytes(8) + b"\x7f" + b"\x03"
_GREETING_SIZE = 64


def speaks_curve(address: str, timeout_s: float = 2.0) -> bool | None:
    """Whether the ZMQ socket listening at ``address`` (``tcp://host:port``) demands CURVE, read
    from its ZMTP greeting; None when nothing there answers with one (not listening yet, a proxy
    that closed). A client without keys cannot always tell on its own: when the server reads
    the client's whole greeting at once it drops the connection before its own mechanism is
    sent, and the client sees a handshake cut short with no detail."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as conn:
            conn.sendall(_ZMTP_OPENING)
            greeting = b""
            while len(greeting) < _GREETING_SIZE and (left := deadline - time.monotonic()) > 0:
                conn.settimeout(left)
                if not (chunk := conn.recv(_GREETING_SIZE - len(greeting))):
                    break
                greeting += chunk
    except (OSError, ValueError):
        return None
    if len(greeting) < 32 or greeting[0] != 0xFF or greeting[10] < 3:
        return None
    return greeting[12:32].rstrip(b"\0") == b"CURVE"
