"""The replica's HTTP server protocol (proxy/httpserver.py): what is written in one turn of the loop reaches the
client in one write, a close sends what is pending first, an abort drops it."""

from __future__ import annotations

import asyncio
from typing import Any

from vllm_etcd_proxy.proxy.httpserver import GatheringTransport


class RecordingTransport(asyncio.Transport):
    """A transport that keeps what it is asked to write (the socket's side of the test)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 0


async def next_turn() -> None:
    await asyncio.sleep(0)


async def test_the_writes_of_one_turn_go_out_as_one_and_a_later_turns_on_their_own() -> None:
    real = RecordingTransport()
    gathering = GatheringTransport(real, asyncio.get_running_loop())
    gathering.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    gathering.write(b"{}")
    assert real.writes == []
    await next_turn()
    assert real.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    gathering.write(b"data: 1\n\n")
    await next_turn()
    assert real.writes[1:] == [b"data: 1\n\n"]


async def test_close_sends_what_is_pending_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    real = RecordingTransport()
    closing = GatheringTransport(real, loop)
    closing.write(b"last bytes")
    closing.close()
    assert real.writes == [b"last bytes"] and real.closed
    real = RecordingTransport()
    aborting = GatheringTransport(real, loop)
    aborting.write(b"never sent")
    aborting.abort()
    await next_turn()
    assert real.writes == [] and real.aborted
