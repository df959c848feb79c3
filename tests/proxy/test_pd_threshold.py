"""--pd-min-prompt-tokens: a prompt that is mostly known already (the next turn of a conversation) skips the
prefill leg; a prompt with enough new tokens still gets one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
LONG = " ".join(f"word{i}" for i in range(1500))  # ~10 KB: ~2,500 tokens by the proxy's estimate


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProc, SimNode, SimNode]]:
    logs = tmp_path_factory.mktemp("logs")
    prefill = SimNode(logs, "pd-prefill", role="prefill").start()
    decode = SimNode(logs, "pd-decode", role="decode").start()
    replica = ProxyProc(
        logs, "--prefill", prefill.host_port, "--decode", decode.host_port, "--pd-min-prompt-tokens", "256"
    )
    try:
        replica.wait_routable("prefill", prefill.host_port)
        replica.wait_routable("decode", decode.host_port)
        yield replica, prefill, decode
    finally:
        replica.stop()
        decode.stop()
        prefill.stop()


def ask(replica: ProxyProc, prompt: str, request_id: str) -> None:
    answer = replica.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        headers={"X-Request-Id": request_id},
    )
    assert answer.status_code == 200, answer.text


def seen(node: SimNode, request_id: str) -> bool:
    return any(r["request_id"] == request_id for r in node.requests())


def test_a_new_long_prompt_is_prefilled_and_its_next_turn_goes_straight_to_decode(
    fleet: tuple[ProxyProc, SimNode, SimNode],
) -> None:
    replica, prefill, decode = fleet
    ask(replica, LONG + "\nQ: first question?\nA:", "turn-1")
    assert seen(prefill, "turn-1") and seen(decode, "turn-1")
    ask(replica, LONG + "\nQ: first question?\nA: an answer.\nQ: and the second?\nA:", "turn-2")
    assert not seen(prefill, "turn-2") and seen(decode, "turn-2")
    decoded = next(r for r in decode.requests() if r["request_id"] == "turn-2")
    assert decoded["kv_transfer_params"] is None  # computed on the decode node itself


def test_a_short_prompt_skips_the_prefill_leg(fleet: tuple[ProxyProc, SimNode, SimNode]) -> None:
    replica, prefill, decode = fleet
    ask(replica, "hello there", "short")
    assert not seen(prefill, "short") and seen(decode, "short")
