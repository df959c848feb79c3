"""The two legs' bodies, exactly as SPEC's disaggregated flow describes them."""

from __future__ import annotations

from proxy.disagg import decode_body, prefill_body

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
    body = prefill_body(CLIENT)
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert body["stream"] is False
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in body
    assert body["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    assert body["temperature"] == 0.2 and body["some_vllm_extension"] == {"a": [1, 2]}


def test_prefill_leg_adds_no_max_completion_tokens_when_client_sent_none() -> None:
    assert "max_completion_tokens" not in prefill_body({"model": "m", "prompt": "x"})


def test_client_body_is_not_modified() -> None:
    original = dict(CLIENT)
    prefill_body(CLIENT)
    decode_body(CLIENT, {"x": 1})
    assert CLIENT == original


def test_decode_leg_is_the_client_body_plus_kv_transfer_params_verbatim() -> None:
    kv = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "remote_engine_id": "e", "extra": {"k": None}}
    body = decode_body(CLIENT, kv)
    assert body["kv_transfer_params"] == kv
    assert {k: v for k, v in body.items() if k != "kv_transfer_params"} == CLIENT
