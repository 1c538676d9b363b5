"""Socket checks shared by the fuzz and KV-event tests: a receiver drops an oversized frame."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

HUGE = 64 * 2**20


def assert_drops_oversized(sock: zmq.Socket, address: str, frames: list[bytes] = ()) -> None:
    """A ``HUGE`` frame (after ``frames``) makes the receiver at ``address`` drop the
    connection of ``sock``, a connected socket, instead of buffering the frame."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    try:
        sock.send_multipart([*frames, b"\x00" * HUGE])
        events = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and zmq.EVENT_DISCONNECTED not in events:
            if monitor.poll(200):
                events.append(recv_monitor_message(monitor)["event"])
        assert zmq.EVENT_DISCONNECTED in events, f"{address} kept a {HUGE}-byte frame's connection: {events}"
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
