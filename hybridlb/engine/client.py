"""Synchronous client of one engine's ROUTER socket (tests, tools, the launcher's
readiness check). The API server uses its own asyncio client on the same protocol."""

from __future__ import annotations

import uuid

import zmq

from hybridlb.params import SamplingParams
from hybridlb.protocol import AbortRequests, AddRequest, EngineOutputs, EngineReady, Hello, encoder, from_engine_decoder
from hybridlb.transport import connect_securely


class EngineClient:
    def __init__(self, address: str, client_id: str | None = None, token: str | None = None):
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:8]}"
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.IDENTITY, self.client_id.encode())
        connect_securely(self.socket, address, token)
        self.socket.connect(address)

    def _send(self, message) -> None:
        self.socket.send(encoder.encode(message))

    def _recv(self, timeout_s: float):
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return from_engine_decoder.decode(self.socket.recv())

    def hello(self, timeout_s: float = 60.0) -> EngineReady:
        """Register and wait until the engine is ready; raise TimeoutError if it is not."""
        self.send_hello()
        return self.wait_ready(timeout_s)

    def send_hello(self) -> None:
        # Queued by ZMQ until the engine binds, so one Hello is enough however slow it loads.
        self._send(Hello(self.client_id))

    def wait_ready(self, timeout_s: float) -> EngineReady:
        while (message := self._recv(timeout_s)) is not None:
            if isinstance(message, EngineReady):
                return message
        raise TimeoutError(f"engine did not answer Hello within {timeout_s:.0f} s")

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, wave: int = 0) -> None:
        self._send(AddRequest(request_id, prompt_token_ids, params, wave))

    def abort(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(request_ids))

    def recv(self, timeout_s: float = 30.0) -> EngineOutputs | None:
        """The next batch of outputs, or None after ``timeout_s`` without any."""
        message = self._recv(timeout_s)
        return message if isinstance(message, EngineOutputs) else None

    def close(self) -> None:
        self.socket.close(linger=0)
