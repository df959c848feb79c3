"""What the registrar reads from a vLLM node's /metrics: its load."""

from __future__ import annotations

import pytest

from vllm_etcd_proxy.registrar.errors import ProbeError
from vllm_etcd_proxy.registrar.probe import parse_load

# As vLLM v1 exposes them: one gauge per engine and model, next to metrics the registrar ignores.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
"""


def test_load_is_running_plus_waiting_summed_over_label_sets() -> None:
    assert parse_load(METRICS) == 7


def test_idle_node_has_load_zero() -> None:
    assert parse_load("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n") == 0


@pytest.mark.parametrize("text", ["", "process_cpu_seconds_total 1.0\n", "vllm:num_requests_running{ 1\n"])
def test_metrics_without_the_load_gauges_are_an_error(text: str) -> None:
    with pytest.raises(ProbeError):
        parse_load(text)
