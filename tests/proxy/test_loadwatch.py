"""What a replica reads from a vLLM node's /metrics page: load, and how fast the node produces tokens lately."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.procs import free_port, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.fleet.vllm import read_node_load, read_token_latency
from vllm_etcd_proxy.proxy.discovery.loadwatch import ITL_WINDOW, MIN_TOKENS, TokenLatency

PAGE = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:time_per_output_token_seconds_sum{engine="0",model_name="m"} 99.0
vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 9.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 100.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 100.0
"""


def test_the_inter_token_latency_histogram_is_summed_over_engines() -> None:
    assert read_node_load(PAGE) == (3, 1, 0.25)
    assert read_token_latency(PAGE) == (2.0, 200.0)


def test_the_older_time_per_output_token_name_is_read_when_the_newer_is_missing() -> None:
    older = b"\n".join(line for line in PAGE.split(b"\n") if b"inter_token" not in line)
    assert read_token_latency(older) == (99.0, 9.0)
    assert read_token_latency(b"vllm:num_requests_running 1\n") is None


def test_token_latency_is_the_mean_over_the_recent_window_only() -> None:
    latency = TokenLatency()
    assert latency.add(0.0, 0.0, 0.0) is None  # no tokens yet: unknown
    assert latency.add(1.0, 0.5, 100.0) == pytest.approx(0.005)
    # The node slows to 15 ms per token; once the window has moved past the fast part, only that counts.
    now, total, count = 1.0, 0.5, 100.0
    while now < 1.0 + 2 * ITL_WINDOW:
        now, total, count = now + 0.25, total + 0.015 * 100, count + 100
        latency.add(now, total, count)
    assert latency.value == pytest.approx(0.015)


def test_too_few_tokens_keep_the_last_figure_and_a_restart_starts_over() -> None:
    latency = TokenLatency()
    latency.add(0.0, 0.0, 0.0)
    latency.add(1.0, 1.0, 100.0)
    later = 2.0 + ITL_WINDOW  # the window now starts at the second scrape
    assert latency.add(later, 1.0 + 0.1 * (MIN_TOKENS - 1), 100.0 + MIN_TOKENS - 1) == pytest.approx(0.01)
    latency.add(later + 1, 0.02, 1.0)  # counters went back: the node restarted
    assert latency.add(later + 2, 0.02 + 0.002 * MIN_TOKENS, 1.0 + MIN_TOKENS) == pytest.approx(0.002)


def test_a_replica_scrapes_each_nodes_load_and_speed_and_lists_them(tmp_path: Path) -> None:
    with SimNode(tmp_path, "scraped", itl=0.004, output_len=4 * MIN_TOKENS) as node:
        replica = ProxyProc(tmp_path, "--mixed", node.host_port, "--scrape-load", "0.1")
        try:
            replica.wait_routable("mixed", node.host_port)

            def load() -> dict[str, Any] | None:
                view: dict[str, Any] | None = replica.workers()[0]["node_load"]
                return view

            wait_until(lambda: load() is not None, 10, "a first scrape")
            first = load()
            assert first is not None and first["running"] == 0 and first["inter_token_latency_seconds"] is None
            # Enough tokens for a speed figure, then one request held on the node: the replica sees it running.
            body = {"model": "sim-model", "prompt": "x", "max_tokens": 2 * MIN_TOKENS}
            assert replica.post("/v1/completions", json=body).status_code == 200
            node.configure(hang=True)
            held = threading.Thread(target=_send_and_give_up, args=(replica.url, body), daemon=True)
            held.start()

            def running_and_speed_known() -> bool:
                view = load()
                return view is not None and view["running"] == 1 and view["inter_token_latency_seconds"] is not None

            wait_until(running_and_speed_known, 10, "the held request and the node's speed in /list_workers")
            view = load()
            assert view is not None and view["inter_token_latency_seconds"] == pytest.approx(0.004, rel=0.5)
            assert view["age_seconds"] < 5
            held.join(timeout=10)
        finally:
            replica.stop()


def _send_and_give_up(url: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(f"{url}/v1/completions", json=body, timeout=3)


def test_a_node_that_answers_stays_fresh_among_hundreds_that_refuse(tmp_path: Path) -> None:
    """300 static nodes on ports where nothing listens, one live node: every scrape of a dead node is refused
    and backs off, within the routine ceiling, so the live node is still scraped every interval."""
    dead = [f"127.0.0.1:{free_port()}" for _ in range(300)]
    with SimNode(tmp_path, "alive") as node:
        replica = ProxyProc(
            tmp_path,
            "--mixed",
            node.host_port,
            *dead,
            "--model",
            "sim-model",
            "--scrape-load",
            "0.1",
            "--log-level",
            "warning",
        )
        try:

            def age() -> float | None:
                view = next(w for w in replica.workers() if w["id"] == node.host_port)["node_load"]
                return None if view is None else float(view["age_seconds"])

            wait_until(lambda: age() is not None, 10, "a first scrape of the live node")
            ages = []
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # observing over a span, not waiting for an event
                ages.append(age())
            assert max(a for a in ages if a is not None) < 1.0, ages
        finally:
            replica.stop()
