"""The index's share of ingest, alone: bench.kv_fleet's batches decoded and applied in one thread, no sockets.

    python -m bench.kv_apply [--nodes 200] [--batches 400] [--warm 250] [--repeat 3] [--json]
    PYTHONSAFEPATH=1 PYTHONPATH=DIR python -m bench.kv_apply    # the same with the code of checkout DIR

Each of ``--nodes`` publishers (bench/kv_fleet.py's, unbound: their frames are only collected) makes ``--batches``
batches of 1-8 fresh blocks, and once it holds 1,000 blocks a removal of as many in the same batch. The first
``--warm`` batches of every node fill the index untimed (the nodes are full by then: a steady state of one store
and one removal per batch); the rest are timed, decoding (wire.py ``read_batch``) and applying (index.py) apart.
Best of ``--repeat`` runs, in us per batch. bench.kv_ingest measures the whole of ingest on real sockets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench.kv_fleet import Publisher
from vllm_etcd_proxy.proxy.kvcache.index import KvIndex
from vllm_etcd_proxy.proxy.kvcache.wire import read_batch

Frame = tuple[str, int, bytes]


class _Unbound:
    """A ZMQ context whose sockets only take options: the publishers' frames stay in their replay buffers."""

    class _Socket:
        def setsockopt(self, *args: object) -> None: ...

        def bind(self, *args: object) -> None: ...

        def send_multipart(self, *args: object, **kwargs: object) -> None: ...

    def socket(self, kind: int) -> _Socket:
        return self._Socket()


def frames(nodes: int, batches: int) -> list[Frame]:
    config = {"block_size": 16, "capacity": 1000, "buffer": batches + 1}
    unbound: Any = _Unbound()  # stands in for a zmq.Context: Publisher only makes sockets of it
    publishers = [Publisher(unbound, {"index": i, "events": 0, "replay": 0}, config) for i in range(nodes)]
    for _ in range(batches):
        for publisher in publishers:
            publisher.publish()
    return [
        (f"node-{i}", *publisher.buffer[turn]) for turn in range(batches + 1) for i, publisher in enumerate(publishers)
    ]


def once(warm: list[Frame], timed: list[Frame]) -> tuple[float, float]:
    """Seconds decoding, and decoding and applying, the timed frames."""
    index = KvIndex()
    for name, seq, payload in warm:
        index.apply(name, read_batch(seq, payload).events, 0.0)
    started = time.perf_counter()
    decoded = [(name, read_batch(seq, payload).events) for name, seq, payload in timed]
    between = time.perf_counter()
    for name, events in decoded:
        index.apply(name, events, 0.0)
    return between - started, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_apply", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--batches", type=int, default=400, help="batches per node (400)")
    p.add_argument("--warm", type=int, default=250, help="batches per node applied before timing (250)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if not 0 < args.warm < args.batches:
        p.error("--warm must be between 0 and --batches")
    made = frames(args.nodes, args.batches)
    cut = (args.warm + 1) * args.nodes  # the first batch of each is its probe prefix
    warm, timed = made[:cut], made[cut:]
    runs = [once(warm, timed) for _ in range(args.repeat)]
    decode, total = min(r[0] for r in runs), min(r[1] for r in runs)
    report: dict[str, Any] = {
        "batches_timed": len(timed),
        "decode_us": round(decode / len(timed) * 1e6, 1),
        "apply_us": round((total - decode) / len(timed) * 1e6, 1),
        "total_us": round(total / len(timed) * 1e6, 1),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['batches_timed']} batches (steady state, {args.nodes} nodes): per batch "
            f"decode {report['decode_us']} us, apply {report['apply_us']} us, both {report['total_us']} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
