"""What a replica reads from a vLLM node's /metrics page: load, and how fast the node produces tokens lately."""

from __future__ import annotations

import pytest

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
