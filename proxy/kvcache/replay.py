"""A node's KV-event replay socket, as a client: a DEALER sends ``[b"", start_seq]`` to vLLM's ROUTER, which
answers each batch it still buffers from there on, then an end marker whose seq is -1.

vLLM 0.32 answers four frames, ``[b"", topic, seq, payload]``, and ends with ``[b"", b"", -1, b""]``
(``ZmqEventPublisher._service_replay``); older vLLM answered three, ``[b"", seq, payload]`` and ``[b"", -1, b""]``.
Both are read: the frame count tells which.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Iterable

import zmq
import zmq.asyncio

from vllm_etcd_proxy.proxy.kvcache.wire import Malformed, read_seq

REPLAY_TIMEOUT = 2.0
"""Seconds to wait for each answer of a replay socket."""


def read_answer(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of one replay answer in either form (seq -1: the end). ``Malformed`` when it is neither."""
    if len(frames) == 4 and frames[0] == b"":
        return read_seq(frames[2]), frames[3]
    if len(frames) == 3 and frames[0] == b"":
        return read_seq(frames[1]), frames[2]
    raise Malformed(
        f"a replay answer of {len(frames)} frames is neither [b'', topic, seq, payload] nor [b'', seq, payload]"
    )


async def replay(
    context: zmq.asyncio.Context, endpoint: str, start: int, malformed: Callable[[str], None]
) -> AsyncGenerator[tuple[int, bytes], None]:
    """(seq, payload) of each batch the replay socket at ``endpoint`` answers from ``start`` on. Raises
    TimeoutError, Malformed or zmq.ZMQError when it does not answer, or answers what is no seq."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), REPLAY_TIMEOUT)
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT)
            try:
                seq, payload = read_answer(frames)
            except Malformed as exc:
                malformed(str(exc))
                continue
            if seq == -1:
                return
            yield seq, payload
    finally:
        dealer.close(0)


async def same_process(
    context: zmq.asyncio.Context, endpoint: str, seen: Iterable[tuple[int, bytes]], malformed: Callable[[str], None]
) -> bool:
    """Whether the replay socket still holds the batches ``seen`` ((seq, payload), the last ones a
    subscriber applied) as they were: a node that restarted holds others under those seqs. True when it cannot
    tell (it no longer has them, or does not answer)."""
    wanted = dict(seen)
    if not wanted:
        return True
    try:
        async with contextlib.aclosing(replay(context, endpoint, min(wanted), malformed)) as answers:
            async for seq, payload in answers:
                if wanted.get(seq, payload) != payload:
                    return False
    except (TimeoutError, Malformed, zmq.ZMQError):
        pass
    return True
