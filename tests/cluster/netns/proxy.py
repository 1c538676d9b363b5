"""A slow, lossy link in user space (this kernel has no ``netem``): a TCP proxy that holds
every chunk for ``delay_s`` each way and, with probability ``loss``, for a retransmission
timeout more, as a lost segment costs TCP. Bytes are never dropped or reordered (TCP would
not let them be); what the far side sees is the latency and the stalls of a bad link.

Put it on one host's link by making that host resolve its peer's name to the proxy
(``HostNetwork.resolve``), with the proxy listening on the peer's ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading


class SlowLink:
    RETRANSMIT_S = 0.2  # Linux's minimum TCP retransmission timeout

    def __init__(self, listen_host: str, target_host: str, ports: list[int], delay_s: float, loss: float = 0.0,
                 seed: int = 0):
        self.listen_host, self.target_host, self.ports = listen_host, target_host, ports
        self.delay_s, self.loss = delay_s, loss
        self.random = random.Random(seed)
        self.chunks = 0  # forwarded, both ways
        self.stalls = 0  # of those, held for a retransmission
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        servers = [self.loop.run_until_complete(asyncio.start_server(
            lambda r, w, port=port: self._connection(r, w, port), self.listen_host, port)) for port in self.ports]
        self._ready.set()
        self.loop.run_forever()
        for server in servers:
            server.close()

    async def _connection(self, client_reader, client_writer, port: int) -> None:
        try:
            target_reader, target_writer = await asyncio.open_connection(self.target_host, port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, target_writer), self._pipe(target_reader, client_writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward in order; each chunk leaves ``delay_s`` after it arrived (plus a stall if "lost")."""
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.ensure_future(send())
        try:
            while data := await reader.read(65536):
                hold = self.delay_s
                if self.random.random() < self.loss:
                    hold += self.RETRANSMIT_S
                    self.stalls += 1
                self.chunks += 1
                await queue.put((self.loop.time() + hold, data))
        except (ConnectionError, OSError):
            pass
        await queue.put(None)
        with contextlib.suppress(ConnectionError, OSError):
            await sender

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
