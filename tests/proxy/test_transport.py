"""The data path's HTTP client against a real server on loopback: connections reused, one write per request,
abandoned responses close their connection, timeouts, the per-node connection cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from tests.support.procs import HOST
from vllm_etcd_proxy.proxy.errors import UpstreamFailed, UpstreamTimeout
from vllm_etcd_proxy.proxy.upstream.transport import HttpTransport, Origin, UpstreamRequest

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]
"""Answers one request (its head and body given); returns False to close the connection afterwards."""


class Node:
    """A scripted HTTP/1.1 server that counts connections and what arrived in each socket read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client = 0
        self.first_reads: list[bytes] = []
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    self.closed_by_client += 1
                    return
                self.first_reads.append(data)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":")[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    )
                )
                while len(body) < length:
                    body += await reader.read(65536)
                if not await self.handler(reader, writer, head):
                    writer.close()
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self._writers.discard(writer)

    def drop_idle(self) -> None:
        for writer in list(self._writers):
            writer.close()

    @property
    def origin(self) -> Origin:
        return Origin.of(f"http://{HOST}:{self.port}")


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[Node]:
    node = Node(handler)
    server = await asyncio.start_server(node._serve, HOST, 0)
    node.port = server.sockets[0].getsockname()[1]
    try:
        yield node
    finally:
        node.drop_idle()
        server.close()


def ok(body: bytes = b"hello", extra: bytes = b"") -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body))
        await writer.drain()
        return b"connection: close" not in extra

    return handle


def request(node: Node, *, timeout: float = 5.0, idle: float = 5.0) -> UpstreamRequest:
    return UpstreamRequest(
        origin=node.origin,
        path=b"/v1/completions",
        head=b"x-request-id: r1\r\n",
        body=b'{"model": "m"}',
        timeout=timeout,
        idle_timeout=idle,
    )


async def read_all(transport: HttpTransport, req: UpstreamRequest) -> tuple[int, bytes]:
    response = await transport.send(req)
    body = b""
    while chunk := await response.read():
        body += chunk
    response.close()
    return response.status, body


async def test_sequential_requests_reuse_one_connection_and_each_goes_out_in_one_write() -> None:
    async with serving(ok()) as node:
        transport = HttpTransport(connect_timeout=2, max_connections=10)
        for _ in range(5):
            assert await read_all(transport, request(node)) == (200, b"hello")
        assert node.connections == 1
        assert all(
            read.endswith(b'{"model": "m"}') and read.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            for read in node.first_reads
        )
        transport.close()


async def test_a_node_that_says_connection_close_gets_a_new_connection_next_time() -> None:
    async with serving(ok(extra=b"connection: close\r\n")) as node:
        transport = HttpTransport(connect_timeout=2, max_connections=10)
        for _ in range(3):
            assert await read_all(transport, request(node)) == (200, b"hello")
        assert node.connections == 3
        transport.close()


async def test_an_idle_connection_the_node_closed_is_not_a_failure() -> None:
    async with serving(ok()) as node:
        transport = HttpTransport(connect_timeout=2, max_connections=10)
        assert await read_all(transport, request(node)) == (200, b"hello")
        node.drop_idle()  # as vLLM's server does with keep-alive connections after 5 s
        await asyncio.sleep(0.05)
        assert await read_all(transport, request(node)) == (200, b"hello")
        assert node.connections == 2
        transport.close()


async def test_an_abandoned_response_closes_its_connection_so_the_node_can_abort() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
        while True:
            writer.write(b"6\r\ndata: \r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async with serving(endless) as node:
        transport = HttpTransport(connect_timeout=2, max_connections=10)
        response = await transport.send(request(node))
        assert await response.read()
        response.close()
        async with asyncio.timeout(5):
            while node.closed_by_client == 0 and node._writers:
                await asyncio.sleep(0.01)
        assert transport.open_connections(f"http://{HOST}:{node.port}") == 0
        transport.close()


async def test_body_bytes_that_arrived_together_come_out_together() -> None:
    async def burst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> bool:
        events = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (b"data: token-%02d\n\n" % i for i in range(10)))
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + events + b"0\r\n\r\n")
        await writer.drain()
        return True

    async with serving(burst) as node:
        transport = HttpTransport(connect_timeout=2, max_connections=10)
        response = await transport.send(request(node))
        reads = []
        while chunk := await response.read():
            reads.append(chunk)
        response.close()
        assert b"".join(reads) == b"".join(b"data: token-%02d\n\n" % i for i in range(10))
        assert len(reads) <= 2  # one socket read, at most split between the head's read and the next
        transport.close()


async def test_no_answer_is_a_timeout_and_a_stalled_body_is_an_idle_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> bool:
        await asyncio.sleep(30)
        return False

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
        await writer.drain()
        await asyncio.sleep(30)
        return False

    transport = HttpTransport(connect_timeout=2, max_connections=10)
    async with serving(silent) as node:
        with pytest.raises(UpstreamTimeout, match="did not answer within 0.2 s"):
            await transport.send(request(node, timeout=0.2))
    async with serving(stalls) as node:
        response = await transport.send(request(node, idle=0.2))
        assert await response.read() == b"part"
        with pytest.raises(UpstreamTimeout, match="stream idle timeout"):
            await response.read()
        response.close()
    transport.close()


async def test_a_node_that_breaks_off_mid_body_is_an_upstream_failure() -> None:
    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart")
        await writer.drain()
        return False

    async with serving(breaks) as node:
        transport = HttpTransport(connect_timeout=2, max_connections=10)
        response = await transport.send(request(node))
        with pytest.raises(UpstreamFailed, match="broke off"):
            while await response.read():
                pass
        response.close()
        transport.close()


async def test_nothing_listening_is_a_connect_failure() -> None:
    transport = HttpTransport(connect_timeout=2, max_connections=10)
    async with serving(ok()) as node:
        closed = request(node)
    with pytest.raises(UpstreamFailed, match="cannot connect"):
        await transport.send(closed)
    transport.close()


async def test_requests_beyond_the_connection_cap_wait_for_a_free_connection() -> None:
    release = asyncio.Event()

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> bool:
        await release.wait()
        return await ok()(reader, writer, head)

    async with serving(held) as node:
        transport = HttpTransport(connect_timeout=2, max_connections=2)
        tasks = [asyncio.create_task(read_all(transport, request(node))) for _ in range(3)]
        async with asyncio.timeout(5):
            while node.connections < 2:
                await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks)
        release.set()
        assert await asyncio.gather(*tasks) == [(200, b"hello")] * 3
        assert node.connections == 2
        with pytest.raises(UpstreamTimeout, match="connections stayed busy"):
            release.clear()
            busy = [asyncio.create_task(transport.send(request(node))) for _ in range(2)]
            await asyncio.sleep(0.05)
            await transport.send(request(node, timeout=0.2))
        release.set()
        for task in busy:
            (await task).close()
        transport.close()
