"""What the KV-event index costs a replica: memory per million blocks indexed, and CPU per 1,000 events taken in.

    python -m bench.kv_index [--nodes 100] [--blocks 50000] [--block-size 16] [--events 20000]

Memory: ``--nodes`` nodes each announce ``--blocks`` blocks of distinct token ids (the worst case: no prefix
shared between nodes, so every block is a key of its own), in batches of 8-block ``BlockStored`` events as vLLM
sends them; the figure is the growth of the process's resident memory, per million blocks.
CPU: ``--events`` events in msgpack batches as vLLM 0.32 encodes them (stores of 1-8 blocks, one removal in
four), decoded (kvcache/wire.py) and applied (kvcache/index.py) as a subscription does, timed with the process's
CPU clock; the sockets' own cost (ZMQ, in C) is not in it.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from vllm_etcd_proxy.proxy.kvcache.index import KvIndex
from vllm_etcd_proxy.proxy.kvcache.prompt.ids import KvPrompt
from vllm_etcd_proxy.proxy.kvcache.wire import Stored, read_batch


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_index", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--blocks", type=int, default=50_000, help="blocks per node (50000)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--events", type=int, default=20_000, help="events for the CPU figure (20000)")
    return p.parse_args(argv)


def fill(index: KvIndex, nodes: int, blocks: int, size: int) -> None:
    ids = 0
    for n in range(nodes):
        name = f"node-{n}"
        parent: int | None = None
        for first in range(0, blocks, 8):
            count = min(8, blocks - first)
            hashes = [random.getrandbits(60) for _ in range(count)]  # as kvcache/wire.py folds them
            tokens = list(range(ids, ids + count * size))
            ids += count * size
            index.apply(name, [Stored(hashes, parent, tokens, size, "")])
            parent = hashes[-1]


def resident() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(args: argparse.Namespace) -> tuple[float, int, float]:
    gc.collect()
    before = resident()
    index = KvIndex()
    started = time.process_time()
    fill(index, args.nodes, args.blocks, args.block_size)
    seconds = time.process_time() - started
    gc.collect()
    used = resident() - before
    total = args.nodes * args.blocks
    assert len(index) == total
    return used / total * 1e6, used, seconds


def batches(count: int, size: int) -> list[bytes]:
    rng = random.Random(1)
    payloads: list[bytes] = []
    events: list[dict[str, Any]] = []
    held: list[int] = []
    ids = 0
    for _ in range(count):
        if held and rng.random() < 0.25:
            events.append(
                {"type": "BlockRemoved", "block_hashes": [held.pop(rng.randrange(len(held)))], "medium": "GPU"}
            )
        else:
            n = rng.randint(1, 8)
            hashes = [rng.getrandbits(64) for _ in range(n)]
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": None,
                    "token_ids": list(range(ids, ids + n * size)),
                    "block_size": size,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
            held += hashes
            ids += n * size
        if len(events) == 4:  # a few events per engine step
            payloads.append(msgspec.msgpack.encode([time.time(), events, 0]))
            events = []
    return payloads


def cpu(args: argparse.Namespace) -> float:
    payloads = batches(args.events, args.block_size)
    index = KvIndex()
    started = time.process_time()
    for seq, payload in enumerate(payloads):
        index.apply("node", read_batch(seq, payload).events)
    return (time.process_time() - started) / (len(payloads) * 4) * 1000 * 1000  # ms per 1,000 events


def lookup(size: int) -> float:
    """CPU of one routing lookup: a 2,000-token prompt against 100 nodes, one of which holds all of it."""
    index = KvIndex()
    ids = list(range(2000))
    fill(index, 99, 2000, size)
    index.apply(
        "holder",
        [
            Stored(
                [random.getrandbits(64) for _ in range(len(ids) // size)],
                None,
                ids[: len(ids) // size * size],
                size,
                "",
            )
        ],
    )
    slots = (1 << 100) - 1
    started, rounds = time.process_time(), 200
    for i in range(rounds):
        index.depths(KvPrompt([*ids, i], "m").keys(size), slots)
    return (time.process_time() - started) / rounds * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    random.seed(0)
    per_million, used, seconds = memory(args)
    print(
        f"memory: {args.nodes} nodes x {args.blocks} blocks = {args.nodes * args.blocks:,} blocks: "
        f"{used / 2**20:,.0f} MiB, {per_million / 2**20:,.1f} MiB per million blocks "
        f"({per_million / 1e6:.0f} bytes a block); filled in {seconds:.1f} s CPU"
    )
    print(f"cpu: {cpu(args):.2f} ms per 1,000 events decoded and applied (block size {args.block_size})")
    print(f"lookup: {lookup(args.block_size):.0f} us per 2,000-token prompt against 100 nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
