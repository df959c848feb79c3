"""The simulated fleet of ``bench.kv_ingest``, in processes of its own: KV-event publishers, and the nodes' HTTP.

    python -m bench.kv_fleet publish SPEC_JSON     # publishers, as vLLM 0.32 sends its events
    python -m bench.kv_fleet answer PORT [PORT...]  # every node's HTTP port, answering completions at once

A publisher is a PUB socket sending vLLM 0.32's frames ``[b"kv", seq (8 bytes, big-endian), msgpack EventBatch]``
with map events, ``extra_keys`` and ``group_idx``, and a ROUTER replay socket answering in vLLM 0.32's four frames
(``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``) from a buffer of its last batches. Its first batch
(seq 0, sent before anyone listens, so it reaches a replica by replay) stores a probe: ``PROBE_BLOCKS`` blocks of
token ids of its own, never evicted, which the benchmark's requests are routed on. Every later batch stores 1-8
fresh blocks, chained as a conversation's answer is (a chain restarts from the root every ``CHAIN`` batches), and,
once the node holds ``capacity`` blocks, removes as many of its oldest in the same batch, as a full cache evicts.

The publisher process reads commands on stdin, one JSON object a line, and answers each on stdout:
``{"rate": R}`` (batches a second per publisher; 0 pauses), ``{"report": true}`` (each publisher's batches so far
and blocks held), ``{"stop": true}``. Its first line out says it is bound.
"""

from __future__ import annotations

import functools
import heapq
import json
import os
import random
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

import msgspec
import zmq

from bench.procs import HOST

TOPIC = b"kv"
END = (-1).to_bytes(8, "big", signed=True)
PROBE_BLOCKS = 4
CHAIN = 20
"""Batches of one chain before the next begins from the root (a new conversation)."""
TICK = 0.002
"""Seconds a publisher process sleeps at least between sends: batches due meanwhile go out together."""
MODEL = "sim-model"


def probe_ids(index: int, block_size: int) -> list[int]:
    """The probe's token ids of publisher ``index``: its own, apart from every other publisher's and its flow."""
    start = 10_000 + index * PROBE_BLOCKS * block_size
    return list(range(start, start + PROBE_BLOCKS * block_size))


class Publisher:
    """One node's publisher: its sockets, sequence, replay buffer and the blocks it holds."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], spec: dict[str, Any], config: dict[str, Any]) -> None:
        self.index: int = spec["index"]
        self.block_size: int = config["block_size"]
        self.capacity: int = config["capacity"]
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's publisher keeps as many
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://{HOST}:{spec['events']}")
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://{HOST}:{spec['replay']}")
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config["buffer"])
        self.rng = random.Random(self.index)
        self.held: deque[int] = deque()
        self.last: int | None = None
        self.next_id = 1_000_000 + self.index * 100_000_000
        self.next_hash: int = self.index << 40
        self.chained = 0
        self.sent = 0
        self._send([self._stored(probe_ids(self.index, self.block_size), None, PROBE_BLOCKS)], live=False)

    def _hash(self) -> int:
        self.next_hash += 1
        return int(self.next_hash * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)

    def _stored(self, ids: list[int], parent: int | None, blocks: int) -> dict[str, Any]:
        hashes = [self._hash() for _ in range(blocks)]
        self.last = hashes[-1]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None] * blocks,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }

    def publish(self) -> None:
        """One batch: 1-8 fresh blocks, and the oldest ones removed once the node is full."""
        blocks = self.rng.randint(1, 8)
        ids = list(range(self.next_id, self.next_id + blocks * self.block_size))
        self.next_id += blocks * self.block_size
        parent = self.last if self.chained and self.held else None
        self.chained = (self.chained + 1) % CHAIN
        events = [self._stored(ids, parent, blocks)]
        self.held.extend(events[0]["block_hashes"])
        if len(self.held) > self.capacity:
            gone = [self.held.popleft() for _ in range(len(self.held) - self.capacity)]
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
        self._send(events, live=True)

    def _send(self, events: list[dict[str, Any]], live: bool) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if live:
            try:
                self.pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                pass  # over the high-water mark: the replica's replay must fill it, as with vLLM

    def answer_replays(self) -> None:
        while cast(int, self.router.getsockopt(zmq.EVENTS)) & int(zmq.POLLIN):
            frames = self.router.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3:
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    self.router.send_multipart((client, b"", TOPIC, seq.to_bytes(8, "big"), payload))
            self.router.send_multipart((client, b"", b"", END, b""))

    def report(self) -> dict[str, int]:
        return {"index": self.index, "batches": self.seq, "sent": self.sent, "held": len(self.held) + PROBE_BLOCKS}


class Publishers:
    """The publishers of one process, sending each at ``rate`` batches a second, spread in time."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, 4 * len(spec["publishers"]) + 64)
        self.publishers = [Publisher(self.context, p, spec) for p in spec["publishers"]]
        self.poller = zmq.Poller()
        for publisher in self.publishers:
            self.poller.register(publisher.router, zmq.POLLIN)
        self.stdin = sys.stdin.fileno()
        self.poller.register(self.stdin, zmq.POLLIN)
        self.rate = 0.0
        self.due: list[tuple[float, int]] = []
        self._pending = b""

    def set_rate(self, rate: float) -> None:
        self.rate = rate
        now = time.monotonic()
        count = len(self.publishers)
        # Each publisher at its own phase of the period, so the process sends evenly rather than in bursts.
        self.due = [(now + i / count / rate, i) for i in range(count)] if rate > 0 else []
        heapq.heapify(self.due)

    def send_due(self) -> None:
        now = time.monotonic()
        while self.due and self.due[0][0] <= now:
            when, i = self.due[0]
            self.publishers[i].publish()
            heapq.heapreplace(self.due, (max(when + 1 / self.rate, now - 1.0), i))

    def command(self, line: bytes) -> bool:
        """Run one command; False when it says stop."""
        message = json.loads(line)
        if "rate" in message:
            self.set_rate(float(message["rate"]))
            answer: object = {"rate": self.rate}
        elif "report" in message:
            answer = [p.report() for p in self.publishers]
        else:
            return False
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
        return True

    def run(self) -> None:
        sys.stdout.write(json.dumps({"bound": len(self.publishers)}) + "\n")
        sys.stdout.flush()
        while True:
            self.send_due()
            wait = TICK if not self.due else max(TICK, self.due[0][0] - time.monotonic())
            ready = dict(self.poller.poll(int(min(wait, 0.05) * 1000) or 1))
            for publisher in self.publishers:
                if publisher.router in ready:
                    publisher.answer_replays()
            if self.stdin in ready and not self._read_commands():
                return

    def _read_commands(self) -> bool:
        data = os.read(self.stdin, 65536)
        if not data:
            return False
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        return all(self.command(line) for line in lines if line.strip())

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.pub.close(0)
            publisher.router.close(0)
        self.context.term()


async def answer(ports: Sequence[int]) -> None:
    """Every node's HTTP: a completion answered at once, naming the node in ``x-sim-node`` as vllm-sim does."""
    import asyncio

    class Node(asyncio.Protocol):
        def __init__(self, port: int) -> None:
            self.name = f"{HOST}:{port}".encode()
            self.buffer = b""
            self.transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
                head = self.buffer[:end].decode("latin-1").lower()
                length = 0
                for line in head.split("\r\n")[1:]:
                    name, _, value = line.partition(":")
                    if name.strip() == "content-length":
                        length = int(value)
                if len(self.buffer) < end + 4 + length:
                    return
                self.buffer = self.buffer[end + 4 + length :]
                self._respond(head.split(" ", 1)[0])

        def _respond(self, method: str) -> None:
            if method == "post":
                body = (
                    b'{"id":"cmpl-1","object":"text_completion","model":"sim-model","choices":[{"index":0,'
                    b'"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
                    b'"total_tokens":2}}'
                )
            else:
                body = b'{"object":"list","data":[{"id":"sim-model","object":"model","root":"sim-model"}]}'
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-sim-node: "
                + self.name
                + b"\r\ncontent-length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
            )
            assert self.transport is not None
            self.transport.write(head + body)

    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(functools.partial(Node, port), HOST, port, backlog=64) for port in ports]
    sys.stdout.write(json.dumps({"listening": len(servers)}) + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["publish"] and len(args) == 2:
        publishers = Publishers(json.loads(args[1]))
        try:
            publishers.run()
        finally:
            publishers.close()
        return 0
    if args[:1] == ["answer"] and len(args) > 1:
        import asyncio

        asyncio.run(answer([int(p) for p in args[1:]]))
        return 0
    sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
