"""GET /metrics: a few of vLLM V1's Prometheus metrics (vllm/v1/metrics/loggers.py), read from the engine.

Same names and labels as vLLM (``model_name`` is the first served name, ``engine`` the engine index "0"), no
``_created`` series (vLLM disables them); counters are named without ``_total``, which prometheus_client appends
(``vllm:prefix_cache_hits_total``). A collector on a per-app registry: nothing global.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.latency import Histogram

LABELS = ["model_name", "engine"]


class EngineCollector(Collector):
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        labels = [engine.settings.served_model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def histogram(name: str, doc: str, value: Histogram) -> HistogramMetricFamily:
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value.buckets(), value.total)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(labels, value)
            return family

        slots = engine.slots
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", engine.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.waiting)
        # With the prefix cache off the node has no block accounting: usage falls back to busy sequence slots.
        usage = engine.cache.usage if engine.cache.enabled else slots.running / slots.limit
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        # As vLLM: one sample per state (sleepmode.py says which are 1 when).
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state", labels=[*LABELS, "sleep_state"])
        for state, value in engine.sleep_mode.gauge().items():
            sleep.add_metric([*labels, state], value)
        yield sleep
        # The simulator's own (vLLM has no such gauge): what the node holds on its simulated GPU (sim/gpu.py).
        yield gauge("vllm_sim:gpu_memory_used_bytes", "GPU memory the node holds.", engine.sleep_mode.memory)
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            engine.cache.queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", engine.cache.hits
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", engine.counters["prompt_tokens"])
        yield counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", engine.counters["generation_tokens"]
        )
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.", labels=[*LABELS, "finished_reason"]
        )
        for reason in ("stop", "length", "abort"):
            success.add_metric([*labels, reason], engine.finished[reason])
        yield success
        latencies = engine.latencies
        yield histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", latencies.ttft
        )
        yield histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", latencies.itl
        )
        yield histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", latencies.e2e
        )
        if engine.settings.enable_lora:
            # vLLM's label order; each label set a series whose value is when it was last current (sim/lora.py).
            info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"],
            )
            for running, waiting, at in engine.adapters.info_series():
                info.add_metric([running, str(engine.adapters.max_loras), waiting], at)
            yield info


def make_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
