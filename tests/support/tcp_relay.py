"""A TCP relay on loopback that a test can break, between a client and etcd: a network partition.

    relay = TcpRelay(etcd.client_port)
    await relay.start()            # relay.endpoint forwards to etcd
    await relay.cut()              # loud: every connection reset, new ones refused
    await relay.restore()
    await relay.partition()        # silent: bytes dropped both ways, connections stay open, new ones accepted
    await relay.heal()             # bytes flow again (what was dropped stays lost)

``partition()`` is what a failed switch, a security-group change or a half-dead NAT does: nobody learns
anything from the network, only from silence. Bytes are discarded, not held back, so a connection that lost
bytes is garbage after ``heal()``: a client has to open a new one.
"""

from __future__ import annotations

import asyncio
import contextlib

from tests.support.procs import HOST, free_port


class TcpRelay:
    """Forwards ``127.0.0.1:port`` to ``127.0.0.1:target_port``."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._dropping = False
        self.dropped = 0
        """Bytes thrown away while partitioned (both directions)."""

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, HOST, self.port)

    async def cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        if server is not None:
            await server.wait_closed()

    restore = start

    async def partition(self) -> None:
        """From now on drop every byte, both ways, on old and new connections alike; close nothing."""
        self._dropping = True

    async def heal(self) -> None:
        self._dropping = False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if self._dropping:
                    self.dropped += len(data)
                    continue
                writer.write(data)
                await writer.drain()
        writer.transport.abort()
        self._writers.discard(writer)
