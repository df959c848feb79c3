"""The per-model figures of completions are batched on the request path and handed to prometheus_client in bulk:
what a scrape shows must be what observing each value would have shown, and a scrape shows every completion
recorded before it."""

from __future__ import annotations

import random
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.telemetry.metrics import _ITL_BUCKETS, _TTFT_BUCKETS, ProxyMetrics, _Batch


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for s in family.samples
        if not s.name.endswith("_created")
    }


@pytest.mark.parametrize("buckets", [_TTFT_BUCKETS, _ITL_BUCKETS])
def test_a_batch_flushed_in_rounds_shows_what_observing_each_value_shows(buckets: tuple[float, ...]) -> None:
    rng = random.Random(7)
    # Values on every bound, between bounds, beyond the last (+Inf), and zero.
    values = [*buckets, 0.0, buckets[-1] * 3, *(rng.uniform(0, buckets[-1] * 1.2) for _ in range(2000))]
    rng.shuffle(values)
    batched, direct = CollectorRegistry(), CollectorRegistry()
    ours = Histogram("h_seconds", "h", ["model"], buckets=buckets, registry=batched)
    reference = Histogram("h_seconds", "h", ["model"], buckets=buckets, registry=direct)
    batch = _Batch(buckets)
    for start in range(0, len(values), 300):
        for value in values[start : start + 300]:
            batch.add(value)
            reference.labels("m").observe(value)
        batch.flush(ours.labels("m"))
    got, want = _samples(batched, "h_seconds"), _samples(direct, "h_seconds")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_a_scrape_shows_every_completion_recorded_before_it() -> None:
    registry = CollectorRegistry(auto_describe=True)
    metrics = ProxyMetrics(registry)
    started = time.monotonic() - 1.0
    for _ in range(3):
        metrics.generated("m", started, started + 0.5, True, 11, 7, 10)
    metrics.generated("other", started, None, False, 1, 3, 5)
    e2e = _samples(registry, "vllm_proxy_e2e_request_latency_seconds")
    assert e2e[("vllm_proxy_e2e_request_latency_seconds_count", (("model", "m"),))] == 3
    assert e2e[("vllm_proxy_e2e_request_latency_seconds_count", (("model", "other"),))] == 1
    ttft = _samples(registry, "vllm_proxy_time_to_first_token_seconds")
    assert ttft[("vllm_proxy_time_to_first_token_seconds_count", (("model", "m"),))] == 3
    assert ttft[("vllm_proxy_time_to_first_token_seconds_sum", (("model", "m"),))] == pytest.approx(1.5)
    itl = _samples(registry, "vllm_proxy_inter_token_latency_seconds")
    assert ("vllm_proxy_inter_token_latency_seconds_count", (("model", "other"),)) not in itl  # not streamed
    assert (
        _samples(registry, "vllm_proxy_generation_tokens")[("vllm_proxy_generation_tokens_total", (("model", "m"),))]
        == 30
    )
    # The next scrape adds only what came since.
    metrics.generated("m", started, started + 0.5, True, 11, 7, 10)
    assert _samples(registry, "vllm_proxy_prompt_tokens")[("vllm_proxy_prompt_tokens_total", (("model", "m"),))] == 28


def test_a_scrape_shows_every_request_leg_and_chunk_counted_before_it() -> None:
    registry = CollectorRegistry(auto_describe=True)
    metrics = ProxyMetrics(registry)
    started = time.monotonic() - 0.2
    for status in (200, 200, 503):
        metrics.request_done("/v1/completions", "mixed", status, started)
    metrics.first_byte("/v1/completions", "mixed", started)
    metrics.upstream_outcome(Role.MIXED, "n1", "ok")
    metrics.chunks(5)
    metrics.chunks(2)
    requests = _samples(registry, "vllm_proxy_requests")
    labels = (("mode", "mixed"), ("route", "/v1/completions"))
    assert requests[("vllm_proxy_requests_total", (*labels, ("status", "200")))] == 2
    assert requests[("vllm_proxy_requests_total", (*labels, ("status", "503")))] == 1
    durations = _samples(registry, "vllm_proxy_request_duration_seconds")
    assert durations[("vllm_proxy_request_duration_seconds_count", labels)] == 3
    assert durations[("vllm_proxy_request_duration_seconds_sum", labels)] == pytest.approx(0.6, abs=0.1)
    first = _samples(registry, "vllm_proxy_time_to_first_byte_seconds")
    assert first[("vllm_proxy_time_to_first_byte_seconds_count", labels)] == 1
    upstream = _samples(registry, "vllm_proxy_upstream_requests")
    node = (("node", "n1"), ("outcome", "ok"), ("role", "mixed"))
    assert upstream[("vllm_proxy_upstream_requests_total", node)] == 1
    assert _samples(registry, "vllm_proxy_stream_chunks")[("vllm_proxy_stream_chunks_total", ())] == 7
    metrics.chunks(1)  # a second scrape adds only what came since the first
    assert _samples(registry, "vllm_proxy_stream_chunks")[("vllm_proxy_stream_chunks_total", ())] == 8
