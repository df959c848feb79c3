"""Adapter records (protos/adapter_record.proto) and the LoRA gauge of a vLLM /metrics page."""

from __future__ import annotations

import pytest

from vllm_etcd_proxy.fleet.adapters import adapter_key, adapter_value, parse_adapter
from vllm_etcd_proxy.fleet.records import InvalidRecord, KeyLayout
from vllm_etcd_proxy.fleet.vllm import read_lora_info

INVALID = [
    ("sql", b"{", "not JSON"),
    ("sql", b"[1]", "not a JSON object"),
    ("sql", b'{"path": "/a"}', "non-empty path and base"),
    ("sql", b'{"path": 3, "base": "m"}', "not an adapter record"),
    ("sql", b"\xff", "not UTF-8"),
    ("a b", b'{"path": "/a", "base": "m"}', "slash or a space"),
    ("", b'{"path": "/a", "base": "m"}', "empty"),
]
PAGE = b"""# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="chat",waiting_lora_adapters="sql"} 1.700000005e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.6e+09
"""


def test_an_adapter_record_round_trips_and_ignores_unknown_fields() -> None:
    value = adapter_value("/loras/sql", "llama", {"owner": "data"})
    assert parse_adapter("sql", value).path == "/loras/sql"
    adapter = parse_adapter("sql", b'{"path": "hub/sql", "base": "llama", "future": 1}')
    assert (adapter.name, adapter.path, adapter.base) == ("sql", "hub/sql", "llama")
    assert adapter_key(KeyLayout(prefix="/v", cluster="c"), "sql") == "/v/c/adapters/sql"


@pytest.mark.parametrize(("name", "value", "reason"), INVALID)
def test_an_invalid_adapter_record_says_why(name: str, value: bytes, reason: str) -> None:
    with pytest.raises(InvalidRecord, match=reason):
        parse_adapter(name, value)


def test_the_newest_lora_series_wins() -> None:
    assert read_lora_info(PAGE) == (frozenset({"chat"}), frozenset({"sql"}), 4)
    assert read_lora_info(b"vllm:num_requests_running 1\n") is None
