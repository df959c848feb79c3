"""A replica following hundreds of publishing nodes at once (simulated publishers in a process of their own,
tests/support/kv_publishers.py): every node is tracked with what it held before the replica started, and every
batch the nodes send afterwards is taken in, none lost, none misread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.kv_publishers import KvPublishers
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc

NODES = 400
"""More than one ZMQ context holds by default (1,023 sockets, three a subscribed node)."""
PROBE_BLOCKS = 4
"""Blocks each simulated node stores before the replica starts (bench/kv_fleet.py)."""


def views(proxy: ProxyProc) -> dict[str, dict[str, Any]]:
    return {w["id"]: w["kv_events"] for w in proxy.workers()}


def test_every_one_of_hundreds_of_nodes_is_followed_and_none_of_their_batches_lost(logs_dir: Path) -> None:
    fleet = KvPublishers(logs_dir, NODES)
    try:
        proxy = ProxyProc(
            logs_dir,
            "--mixed",
            *fleet.addresses,
            "--kv-events",
            *fleet.kv_flags(),
            "--model",
            "sim-model",
            "--scrape-load",
            "0",
        )
        try:

            def all_replayed() -> bool:
                found = views(proxy).values()
                return sum(v["tracked"] and v["blocks_indexed"] == PROBE_BLOCKS for v in found) == NODES

            wait_until(all_replayed, 90, "every node tracked with its blocks from before", interval=0.5)
            fleet.ask({"rate": 5})
            wait_until(lambda: min(p["sent"] for p in fleet.report().values()) >= 5, 30, "5 batches from each")
            fleet.ask({"rate": 0})
            sent = fleet.report()

            def all_in() -> bool:
                return all(v["last_seq"] == sent[node]["batches"] - 1 for node, v in views(proxy).items())

            wait_until(all_in, 60, "every batch taken in", interval=0.5)
            for node, view in views(proxy).items():
                assert view["batches"] == sent[node]["batches"], node  # the probe's by replay, the rest live
                assert view["blocks_indexed"] == sent[node]["held"], node
                assert view["gaps"] == view["malformed"] == view["restarts"] == view["orphan_blocks"] == 0, node
        finally:
            proxy.stop()
    finally:
        fleet.stop()
