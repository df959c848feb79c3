"""vllm-sim publishes vLLM's KV-cache events: a real process, read by a plain ZMQ subscriber in the test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from tests.support.procs import HOST, free_port
from tests.support.sim_node import DEV_MODE, SimNode

BS = 4
PROMPT = list(range(100, 110))  # two full blocks and a partial one


@pytest.fixture
def node(logs_dir: Path) -> Iterator[tuple[SimNode, str, str]]:
    pub, replay = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub,
        "replay_endpoint": replay,
        "topic": "kv",
    }
    sim = SimNode(
        logs_dir,
        "kv-sim",
        env=DEV_MODE,
        block_size=BS,
        cache_blocks=6,
        output_len=1,
        kv_events_config=json.dumps(config),
    )
    with sim:
        yield sim, pub, replay


@pytest.fixture
def sub(node: tuple[SimNode, str, str]) -> Iterator[zmq.Socket[bytes]]:
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVTIMEO, 5000)
    socket.connect(node[1])
    yield socket
    socket.close(0)
    context.term()


def complete(sim: SimNode, prompt: list[int], **fields: Any) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 1, **fields}
    assert httpx.post(f"{sim.url}/v1/completions", json=body, timeout=10).status_code == 200


def subscribed(sim: SimNode, sub: zmq.Socket[bytes]) -> list[bytes]:
    """Send requests until the subscription is live (a SUB socket misses what was sent before it joined)."""
    for i in range(50):
        complete(sim, [1000 + i] * (BS + 1))  # a new block each time
        try:
            return sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            if sub.poll(100):
                return sub.recv_multipart()
    raise AssertionError("no event arrived")


def batch(frames: list[bytes]) -> tuple[int, list[Any]]:
    topic, seq, payload = frames
    assert topic == b"kv"
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    return int.from_bytes(seq, "big"), events


def test_stores_evictions_and_clears_follow_the_cache(node: tuple[SimNode, str, str], sub: zmq.Socket[bytes]) -> None:
    sim, _, _ = node
    first, _ = batch(subscribed(sim, sub))
    complete(sim, PROMPT)
    seq, events = batch(sub.recv_multipart())
    assert seq == first + 1
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert len(stored) == 1 and stored[0]["token_ids"] == PROMPT[:8] and stored[0]["block_size"] == BS
    assert stored[0]["parent_block_hash"] is None and len(stored[0]["block_hashes"]) == 2
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored[0]["block_hashes"])
    assert stored[0]["extra_keys"] == [None, None] and stored[0]["lora_name"] is None
    # Six blocks of capacity: two more prompts of two blocks each evict the oldest free ones.
    complete(sim, list(range(200, 210)))
    complete(sim, list(range(300, 310)))
    seen = [e for _ in range(2) for e in batch(sub.recv_multipart())[1]]
    assert any(e["type"] == "BlockRemoved" for e in seen)
    assert httpx.post(f"{sim.url}/reset_prefix_cache", timeout=5).status_code == 200
    assert [e["type"] for e in batch(sub.recv_multipart())[1]] == ["AllBlocksCleared"]


def test_a_salted_request_stores_blocks_of_its_own_with_the_salt_in_its_first_blocks_extra_keys(
    node: tuple[SimNode, str, str], sub: zmq.Socket[bytes]
) -> None:
    sim, _, _ = node
    batch(subscribed(sim, sub))
    complete(sim, PROMPT, cache_salt="tenant-a")
    (plain,) = batch(sub.recv_multipart())[1]
    complete(sim, PROMPT, cache_salt="tenant-b")  # the same tokens, another salt: new blocks, new hashes
    (other,) = [e for e in batch(sub.recv_multipart())[1] if e["type"] == "BlockStored"]
    # vLLM 0.32's to_event_extra_keys: one entry per block, the salt (untagged) on the request's first only.
    assert plain["extra_keys"] == [["tenant-a"], None] and other["extra_keys"] == [["tenant-b"], None]
    assert plain["token_ids"] == other["token_ids"] == PROMPT[:8]
    assert set(plain["block_hashes"]).isdisjoint(other["block_hashes"])


@pytest.mark.parametrize("frames", [4, 3], ids=["vllm-0.32", "older-vllm"])
def test_replay_answers_buffered_batches_then_minus_one(
    node: tuple[SimNode, str, str], sub: zmq.Socket[bytes], frames: int
) -> None:
    sim, _, replay = node
    sim.configure(kv_replay_frames=frames)
    first, _ = batch(subscribed(sim, sub))
    sim.configure(kv_events_drop=1)
    complete(sim, PROMPT)  # numbered and kept, not sent
    complete(sim, list(range(200, 210)))
    assert batch(sub.recv_multipart())[0] == first + 2
    dealer = sub.context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(replay)
    dealer.send_multipart([b"", (first + 1).to_bytes(8, "big")])
    answers = []
    while True:
        answer = dealer.recv_multipart()
        assert len(answer) == frames and answer[0] == b""
        # vLLM 0.32: [b"", topic, seq, payload], the end [b"", b"", -1, b""]; older: [b"", seq, payload]
        topic, seq, payload = answer[1:] if frames == 4 else (None, *answer[1:])
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b"" and topic in (None, b"")
            break
        assert topic in (None, b"kv")
        answers.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)[1]))
    dealer.close(0)
    assert [s for s, _ in answers] == [first + 1, first + 2]
    assert answers[0][1][0]["token_ids"] == PROMPT[:8]


def test_knobs_send_older_array_events_bytes_hashes_and_corrupt_frames(
    node: tuple[SimNode, str, str], sub: zmq.Socket[bytes]
) -> None:
    sim, _, _ = node
    batch(subscribed(sim, sub))
    sim.configure(kv_events_encoding="array", kv_events_hash="bytes", kv_events_corrupt=1)
    complete(sim, PROMPT)
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.decode(sub.recv_multipart()[2])
    complete(sim, list(range(200, 210)))
    _, events = batch(sub.recv_multipart())
    tag, hashes, parent, token_ids, block_size, *_ = events[0]
    assert (tag, parent, token_ids, block_size) == ("BlockStored", None, list(range(200, 208)), BS)
    assert all(isinstance(h, bytes) for h in hashes)
