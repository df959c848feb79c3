"""vLLM's KV-cache events, as a node started with ``--kv-events-config`` publishes them (vllm/distributed/kv_events.py).

- A PUB socket sends ``[topic, seq (8 bytes, big-endian), payload]``, ``seq`` counting 0, 1, 2, ... per process;
  the payload is a msgpack ``EventBatch`` ``[ts, events, data_parallel_rank]`` whose events are maps tagged by
  ``type`` (vLLM 0.32; knob ``kv_events_encoding: "array"`` sends the older tagged arrays instead).
- ``BlockStored`` (full blocks only, with their token ids and parent), ``BlockRemoved`` (evictions) and
  ``AllBlocksCleared`` come from the simulated prefix cache's own behaviour (prefix_cache.py), one batch per
  step of the event loop.
- A ROUTER replay socket answers ``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` for each buffered batch
  from there, then ``[b"", b"", -1, b""]``, as vLLM 0.32 does (``_service_replay``); knob ``kv_replay_frames: 3``
  answers as older vLLM did, ``[b"", seq, payload]`` then ``[b"", -1, b""]``. The last ``buffer_steps`` batches
  are kept.
- Block hashes are the cache's own mixed with a seed drawn per process, as vLLM's are unless PYTHONHASHSEED is
  fixed: two nodes give the same tokens different hashes. Unsigned 64-bit ints, or 16 bytes
  (``kv_events_hash: "bytes"``).
- Knobs for tests: ``kv_events_drop`` (the next N batches are numbered and kept for replay but not sent) and
  ``kv_events_corrupt`` (the next N are sent with a payload that is not msgpack).

Unlike vLLM, which connects when the endpoint's host is not ``*``, the simulator always binds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from vllm_etcd_proxy.sim.knobs import Knobs

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM = "GPU"


@dataclass(frozen=True, kw_only=True)
class KvEventsConfig:
    """vLLM's KVEventsConfig, the fields the simulator uses."""

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000

    @classmethod
    def parse(cls, text: str) -> KvEventsConfig | None:
        """The JSON of ``--kv-events-config``; None when events are not enabled. ValueError when malformed."""
        config = json.loads(text)
        if not isinstance(config, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        if not config.get("enable_kv_cache_events") or config.get("publisher", "zmq") != "zmq":
            return None
        endpoint, replay = config.get("endpoint", cls.endpoint), config.get("replay_endpoint")
        topic, steps = config.get("topic", ""), config.get("buffer_steps", cls.buffer_steps)
        if (
            not isinstance(endpoint, str)
            or not isinstance(replay, str | None)
            or not isinstance(topic, str)
            or not isinstance(steps, int)
            or steps < 1
        ):
            raise ValueError("--kv-events-config: endpoint, replay_endpoint and topic are strings, buffer_steps >= 1")
        return cls(endpoint=endpoint, replay_endpoint=replay, topic=topic, buffer_steps=steps)


def _extra_keys(blocks: int, lora: str | None, salt: str | None) -> list[tuple[str, ...] | None]:
    """``extra_keys`` as vLLM 0.32 publishes them (``to_event_extra_keys``): one entry per block, None or the
    untagged keys mixed into its hash, in vLLM's order: the adapter's name (every block), media (none here),
    the cache_salt (the request's first block only)."""
    keys: list[tuple[str, ...] | None] = []
    for i in range(blocks):
        entry = (*(() if lora is None else (lora,)), *((salt,) if salt is not None and i == 0 else ()))
        keys.append(entry or None)
    return keys


def _bindable(endpoint: str) -> str:
    # zmq binds tcp://*:P itself; "[::]" needs IPv6 switched on, "::" alone is vLLM's spelling of it.
    return endpoint.replace("tcp://[::]", "tcp://*").replace("tcp://:::", "tcp://*:")


class Publisher:
    """One node's KV-event publisher: the prefix cache reports to it, it sends a batch per loop step."""

    def __init__(self, config: KvEventsConfig, knobs: Knobs, block_size: int) -> None:
        self._knobs = knobs
        self._block_size = block_size
        self._topic = config.topic.encode()
        self._seed = os.urandom(8)
        self._seq = 0
        self._events: list[Any] = []
        self._flush_planned = False
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lora_ids: dict[str, int] = {}
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(_bindable(config.endpoint))
        self._async = zmq.asyncio.Context()
        self._replay: zmq.asyncio.Socket | None = None
        if config.replay_endpoint:
            self._replay = self._async.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(_bindable(config.replay_endpoint))
        self.published = 0
        log.info("kv events publishing endpoint=%s replay=%s", config.endpoint, config.replay_endpoint)

    # -- what the prefix cache reports ------------------------------------------------------------------------

    def _hash(self, block: bytes) -> int | bytes:
        mixed = blake2b(self._seed + block, digest_size=16).digest()
        return mixed if self._knobs.kv_events_hash == "bytes" else int.from_bytes(mixed[:8], "big")

    def stored(
        self,
        parent: bytes | None,
        blocks: Sequence[bytes],
        token_ids: Sequence[int],
        *,
        lora: str | None = None,
        salt: str | None = None,
    ) -> None:
        fields = {
            "block_hashes": [self._hash(b) for b in blocks],
            "parent_block_hash": None if parent is None else self._hash(parent),
            "token_ids": list(token_ids),
            "block_size": self._block_size,
            "lora_id": None if lora is None else self._lora_id(lora),
            "medium": MEDIUM,
            "lora_name": lora,
            "extra_keys": _extra_keys(len(blocks), lora, salt),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
        self._add("BlockStored", fields)

    def _lora_id(self, name: str) -> int:
        """vLLM's ``lora_int_id``: a number per adapter, counted from 1 in the order the node first used them."""
        return self._lora_ids.setdefault(name, len(self._lora_ids) + 1)

    def removed(self, blocks: Sequence[bytes]) -> None:
        self._add("BlockRemoved", {"block_hashes": [self._hash(b) for b in blocks], "medium": MEDIUM})

    def cleared(self) -> None:
        self._add("AllBlocksCleared", {})

    def _add(self, tag: str, fields: dict[str, Any]) -> None:
        if self._knobs.kv_events_encoding == "array":
            self._events.append([tag, *fields.values()])
        else:
            self._events.append({"type": tag, **fields})
        if not self._flush_planned:
            self._flush_planned = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a unit test of the cache): send now
                self.flush()

    # -- the wire ---------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """Send the events gathered since the last flush as one batch."""
        self._flush_planned = False
        if not self._events:
            return
        payload = msgspec.msgpack.encode([time.time(), self._events, 0])
        self._events = []
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        knobs = self._knobs
        if knobs.kv_events_drop:
            knobs.kv_events_drop -= 1
            return
        if knobs.kv_events_corrupt:
            knobs.kv_events_corrupt -= 1
            payload = b"\xc1not msgpack"
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.published += 1

    async def serve_replay(self) -> None:
        """Answer replay requests until cancelled."""
        if self._replay is None:
            return
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("kv events: bad replay request frames=%d", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            # vLLM 0.32 puts the topic before the seq (the end marker's topic is empty); older vLLM sent none.
            topic = (self._topic,) if self._knobs.kv_replay_frames == 4 else ()
            end = (b"",) if topic else ()
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", *topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", *end, END_SEQ, b""))

    def close(self) -> None:
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._context.term()
        self._async.term()
