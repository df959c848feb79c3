"""A node's KV-cache event sockets read directly with pyzmq, for ``bench.real_vllm``: the frames as they come.

Nothing of the proxy is used here, so what is printed is what the node sent (the proxy's own reading of the
same payloads is checked apart, with ``kvcache.wire.read_batch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ANSWER_TIMEOUT = 10.0
"""Seconds to wait for each replay answer (a busy 2-core machine can hold a server's thread for seconds)."""


@dataclass(frozen=True, kw_only=True)
class Frame:
    """One PUB message: its frames as received, the seq they carry and the decoded payload."""

    frames: list[bytes]
    seq: int
    payload: Any

    def events(self) -> list[Any]:
        if isinstance(self.payload, list) and len(self.payload) >= 2 and isinstance(self.payload[1], list):
            return self.payload[1]
        return []

    def stored(self) -> list[dict[str, Any]]:
        return [e for e in self.events() if isinstance(e, dict) and e.get("type") == "BlockStored"]


def decode(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload)


class EventStream:
    """A SUB socket on a node's PUB endpoint, subscribed to every topic."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self._sub = context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self.seen: list[Frame] = []

    def read(self, timeout: float) -> Frame | None:
        """The next message, or None after ``timeout`` seconds without one."""
        if not self._sub.poll(int(timeout * 1000)):
            return None
        frames = self._sub.recv_multipart()
        seq = int.from_bytes(frames[1], "big", signed=True) if len(frames) > 1 and len(frames[1]) == 8 else -2
        payload = decode(frames[-1]) if frames else None
        frame = Frame(frames=frames, seq=seq, payload=payload)
        self.seen.append(frame)
        return frame

    def until(self, done: Callable[[list[Frame]], bool], timeout: float) -> list[Frame]:
        """Messages from now on until ``done(messages so far)`` or ``timeout``; the messages."""
        got: list[Frame] = []
        deadline = time.monotonic() + timeout
        while not done(got):
            frame = self.read(max(0.0, deadline - time.monotonic()))
            if frame is None:
                break
            got.append(frame)
        return got

    def close(self) -> None:
        self._sub.close(0)


def stored_blocks(frames: list[Frame]) -> int:
    return sum(len(e.get("block_hashes") or []) for f in frames for e in f.stored())


@dataclass(frozen=True, kw_only=True)
class Replay:
    """What a replay socket answered to ``[b"", start_seq]``: every answer's frames, and whether an end came."""

    answers: list[list[bytes]]
    ended: bool

    def batches(self) -> list[list[bytes]]:
        return [a for a in self.answers if not self.is_end(a)]

    @staticmethod
    def is_end(answer: list[bytes]) -> bool:
        return END_SEQ in answer[1:3]


def replay(context: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int = 0) -> Replay:
    """Ask a ROUTER replay socket from ``start`` as a DEALER and read the answers up to the end marker."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    answers: list[list[bytes]] = []
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while dealer.poll(int(ANSWER_TIMEOUT * 1000)):
            answer = dealer.recv_multipart()
            answers.append(answer)
            if Replay.is_end(answer):
                return Replay(answers=answers, ended=True)
    finally:
        dealer.close(0)
    return Replay(answers=answers, ended=False)


def shape(frames: list[bytes]) -> str:
    """``[b'', b'kv', seq=3, <412 B>]``: short frames as they are, an 8-byte seq as its number, others by size."""
    parts = []
    for frame in frames:
        if len(frame) == 8:
            parts.append(f"seq={int.from_bytes(frame, 'big', signed=True)}")
        elif len(frame) <= 8:
            parts.append(repr(frame))
        else:
            parts.append(f"<{len(frame)} B>")
    return "[" + ", ".join(parts) + "]"
