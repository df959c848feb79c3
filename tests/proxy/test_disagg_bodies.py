"""The two legs' bodies, exactly as SPEC's disaggregated flow describes them."""

from __future__ import annotations

import json

import orjson

from vllm_etcd_proxy.proxy.serving.disagg import decode_body, prefill_body

CLIENT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 50,
    "max_completion_tokens": 50,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 3,
    "min_completion_tokens": 3,
    "temperature": 0.2,
    "some_vllm_extension": {"a": [1, 2]},
}


def test_prefill_leg_generates_one_token_without_streaming() -> None:
    body = orjson.loads(prefill_body(CLIENT))
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert body["temperature"] == 0.2 and body["some_vllm_extension"] == {"a": [1, 2]}


def test_prefill_leg_adds_no_max_completion_tokens_when_client_sent_none() -> None:
    assert "max_completion_tokens" not in orjson.loads(prefill_body({"model": "m", "prompt": "x"}))


def test_client_body_is_not_modified() -> None:
    original = dict(CLIENT)
    prefill_body(CLIENT)
    decode_body(orjson.dumps(CLIENT), CLIENT, {"x": 1})
    assert CLIENT == original


def test_decode_leg_is_the_client_body_plus_kv_transfer_params_verbatim() -> None:
    kv = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_engine_id": "e", "extra": {"k": None}}
    body = orjson.loads(decode_body(orjson.dumps(CLIENT), CLIENT, kv))
    assert body["kv_transfer_params"] == kv
    assert {k: v for k, v in body.items() if k != "kv_transfer_params"} == CLIENT


def test_decode_leg_keeps_the_clients_bytes_and_prefill_leg_stays_utf8() -> None:
    # A CJK prompt as the client sent it (indented, non-ASCII as UTF-8): the decode leg is those very bytes plus
    # one field, and no leg grows by escaping (json.dumps' ensure_ascii would turn each character into six bytes).
    client = {"model": "m", "prompt": "你好，世界" * 1000, "max_tokens": 5}
    raw = json.dumps(client, ensure_ascii=False, indent=2).encode() + b"\n"
    decode = decode_body(raw, client, {"remote_block_ids": [7]})
    assert decode.startswith(raw.rstrip()[:-1])
    assert orjson.loads(decode) == {**client, "kv_transfer_params": {"remote_block_ids": [7]}}
    assert len(prefill_body(client)) < len(raw) + 256  # the added kv_transfer_params, nothing more


def test_decode_leg_replaces_a_kv_transfer_params_the_client_sent() -> None:
    client = {"model": "m", "prompt": "x", "kv_transfer_params": {"client": True}}
    body = orjson.loads(decode_body(orjson.dumps(client), client, {"remote_engine_id": "e"}))
    assert body == {"model": "m", "prompt": "x", "kv_transfer_params": {"remote_engine_id": "e"}}
    without = orjson.loads(decode_body(orjson.dumps(client), client, None))
    assert without == {"model": "m", "prompt": "x"}
