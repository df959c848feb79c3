"""KV events for static nodes (``--kv-events``): the index's exact uncached count for --pd-min-prompt-tokens, and
a publisher that cannot be reached, whose node is then routed by content affinity."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from tests.support.procs import HOST, free_port, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.proxy.kvcache.prompt.prefix_ids import SOFT_CUT
from vllm_etcd_proxy.proxy.kvcache.prompt.tokens import CHECKED_SPLITS
from vllm_etcd_proxy.proxy.routing.kv_aware import HEAD_TOKENS
from vllm_etcd_proxy.sim import vocab

BS = 4


def publishing(logs: Path, name: str, **knobs: object) -> tuple[SimNode, str]:
    events, replay = f"tcp://{HOST}:{free_port()}", f"tcp://{HOST}:{free_port()}"
    config = {"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}
    node = SimNode(logs, name, block_size=BS, kv_events_config=json.dumps(config), **knobs).start()
    return node, f"{node.host_port}={events},{replay}"


def kv_state(proxy: ProxyProc, node: SimNode) -> dict[str, object]:
    state: dict[str, object] = next(w for w in proxy.workers() if w["id"] == node.host_port)["kv_events"]
    return state


def decisions(proxy: ProxyProc) -> dict[str, float]:
    lines = proxy.get("/metrics").text.splitlines()
    return {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("vllm_proxy_kv_routing_decisions_total{")
    }


def test_the_prefill_leg_is_skipped_when_the_decode_node_already_holds_the_prompt(logs_dir: Path) -> None:
    prefill, prefill_flag = publishing(logs_dir, "kv-prefill", role="prefill")
    decode, decode_flag = publishing(logs_dir, "kv-decode", role="decode")
    proxy = ProxyProc(
        logs_dir,
        "--prefill",
        prefill.host_port,
        "--decode",
        decode.host_port,
        "--kv-events",
        prefill_flag,
        "--kv-events",
        decode_flag,
        "--pd-min-prompt-tokens",
        "8",
    )
    try:
        for node in (prefill, decode):
            wait_until(lambda n=node: kv_state(proxy, n)["tracked"], 10, f"{node.name} tracked")
        ids = list(range(500, 540))
        body = {"model": "sim-model", "prompt": ids, "max_tokens": 1}
        assert httpx.post(f"{decode.url}/v1/completions", json=body, timeout=10).status_code == 200
        wait_until(lambda: kv_state(proxy, decode)["blocks_indexed"] == 10, 10, "the decode node's blocks")
        # This replica never saw the prompt (content affinity would call it all new), but the index knows that
        # the decode node lacks only the last 2 of its 42 tokens: fewer than 8, no prefill leg.
        answer = proxy.post(
            "/v1/completions",
            json={"model": "sim-model", "prompt": [*ids, 1, 2], "max_tokens": 1},
            headers={"X-Request-Id": "known"},
        )
        assert answer.status_code == 200
        assert not any(r["request_id"] == "known" for r in prefill.requests())
        fresh = list(range(700, 740))
        answer = proxy.post(
            "/v1/completions",
            json={"model": "sim-model", "prompt": fresh, "max_tokens": 1},
            headers={"X-Request-Id": "fresh"},
        )
        assert answer.status_code == 200
        assert any(r["request_id"] == "fresh" for r in prefill.requests())
    finally:
        proxy.stop()
        prefill.stop()
        decode.stop()


def test_an_unreachable_publisher_leaves_its_node_to_content_affinity(logs_dir: Path) -> None:
    node = SimNode(logs_dir, "kv-none").start()
    nowhere = f"tcp://{HOST}:{free_port()}"
    proxy = ProxyProc(
        logs_dir,
        "--mixed",
        node.host_port,
        node.host_port.replace(HOST, "localhost"),
        "--kv-events",
        f"{node.host_port}={nowhere}",
    )
    try:
        proxy.wait_routable("mixed", node.host_port)
        for i in range(3):
            answer = proxy.post("/v1/completions", json={"model": "sim-model", "prompt": [1, 2, 3, 4, 5, i]})
            assert answer.status_code == 200
        state = kv_state(proxy, node)
        assert (state["connected"], state["tracked"], state["endpoint"]) == (False, False, nowhere)
        assert decisions(proxy)["fallback"] == 3
    finally:
        proxy.stop()
        node.stop()


def test_a_chat_finds_the_blocks_of_its_rendered_prompt(logs_dir: Path, tmp_path: Path) -> None:
    tokenizer = tmp_path / "sim-tokenizer"
    nodes, flags = zip(*(publishing(logs_dir, f"kv-chat-{n}", tokenizer=tokenizer) for n in "ab"), strict=True)
    proxy = ProxyProc(
        logs_dir, "--mixed", *(n.host_port for n in nodes), *(arg for flag in flags for arg in ("--kv-events", flag))
    )
    words = "the proxy routes each request to a node that serves the model and streams tokens back as they come"

    def chat(topic: str, *more: dict[str, str]) -> dict[str, object]:
        messages = [{"role": "system", "content": f"{topic} {words}"}, {"role": "user", "content": words}, *more]
        return {"model": "sim-model", "messages": messages, "max_tokens": 1}

    try:
        for node in nodes:
            wait_until(lambda n=node: kv_state(proxy, n)["tracked"], 10, f"{node.name} tracked")

        def tokenizing() -> bool:  # the tokenizer loads in a thread: until then chats are routed by content
            before = decisions(proxy)["fallback"]
            assert proxy.post("/v1/chat/completions", json=chat("probe")).status_code == 200
            return decisions(proxy)["fallback"] == before

        wait_until(tokenizing, 20, "the proxy tokenizing chats", interval=0.2)
        holder = nodes[1]
        seen = kv_state(proxy, holder)["batches"]
        assert httpx.post(f"{holder.url}/v1/chat/completions", json=chat("first"), timeout=10).status_code == 200
        wait_until(lambda: kv_state(proxy, holder)["batches"] > seen, 10, "the holder's events")  # type: ignore[operator]
        before = decisions(proxy)["cached_prefix"]
        answer = proxy.post(
            "/v1/chat/completions",
            json=chat("first", {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and then"}),
        )
        assert answer.status_code == 200 and answer.headers["x-sim-node"] == holder.host_port
        assert decisions(proxy)["cached_prefix"] == before + 1
    finally:
        proxy.stop()
        for node in nodes:
            node.stop()


def ids_tokenized(proxy: ProxyProc) -> float:
    for line in proxy.get("/metrics").text.splitlines():
        if line.startswith('vllm_proxy_prompt_ids_total{source="tokenized"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_long_new_conversation_is_tokenized_only_as_far_as_routing_needs(logs_dir: Path, tmp_path: Path) -> None:
    tokenizer = tmp_path / "sim-tokenizer"
    knobs = {"tokenizer": tokenizer, "max_model_len": 32768}
    nodes, flags = zip(*(publishing(logs_dir, f"kv-long-{n}", **knobs) for n in "ab"), strict=True)
    proxy = ProxyProc(
        logs_dir, "--mixed", *(n.host_port for n in nodes), *(arg for flag in flags for arg in ("--kv-events", flag))
    )
    document = " ".join(vocab.WORDS[i % len(vocab.WORDS)] for i in range(10_000))  # a token per word

    def chat(*more: dict[str, str]) -> dict[str, object]:
        return {"model": "sim-model", "messages": [{"role": "user", "content": document}, *more], "max_tokens": 1}

    try:
        for node in nodes:
            wait_until(lambda n=node: kv_state(proxy, n)["tracked"], 10, f"{node.name} tracked")

        def tokenizing() -> bool:
            before = decisions(proxy).get("fallback", 0)
            probe = {"model": "sim-model", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1}
            assert proxy.post("/v1/chat/completions", json=probe).status_code == 200
            return decisions(proxy).get("fallback", 0) == before

        wait_until(tokenizing, 20, "the proxy tokenizing chats", interval=0.2)
        for i in range(CHECKED_SPLITS):  # a model's first chats are also tokenized whole, as a check
            short = {"model": "sim-model", "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 1}
            assert proxy.post("/v1/chat/completions", json=short).status_code == 200
        before, placed = ids_tokenized(proxy), decisions(proxy)
        first = proxy.post("/v1/chat/completions", json=chat())
        assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] > 10_000
        # No node holds any of it: routed by load, on the ids of its first blocks alone.
        assert ids_tokenized(proxy) - before < HEAD_TOKENS + SOFT_CUT
        assert decisions(proxy)["load"] == placed["load"] + 1
        holder = next(n for n in nodes if n.host_port == first.headers["x-sim-node"])
        wait_until(lambda: kv_state(proxy, holder)["blocks_indexed"] >= 2500, 10, "the holder's blocks")  # type: ignore[operator]
        answer = first.json()["choices"][0]["message"]["content"]
        second = proxy.post(
            "/v1/chat/completions",
            json=chat({"role": "assistant", "content": answer}, {"role": "user", "content": "and then"}),
        )
        # Its start is cached on the holder now: the next turn is read whole (the rest of the first turn too,
        # this once) and stays where its cache is.
        assert second.status_code == 200 and second.headers["x-sim-node"] == holder.host_port
        assert decisions(proxy)["cached_prefix"] == placed.get("cached_prefix", 0) + 1
        assert ids_tokenized(proxy) - before > 10_000
    finally:
        proxy.stop()
        for node in nodes:
            node.stop()


def test_a_publishing_nodes_tokenizer_loads_before_the_first_request(logs_dir: Path, tmp_path: Path) -> None:
    # The card's root names the simulator's tokenizer directory: the replica loads it as soon as it learns the
    # node's models, so a conversation's first turn is read as token ids (not routed by content while it loads).
    node, flag = publishing(logs_dir, "tok", tokenizer=tmp_path / "tokenizer")
    proxy = ProxyProc(logs_dir, "--mixed", node.host_port, "--kv-events", flag)
    try:

        def loaded() -> bool:
            lines = proxy.get("/metrics").text.splitlines()
            return "vllm_proxy_tokenizers_loaded 1.0" in lines

        wait_until(loaded, 15, "the tokenizer loaded with no request sent")
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}
        assert proxy.post("/v1/chat/completions", json=body).status_code == 200
        outcomes = [
            line
            for line in proxy.get("/metrics").text.splitlines()
            if line.startswith("vllm_proxy_prompt_tokenize_total{")
        ]
        assert 'vllm_proxy_prompt_tokenize_total{outcome="whole"} 1.0' in outcomes, outcomes
    finally:
        proxy.stop()
        node.stop()
