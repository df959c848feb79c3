"""What a vLLM node says about itself, as both programs read it: model ids from /v1/models, load from /metrics."""

from __future__ import annotations

import pytest

from vllm_etcd_proxy.fleet.vllm import parse_models, read_asleep, read_finished, read_node_load


def test_models_are_the_ids_of_the_openai_list_in_order() -> None:
    body = {"object": "list", "data": [{"id": "base"}, {"id": "lora-1"}, {"id": "base"}]}
    assert parse_models(body) == ("base", "lora-1")


@pytest.mark.parametrize("body", [[], {"data": "x"}, {"data": [{"object": "model"}]}, {"data": [{"id": ""}]}])
def test_a_body_that_is_not_a_model_list_is_an_error(body: object) -> None:
    with pytest.raises(ValueError):
        parse_models(body)


def test_load_gauges_are_summed_over_engines_and_kv_usage_is_the_highest() -> None:
    page = b"""\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_running_total 99
"""
    assert read_node_load(page) == (3, 4, 0.5)
    assert read_node_load(b"process_cpu_seconds_total 1.0\n") is None


def test_finished_requests_are_summed_over_engines_and_reasons_and_unknown_without_the_counter() -> None:
    page = (
        b'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 5.0\n'
        b'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0\n'
        b'vllm:request_success_total{engine="1",finished_reason="abort",model_name="m"} 1.0\n'
    )
    assert read_finished(page) == 8.0
    assert read_finished(b"vllm:num_requests_running 0\n") is None


def test_a_level_0_sleep_reads_as_asleep_as_vllm_sets_only_awake_to_0() -> None:
    page = (
        b'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 0.0\n'
        b'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="weights_offloaded"} 0.0\n'
        b'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="discard_all"} 0.0\n'
    )
    assert read_asleep(page) is True
