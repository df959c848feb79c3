"""Routing by the nodes' KV-cache events, on real processes: etcd, three simulated nodes publishing their events
(block size 4), and proxy replicas that learn the nodes and their publishers from etcd."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.etcd_server import EtcdServer
from tests.support.procs import HOST, free_port, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import DEV_MODE, SimNode

BS = 4
NAMES = ("a", "b", "c")


class Fleet:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.etcd = EtcdServer(root / "etcd-data", root)
        self.nodes: dict[str, SimNode] = {}
        self.endpoints: dict[str, tuple[str, str]] = {}
        self.proxies: list[ProxyProc] = []

    def start(self) -> None:
        self.etcd.start()
        for name in NAMES:
            events, replay = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": events,
                "replay_endpoint": replay,
                "topic": "kv",
            }
            node = SimNode(
                self.root, f"sim-{name}", env=DEV_MODE, block_size=BS, output_len=1, kv_events_config=json.dumps(config)
            )
            self.nodes[name], self.endpoints[name] = node.start(), (events, replay)
            record = {
                "url": node.url,
                "role": "mixed",
                "models": ["sim-model"],
                "kv_events": events,
                "kv_events_replay": replay,
            }
            self.etcd.etcdctl("put", f"/vllm/default/mixed/{node.host_port}", json.dumps(record))
        for _ in range(2):
            self.proxies.append(self.proxy())

    def proxy(self) -> ProxyProc:
        proxy = ProxyProc(
            self.root, "--etcd", self.etcd.endpoint, "--scrape-load", "0", name=f"proxy{len(self.proxies)}"
        )
        wait_until(lambda: all(tracked(proxy, n) for n in self.nodes.values()), 20, "every node tracked")
        return proxy

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for node in self.nodes.values():
            node.stop()
        self.etcd.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    found = Fleet(tmp_path_factory.mktemp("kv-routing"))
    try:
        found.start()
        yield found
    finally:
        found.stop()


def kv_state(proxy: ProxyProc, node: SimNode) -> dict[str, Any]:
    worker = next(w for w in proxy.workers() if w["id"] == node.host_port)
    state: dict[str, Any] = worker["kv_events"]
    return state


def tracked(proxy: ProxyProc, node: SimNode) -> bool:
    return bool(kv_state(proxy, node)["tracked"])


def prefix(seed: int, blocks: int = 3) -> list[int]:
    return [seed * 100 + i for i in range(blocks * BS)]  # within the simulated vocabulary


def send(node: SimNode, ids: list[int], **fields: Any) -> None:
    """A completion sent to the node itself, not through a proxy: its cache stores the prompt's full blocks."""
    body = {"model": "sim-model", "prompt": [*ids, 1], "max_tokens": 1, **fields}
    assert httpx.post(f"{node.url}/v1/completions", json=body, timeout=10).status_code == 200


def announce(fleet: Fleet, name: str, ids: list[int], proxies: list[ProxyProc] | None = None, **fields: Any) -> None:
    """``send``, then wait until every replica took in the node's batch for it."""
    node, proxies = fleet.nodes[name], proxies or fleet.proxies
    before = [kv_state(p, node)["batches"] for p in proxies]
    send(node, ids, **fields)
    for proxy, seen in zip(proxies, before, strict=True):
        wait_until(lambda p=proxy, n=seen: kv_state(p, node)["batches"] > n, 10, f"{name}'s events on {proxy}")


def routed(proxy: ProxyProc, ids: list[int], **fields: Any) -> str:
    """The node a token-id completion went to through ``proxy``."""
    answer = proxy.post("/v1/completions", json={"model": "sim-model", "prompt": ids, "max_tokens": 1, **fields})
    assert answer.status_code == 200, answer.text
    return answer.headers["x-sim-node"]


def routed_and_seen(fleet: Fleet, via: ProxyProc, ids: list[int]) -> str:
    """``routed`` through ``via``, then wait until the other replicas took in the chosen node's events for it (a
    request to them before that would be placed by load as a new prompt, and then be cached there too)."""
    others = [p for p in fleet.proxies if p is not via]
    before = {p: {w["id"]: w["kv_events"]["batches"] for w in p.workers()} for p in others}
    placed = routed(via, ids)
    node = next(n for n in fleet.nodes.values() if n.host_port == placed)
    for proxy in others:
        wait_until(
            lambda p=proxy: kv_state(p, node)["batches"] > before[p][placed], 10, f"{placed}'s events on {proxy}"
        )
    return placed


def decisions(proxy: ProxyProc) -> dict[str, float]:
    found = {}
    for line in proxy.get("/metrics").text.splitlines():
        if line.startswith("vllm_proxy_kv_routing_decisions_total{"):
            found[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return found


def test_a_prefix_a_node_announced_draws_its_requests_through_every_replica(fleet: Fleet) -> None:
    for seed, name in enumerate(NAMES * 2, start=1):  # each node holds two prefixes: no coincidence of hashing
        ids = prefix(seed)
        announce(fleet, name, ids)
        for proxy in fleet.proxies:
            before = decisions(proxy)["cached_prefix"]
            assert [routed(proxy, [*ids, 50 + turn]) for turn in range(3)] == [fleet.nodes[name].host_port] * 3
            assert decisions(proxy)["cached_prefix"] == before + 3
    state = kv_state(fleet.proxies[1], fleet.nodes["b"])
    assert state["connected"] and state["blocks_indexed"] >= 6 and state["block_size"] == BS
    assert state["malformed"] == state["gaps"] == state["restarts"] == 0


def lag_histogram(proxy: ProxyProc) -> dict[str, float]:
    """The publish-to-index lag histogram's samples: bucket bound (and "count", "sum") -> value."""
    found = {}
    for line in proxy.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm_proxy_kv_event_lag_seconds_bucket{"):
            found[name.split('"')[1]] = float(value)
        elif name in ("vllm_proxy_kv_event_lag_seconds_count", "vllm_proxy_kv_event_lag_seconds_sum"):
            found[name.rsplit("_", 1)[1]] = float(value)
    return found


def test_how_far_the_index_lags_behind_the_nodes_is_on_metrics(fleet: Fleet) -> None:
    proxy = fleet.proxies[0]
    before = lag_histogram(proxy)
    announce(fleet, "a", prefix(71), [proxy])
    after = lag_histogram(proxy)
    assert after["count"] > before.get("count", 0) and after["sum"] >= before.get("sum", 0)
    assert after["+Inf"] == after["count"]  # cumulative buckets, as Prometheus reads them
    assert after["10.0"] <= after["+Inf"] and after["0.001"] <= after["0.1"] <= after["10.0"]


def test_a_salted_prompt_is_cached_only_for_its_own_salt(fleet: Fleet) -> None:
    # vLLM mixes cache_salt into the first block's hash: tenants that salt for isolation share no block, so a
    # prompt cached under one salt must not draw another salt's (or an unsalted) request.
    ids = prefix(61)
    announce(fleet, "b", ids, cache_salt="tenant-a")
    proxy = fleet.proxies[0]
    before = decisions(proxy)
    assert routed(proxy, [*ids, 5], cache_salt="tenant-a") == fleet.nodes["b"].host_port
    middle = decisions(proxy)
    assert middle["cached_prefix"] == before["cached_prefix"] + 1
    routed(proxy, [*ids, 6], cache_salt="tenant-b")
    routed(proxy, [*ids, 7])
    assert decisions(proxy)["cached_prefix"] == middle["cached_prefix"]  # both placed as new, by load


def test_after_a_clear_the_prefix_no_longer_draws_requests(fleet: Fleet) -> None:
    ids = prefix(11)
    announce(fleet, "b", ids)
    node = fleet.nodes["b"]
    assert httpx.post(f"{node.url}/reset_prefix_cache", timeout=5).status_code == 200
    for proxy in fleet.proxies:
        wait_until(lambda p=proxy: kv_state(p, node)["blocks_indexed"] == 0, 10, f"b's blocks gone on {proxy}")
    first, second = fleet.proxies
    before = decisions(first)
    placed = routed_and_seen(fleet, first, [*ids, 99])  # no node holds it now: placed by load ...
    after = decisions(first)
    assert (after["load"], after["cached_prefix"]) == (before["load"] + 1, before["cached_prefix"])
    # ... on a node that now holds it, and announces it: the other replica follows.
    assert routed(second, [*ids, 98]) == placed


@pytest.mark.parametrize("frames", [4, 3], ids=["vllm-0.32", "older-vllm"])
def test_a_replica_started_after_the_events_routes_its_first_request_on_them(fleet: Fleet, frames: int) -> None:
    node = fleet.nodes["c"]
    node.configure(kv_replay_frames=frames)  # vLLM 0.32's replay answers, or older vLLM's
    ids = prefix(20 + frames)
    announce(fleet, "c", ids)
    late = ProxyProc(fleet.root, "--etcd", fleet.etcd.endpoint, "--scrape-load", "0", name=f"late{frames}")
    try:
        # Ready (what an L4 balancer's health check asks) only once the nodes' replays are in: its very first
        # request goes by what the nodes held before it started.
        wait_until(lambda: late.get("/ready").status_code == 200, 20, "the late replica ready")
        assert routed(late, [*ids, 7]) == node.host_port
        assert decisions(late).get("cached_prefix") == 1
        state = kv_state(late, node)
        assert state["replays"] >= 1 and state["malformed"] == 0
    finally:
        late.stop()
        node.configure(kv_replay_frames=4)


@pytest.mark.parametrize("frames", [4, 3], ids=["vllm-0.32", "older-vllm"])
def test_a_gap_is_filled_from_the_replay_socket_and_a_malformed_frame_changes_nothing_else(
    fleet: Fleet, frames: int
) -> None:
    node = fleet.nodes["a"]
    proxy = fleet.proxies[0]
    before = kv_state(proxy, node)
    node.configure(kv_events_drop=1)
    node.configure(kv_replay_frames=frames)
    seed = 100 + 10 * frames  # prompts of their own for each form
    dropped = prefix(seed)
    send(node, dropped)
    announce(fleet, "a", prefix(seed + 1), [proxy])  # the next batch shows the gap, the replay brings the dropped one
    assert routed(proxy, [*dropped, 5]) == node.host_port
    node.configure(kv_events_corrupt=1)
    send(node, prefix(seed + 2))
    announce(fleet, "a", prefix(seed + 3), [proxy])
    after = kv_state(proxy, node)
    assert after["gaps"] == before["gaps"] + 1 and after["replays"] >= before["replays"] + 1
    assert after["malformed"] == before["malformed"] + 1 and after["restarts"] == before["restarts"]
    assert routed(proxy, [*prefix(seed + 1), 5]) == node.host_port  # what it held before is still known
    node.configure(kv_replay_frames=4)


def test_token_ids_of_the_generate_route_find_their_cached_prefix_too(fleet: Fleet) -> None:
    ids = prefix(51)
    announce(fleet, "c", ids)
    for proxy in fleet.proxies:
        body = {"model": "sim-model", "token_ids": [*ids, 3], "sampling_params": {"max_tokens": 1}}
        answer = proxy.post("/inference/v1/generate", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sim-node"] == fleet.nodes["c"].host_port


def test_a_node_restart_drops_its_entries(fleet: Fleet) -> None:
    ids = prefix(41)
    announce(fleet, "b", ids)
    node = fleet.nodes["b"]
    node.restart()
    seed = iter(range(42, 100))

    def seen_restarting() -> bool:
        # A SUB socket misses what is sent while it reconnects: a new prompt each time until every replica saw one.
        if all(kv_state(p, node)["restarts"] for p in fleet.proxies):
            return True
        send(node, prefix(next(seed)))
        return False

    wait_until(seen_restarting, 20, "every replica seeing b restart", interval=0.5)
    assert [kv_state(p, node)["restarts"] for p in fleet.proxies] == [1, 1]
    first, second = fleet.proxies
    before = decisions(first)
    placed = routed_and_seen(fleet, first, [*ids, 8])  # what b held before its restart is forgotten: by load
    after = decisions(first)
    assert (after["load"], after["cached_prefix"]) == (before["load"] + 1, before["cached_prefix"])
    assert routed(second, [*ids, 9]) == placed  # the other replica follows the new holder


def test_a_node_serving_only_prompts_it_holds_whole_stays_tracked(fleet: Fleet) -> None:
    """vLLM publishes nothing for a request whose prompt it holds whole and whose answer fills no block, so a node
    serving only such requests is not taken for a lost publisher while its replay socket answers."""
    proxy, node = fleet.proxies[0], fleet.nodes["c"]
    ids = prefix(81)
    announce(fleet, "c", ids, [proxy])
    before = kv_state(proxy, node)
    went: list[str] = []

    def asked_its_replay_socket() -> bool:
        went.append(routed(proxy, [*ids, 1]))  # the same prompt again: nothing new to store, no event
        return bool(kv_state(proxy, node)["replays"] > before["replays"])

    # Two 5-second windows of requests without events make the replica ask; before, it marked the node silent.
    wait_until(asked_its_replay_socket, 30, "the replica asking c's replay socket whether it is alive", interval=0.1)
    went.append(routed(proxy, [*ids, 1]))
    state = kv_state(proxy, node)
    assert state["tracked"] and not state["silent"] and state["batches"] == before["batches"]
    assert set(went) == {node.host_port}  # on its cached prefix all along


def test_a_node_whose_batches_come_only_by_replay_is_silent_until_one_comes_live(fleet: Fleet) -> None:
    proxy, node = fleet.proxies[0], fleet.nodes["c"]
    ids, lost = prefix(83), prefix(84)
    announce(fleet, "c", ids, [proxy])
    before = kv_state(proxy, node)
    node.configure(kv_events_drop=1000)  # batches numbered and kept for replay, never sent
    try:
        send(node, lost)

        def silent() -> bool:
            routed(proxy, [*ids, 1])
            return bool(kv_state(proxy, node)["silent"])

        wait_until(silent, 30, "c marked silent: its batches come only by replay", interval=0.1)
        state = kv_state(proxy, node)
        assert not state["tracked"] and state["batches"] == before["batches"] + 1  # the lost batch, by replay
    finally:
        node.configure(kv_events_drop=0)
    announce(fleet, "c", prefix(85), [proxy])
    wait_until(lambda: tracked(proxy, node), 15, "c tracked again once a batch came live")
    assert routed(proxy, [*lost, 5]) == node.host_port  # what the replay brought is indexed
