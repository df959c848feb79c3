"""The checks of ``bench.real_vllm``: each returns (passed, evidence) and raises for what it could not do.

Each compares what a real vLLM 0.32 does with what our simulator (sim/) and proxy assume, directly on the node
(wire formats) or through the proxy replicas (what a client sees). Where the simulator is asked the same, its
answer is printed beside the real one.
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq

from bench import real_vllm_wire as wire
from bench.procs import Server
from bench.real_vllm_stack import LORA, MODEL, Node, metric, workers
from vllm_etcd_proxy.proxy.kvcache.wire import Malformed, Stored, read_batch
from vllm_etcd_proxy.sim.vocab import WORDS, HfVocab

BLOCK_TOKENS = 300
"""Prompt length (one token a word) of the KV-event checks: two full blocks of the CPU build's 128 tokens."""
EVENT_TIMEOUT = 120.0
REQUEST_TIMEOUT = 300.0
SIM_FIELDS = ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
"""The BlockStored fields the simulator sends (sim/kvevents.py)."""

Result = tuple[bool, str]


def words(count: int, seed: str) -> str:
    """``count`` words of the simulator's vocabulary (one token each), the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(url + path, json=body, timeout=REQUEST_TIMEOUT)
    if response.status_code != 200:
        raise RuntimeError(f"POST {path} -> {response.status_code}: {response.text[:300]}")
    answer: dict[str, Any] = response.json()
    return answer


def stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed answer (up to ``data: [DONE]``)."""
    chunks = []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=REQUEST_TIMEOUT) as response:
        if response.status_code != 200:
            raise RuntimeError(f"POST {path} (stream) -> {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def complete(url: str, prompt: str | list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return post(url, "/v1/completions", body)


def short(value: Any, limit: int = 6) -> str:
    """A list shown by its first items and its length."""
    if isinstance(value, list) and len(value) > limit:
        return "[" + ", ".join(repr(v) for v in value[:limit]) + f", ... ({len(value)} items)]"
    return repr(value)


@dataclass(kw_only=True)
class Mixed:
    """The mixed phase: node ``a`` (with the LoRA adapter) and ``b``, both publishing KV events; replica ``r1``
    started before them, ``r2`` once they hold blocks; a simulator node publishing too, asked alike."""

    a: Node
    b: Node
    r1: Server
    sim: Server
    sim_events: str
    sim_replay: str
    vocab: HfVocab
    context: zmq.Context[zmq.Socket[bytes]]
    r2: Server | None = None
    streams: dict[str, wire.EventStream] = field(default_factory=dict)

    def events(self, endpoint: str) -> wire.EventStream:
        if endpoint not in self.streams:
            self.streams[endpoint] = wire.EventStream(self.context, endpoint)
        return self.streams[endpoint]

    def close(self) -> None:
        for sub in self.streams.values():
            sub.close()


def _stored_after(m: Mixed, url: str, endpoint: str, body: dict[str, Any], blocks: int) -> list[wire.Frame]:
    """Send ``body`` to /v1/completions at ``url`` and read the PUB frames until ``blocks`` blocks were stored
    (the subscription is live: see real_vllm's warm-up). Frames still queued from before are dropped first."""
    sub = m.events(endpoint)
    while sub.read(0) is not None:
        pass
    post(url, "/v1/completions", body)
    frames = sub.until(lambda got: wire.stored_blocks(got) >= blocks, EVENT_TIMEOUT)
    if wire.stored_blocks(frames) < blocks:
        raise TimeoutError(f"no BlockStored for {blocks} blocks from {endpoint} in {EVENT_TIMEOUT:g} s")
    return frames


def _first_stored(frames: list[wire.Frame]) -> dict[str, Any]:
    return next(e for f in frames for e in f.stored())


def _frame_problems(frames: list[wire.Frame]) -> list[str]:
    problems = []
    for f in frames:
        if len(f.frames) != 3 or f.frames[0] != b"kv" or len(f.frames[1]) != 8:
            problems.append(f"frame {wire.shape(f.frames)} is not [b'kv', 8-byte seq, payload]")
        if not (isinstance(f.payload, list) and len(f.payload) == 3 and isinstance(f.payload[0], float)):
            problems.append(f"payload is not [ts, events, dp_rank]: {short(f.payload)}")
    seqs = [f.seq for f in frames]
    if seqs != sorted(seqs) or len(set(seqs)) != len(seqs):
        problems.append(f"seqs not increasing: {seqs}")
    return problems


def _stored_problems(event: dict[str, Any], prompt_ids: list[int]) -> list[str]:
    problems = [f"no {k}" for k in SIM_FIELDS if k not in event]
    size, hashes, ids = event.get("block_size"), event.get("block_hashes") or [], event.get("token_ids") or []
    if not isinstance(size, int) or len(ids) != len(hashes) * size:
        problems.append(f"token_ids ({len(ids)}) do not fill {len(hashes)} blocks of {size}")
    elif ids != prompt_ids[: len(ids)]:
        problems.append("token_ids are not the prompt's ids")
    if not all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes):
        problems.append(f"hashes are not unsigned 64-bit ints: {short(hashes)}")
    return problems


def _proxy_reads(frames: list[wire.Frame]) -> str:
    """What the proxy's own reader (kvcache/wire.py) makes of the same payloads."""
    stored = bad = 0
    try:
        for f in frames:
            batch = read_batch(f.seq, f.frames[2])
            bad += batch.bad_events
            stored += sum(len(e.hashes) for e in batch.events if isinstance(e, Stored))
    except Malformed as exc:
        return f"the proxy's reader refuses a payload: {exc}"
    return f"the proxy's reader: {stored} stored blocks, {bad} malformed events"


def _sim_stored(m: Mixed, body: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return _first_stored(_stored_after(m, m.sim.url, m.sim_events, body, 1))
    except (TimeoutError, RuntimeError, httpx.HTTPError, StopIteration):
        return None


def check_pub_frames(m: Mixed) -> Result:
    text = words(BLOCK_TOKENS, "pub frames")
    body = {"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0}
    frames = _stored_after(m, m.a.url, m.a.events or "", body, 2)
    event = _first_stored(frames)
    problems = _frame_problems(frames) + _stored_problems(event, m.vocab.encode(text))
    first = frames[0]
    beyond = {k: event[k] for k in event if k not in SIM_FIELDS}
    sim = _sim_stored(m, body)
    sim_says = "no answer" if sim is None else f"fields {sorted(sim)}, missing {sorted(set(event) - set(sim))}"
    evidence = (
        f"{len(frames)} messages, first {wire.shape(first.frames)} seqs {[f.seq for f in frames]}; payload "
        f"[ts={first.payload[0]!r}, {len(first.events())} events, dp_rank={first.payload[2]!r}]; BlockStored "
        f"block_size={event.get('block_size')} hashes={short(event.get('block_hashes'), 2)} "
        f"parent={event.get('parent_block_hash')!r} medium={event.get('medium')!r} lora_id={event.get('lora_id')!r} "
        f"lora_name={event.get('lora_name')!r}; fields beyond the simulator's: {beyond}; "
        f"token_ids = the prompt's ids: {'no' if problems else 'yes'}; {_proxy_reads(frames)}; sim: {sim_says}"
    )
    return not problems, evidence + ("; PROBLEMS: " + "; ".join(problems) if problems else "")


def _extra_keys(frames: list[wire.Frame]) -> list[Any]:
    return [e.get("extra_keys") for f in frames for e in f.stored()]


def check_extra_keys_salt(m: Mixed) -> Result:
    salt = "salt-7f3a"
    body = {"model": MODEL, "prompt": words(BLOCK_TOKENS, "salted"), "max_tokens": 2, "cache_salt": salt}
    frames = _stored_after(m, m.a.url, m.a.events or "", body, 2)
    keys = _extra_keys(frames)
    per_block = [k for event_keys in keys for k in (event_keys or [])]
    ok = len(per_block) >= 2 and per_block[0] is not None and salt in per_block[0] and per_block[1] is None
    sim = _sim_stored(m, body)
    sim_says = "no answer" if sim is None else f"extra_keys={sim.get('extra_keys', 'absent')!r}"
    event = _first_stored(frames)
    return ok, (
        f"cache_salt={salt!r}: BlockStored extra_keys per event {keys!r} (one entry per block: the salt in the "
        f"first block only, untagged); lora_name={event.get('lora_name')!r}; sim: {sim_says}"
    )


def check_extra_keys_lora(m: Mixed) -> Result:
    salt = "salt-lora"
    results = []
    for seed, extra in (("lora", {}), ("lora salted", {"cache_salt": salt})):
        body = {"model": LORA, "prompt": words(BLOCK_TOKENS, seed), "max_tokens": 2, **extra}
        frames = _stored_after(m, m.a.url, m.a.events or "", body, 2)
        event = _first_stored(frames)
        results.append((extra, event.get("lora_name"), event.get("lora_id"), _extra_keys(frames)))
    shown = "; ".join(
        f"{'with cache_salt ' + repr(salt) if extra else 'no salt'}: lora_name={name!r} lora_id={lora_id!r} "
        f"extra_keys={keys!r}"
        for extra, name, lora_id, keys in results
    )
    ok = all(name == LORA and keys and keys[0] and LORA in keys[0][0] for _, name, _, keys in results)
    return ok, f"adapter {LORA!r} on node a: {shown}"


def _replay_problems(answer: wire.Replay) -> list[str]:
    problems = [] if answer.ended else ["no end marker"]
    for frames in answer.batches():
        if len(frames) != 4 or frames[0] != b"" or frames[1] != b"kv" or len(frames[2]) != 8:
            problems.append(f"answer {wire.shape(frames)} is not [b'', b'kv', seq, payload]")
            break
        wire.decode(frames[3])
    if answer.ended and answer.answers[-1] != [b"", b"", wire.END_SEQ, b""]:
        problems.append(f"end {wire.shape(answer.answers[-1])} is not [b'', b'', -1, b'']")
    return problems


def check_replay(m: Mixed) -> Result:
    answer = wire.replay(m.context, m.a.replay or "", 0)
    problems = _replay_problems(answer)
    batches = answer.batches()
    seqs = [int.from_bytes(b[2], "big") for b in batches if len(b) == 4]
    sim = wire.replay(m.context, m.sim_replay, 0)
    sim_says = (
        f"{len(sim.batches())} answers like {wire.shape(sim.batches()[0]) if sim.batches() else '-'}, end "
        f"{wire.shape(sim.answers[-1]) if sim.answers else '-'}"
    )
    end = wire.shape(answer.answers[-1]) if answer.answers else "none"
    evidence = (
        f"DEALER [b'', start=0] -> {len(batches)} answers, first {wire.shape(batches[0]) if batches else '-'}, "
        f"seqs {seqs[:3]}...{seqs[-1:]}, end {end} (raw {answer.answers[-1] if answer.ended else None!r}); "
        f"sim: {sim_says}"
    )
    return not problems, evidence + ("; PROBLEMS: " + "; ".join(problems) if problems else "")


def _kv_view(proxy: Server, node: Node) -> dict[str, Any]:
    for w in workers(proxy):
        if w["id"] == node.node_id:
            view: dict[str, Any] = w.get("kv_events") or {}
            return view
    return {}


def check_late_replica(m: Mixed, r2: Server) -> Result:
    """Run once ``r2`` (started after the nodes held blocks) lists both nodes; no request is sent meanwhile."""
    expected = int(_kv_view(m.r1, m.a).get("blocks_indexed", 0))
    deadline = time.monotonic() + 30
    view = _kv_view(r2, m.a)
    while time.monotonic() < deadline and int(view.get("blocks_indexed", 0)) < max(expected, 1):
        time.sleep(0.5)
        view = _kv_view(r2, m.a)
    got = int(view.get("blocks_indexed", 0))
    counters = {
        name: metric(r2.url, f"vllm_proxy_{name}_total")
        for name in ("kv_event_replays", "kv_event_malformed", "kv_event_batches")
    }
    return got >= max(expected, 1), (
        f"replica 2 started after node a stored its blocks: blocks_indexed for a = {got} (replica 1, there from "
        f"the start: {expected}); replica 2's {counters}; its kv_events view of a: {view}"
    )


def _cards(url: str) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


def check_model_cards(m: Mixed) -> Result:
    fields = ("root", "parent", "max_model_len")
    node_cards = {**_cards(m.b.url), **_cards(m.a.url)}
    problems, shown = [], []
    for proxy in (m.r1, *((m.r2,) if m.r2 else ())):
        listed = _cards(proxy.url)
        for model, card in node_cards.items():
            mine = listed.get(model)
            if mine is None or any(mine.get(f) != card.get(f) for f in fields):
                problems.append(f"{proxy.name} {model}: {mine and {f: mine.get(f) for f in fields}} != node's")
    for model, card in sorted(_cards(m.r1.url).items()):
        shown.append(f"{model}: " + ", ".join(f"{f}={card.get(f)!r}" for f in fields))
    evidence = "proxy's /v1/models: " + "; ".join(shown) + " (same as the nodes' own cards on both replicas)"
    return not problems, evidence if not problems else "; ".join(problems) + "; " + evidence


def _usage(response: dict[str, Any]) -> tuple[int, int]:
    usage = response.get("usage") or {}
    return int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)


def check_responses(m: Mixed, r2: Server) -> Result:
    """A response made through replica 1, continued and fetched through replica 2. ``max_output_tokens`` ends
    them early (status "incomplete"): what counts is that the follow-up's input holds the first exchange."""
    first = post(m.r1.url, "/v1/responses", {"model": MODEL, "input": "hello world", "max_output_tokens": 8})
    follow = post(
        r2.url,
        "/v1/responses",
        {"model": MODEL, "input": "and then", "max_output_tokens": 8, "previous_response_id": first["id"]},
    )
    fetched = httpx.get(f"{r2.url}/v1/responses/{first['id']}", timeout=30)
    (first_in, first_out), (follow_in, _) = _usage(first), _usage(follow)
    ok = follow_in > first_in + first_out and fetched.status_code == 200 and fetched.json().get("id") == first["id"]
    return ok, (
        f"replica 1 created {first['id']} (status {first.get('status')}, "
        f"{(first.get('incomplete_details') or {}).get('reason', '-')}; {first_in} tokens in, {first_out} out); "
        f"replica 2 answered a follow-up with previous_response_id -> {follow['id']} (status "
        f"{follow.get('status')}, {follow_in} tokens in: the first exchange included); GET /v1/responses/{{first}} "
        f"on replica 2 -> {fetched.status_code}"
    )


@dataclass(frozen=True, kw_only=True)
class Answer:
    text: str
    prompt_ids: list[int]
    ids: list[int]


def _answer(m: Mixed) -> Answer:
    text = words(40, "resume")
    done = complete(m.r1.url, text, 12, ignore_eos=True, return_token_ids=True)
    choice = done["choices"][0]
    return Answer(text=text, prompt_ids=choice["prompt_token_ids"], ids=choice["token_ids"])


def _streamed_ids(chunks: list[dict[str, Any]]) -> tuple[list[int] | None, list[int]]:
    prompt_ids = next((c["choices"][0].get("prompt_token_ids") for c in chunks if c.get("choices")), None)
    ids = [i for c in chunks for ch in c.get("choices", []) for i in ch.get("token_ids") or []]
    return prompt_ids, ids


def check_token_ids(m: Mixed) -> Result:
    answer = _answer(m)
    ours = m.vocab.encode(answer.text)
    body = {"model": MODEL, "prompt": answer.text, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompt_ids, ids = _streamed_ids(stream(m.r1.url, "/v1/completions", {**body, "return_token_ids": True}))
    ok = answer.prompt_ids == ours and prompt_ids == answer.prompt_ids and ids == answer.ids and len(ids) == 12
    return ok, (
        f"completions through replica 1: choices[0].prompt_token_ids {short(answer.prompt_ids)} "
        f"(= the proxy's tokenizer's ids: {answer.prompt_ids == ours}), token_ids {answer.ids}; streamed: first "
        f"chunk's prompt_token_ids equal: {prompt_ids == answer.prompt_ids}, chunks' token_ids joined equal: "
        f"{ids == answer.ids}"
    )


def check_chat_prompt_ids(m: Mixed) -> Result:
    messages = [{"role": "user", "content": words(20, "chat")}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    chunks = stream(m.r1.url, "/v1/chat/completions", body)
    first = chunks[0]
    top = first.get("prompt_token_ids")
    rendered = post(m.r1.url, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": True})
    ids = [i for c in chunks[1:] for ch in c.get("choices", []) for i in ch.get("token_ids") or []]
    ok = top is not None and top == rendered.get("tokens") and len(ids) > 0
    role = (first.get("choices") or [{}])[0].get("delta", {}).get("role")
    return ok, (
        f"streamed chat through replica 1: first chunk (delta role={role!r}) top-level prompt_token_ids "
        f"{short(top)}; POST /tokenize with messages + add_generation_prompt gives the same: "
        f"{top == rendered.get('tokens')}; later chunks' choices carry token_ids: {short(ids)}"
    )


def check_resume(m: Mixed) -> Result:
    answer = _answer(m)
    k = 5
    rest = complete(m.r1.url, answer.prompt_ids + answer.ids[:k], 12 - k, ignore_eos=True, return_token_ids=True)
    resumed = rest["choices"][0]["token_ids"]
    return resumed == answer.ids[k:], (
        f"12 greedy tokens {answer.ids}; prompt = prompt_token_ids + the first {k}, max_tokens {12 - k} -> "
        f"{resumed} (same as the original's last {12 - k}: {resumed == answer.ids[k:]})"
    )


def check_kv_routing(m: Mixed) -> Result:
    """A prefix cached on node b alone (sent to it directly) draws replica 1's next request with that prefix."""
    text = words(BLOCK_TOKENS, "routing")
    before = int(_kv_view(m.r1, m.b).get("blocks_indexed", 0))
    complete(m.b.url, text, 2)
    deadline = time.monotonic() + 60
    while int(_kv_view(m.r1, m.b).get("blocks_indexed", 0)) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    hits = {n.name: metric(n.url, "vllm:prefix_cache_hits_total") for n in (m.a, m.b)}
    complete(m.r1.url, text + " " + words(20, "routing tail"), 2)
    gained = {n.name: metric(n.url, "vllm:prefix_cache_hits_total") - hits[n.name] for n in (m.a, m.b)}
    return gained["b"] >= 256 and gained["a"] == 0, (
        f"{BLOCK_TOKENS} tokens sent to node b directly (replica 1 indexed "
        f"{int(_kv_view(m.r1, m.b).get('blocks_indexed', 0)) - before} new blocks of b); the same prompt and 20 "
        f"tokens more through replica 1 -> prefix-cache hit tokens gained: {gained}"
    )


MIXED_CHECKS: tuple[tuple[str, Callable[[Mixed], Result]], ...] = (
    ("kv-events PUB frames", check_pub_frames),
    ("kv-events extra_keys with cache_salt", check_extra_keys_salt),
    ("kv-events extra_keys with a LoRA adapter", check_extra_keys_lora),
    ("kv-events replay frames", check_replay),
)
AFTER_LATE_REPLICA: tuple[tuple[str, Callable[[Mixed], Result]], ...] = (
    ("model cards through the proxy", check_model_cards),
    ("token ids: return_token_ids", check_token_ids),
    ("token ids: streamed chat's prompt_token_ids", check_chat_prompt_ids),
    ("token ids: resume from ids", check_resume),
    ("kv-aware routing on the real events", check_kv_routing),
)


def external_kv_tokens(decode: Node) -> float:
    return metric(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def check_pd(proxies: list[Server], prefill: Node, decode: Node) -> Result:
    runs = []
    ok = True
    for i, proxy in enumerate(proxies):
        before = external_kv_tokens(decode)
        prefills = metric(prefill.url, "vllm:request_success_total")
        prompt = words(BLOCK_TOKENS, f"pd {i}")
        if i % 2:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            chunks = stream(proxy.url, "/v1/completions", body)
            text = "".join(c["choices"][0].get("text", "") for c in chunks if c.get("choices"))
            how = f"streamed ({len(chunks)} chunks)"
        else:
            text, how = complete(proxy.url, prompt, 8)["choices"][0]["text"], "non-streamed"
        grew = external_kv_tokens(decode) - before
        served = metric(prefill.url, "vllm:request_success_total") - prefills
        ok = ok and grew > 0 and served >= 1 and bool(text)
        runs.append(
            f"{how} through {proxy.name}: decode's external_kv_transfer prompt tokens +{grew:g} for a "
            f"{BLOCK_TOKENS}-token prompt, prefill node served +{served:g} request(s), answer {len(text)} chars"
        )
    return ok, "; ".join(runs)


def _idle_seen(proxy: Server, nodes: Sequence[Node], since: float) -> None:
    """Until ``proxy``'s last scrape of each node, taken after ``since`` (monotonic), says it runs nothing: the
    elastic decision reads those figures, and one taken while the previous request was decoding makes its node
    look busy."""
    ids = {n.node_id for n in nodes}
    deadline = time.monotonic() + EVENT_TIMEOUT
    while time.monotonic() < deadline:
        loads = [w.get("node_load") or {} for w in workers(proxy) if w["id"] in ids]
        fresh = [
            load
            for load in loads
            if load.get("age_seconds") is not None and time.monotonic() - load["age_seconds"] > since
        ]
        if len(fresh) == len(ids) and all(load["running"] == 0 and load["waiting"] == 0 for load in fresh):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{proxy.name} never saw {sorted(ids)} idle")


def _split_run(proxy: Server, nodes: Sequence[Node], prompt: str) -> tuple[dict[str, float], str]:
    """One completion through ``proxy`` once it sees the nodes idle: each node's external_kv_transfer prompt
    tokens gained, and the answer."""
    before = {n.name: external_kv_tokens(n) for n in nodes}
    _idle_seen(proxy, nodes, time.monotonic())
    text = complete(proxy.url, prompt, 8)["choices"][0]["text"]
    return {n.name: external_kv_tokens(n) - before[n.name] for n in nodes}, text


def _cache_on(node: Node, proxy: Server, prompt: str) -> None:
    """``prompt`` sent to ``node`` directly, until ``proxy`` has indexed its two full blocks there."""
    before = int(_kv_view(proxy, node).get("blocks_indexed", 0))
    complete(node.url, prompt, 2)
    deadline = time.monotonic() + EVENT_TIMEOUT
    while int(_kv_view(proxy, node).get("blocks_indexed", 0)) < before + 2:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proxy.name} never indexed the blocks sent to {node.name}")
        time.sleep(0.2)


def check_both(proxies: list[Server], a: Node, b: Node) -> Result:
    """Two kv_both nodes: a long new prompt is split (the decode node pulls the KV); then a prompt whose start is
    cached on that decode node alone (sent to it directly) is prefilled there and decoded on the other: KV moved
    both ways. A short prompt runs on one node, with nothing pulled."""
    nodes = (a, b)
    first, text1 = _split_run(proxies[0], nodes, words(BLOCK_TOKENS, "both first"))
    decoded = [n for n in nodes if first[n.name] > 0]
    if len(decoded) != 1:
        return False, f"a {BLOCK_TOKENS}-token prompt through {proxies[0].name}: external_kv_transfer {first}"
    start = words(BLOCK_TOKENS, "both second")
    _cache_on(decoded[0], proxies[1], start)
    second, text2 = _split_run(proxies[1], nodes, start + " " + words(BLOCK_TOKENS, "both second tail"))
    short_gain, text3 = _split_run(proxies[0], nodes, words(40, "both short"))
    into = [max(gain, key=lambda name: gain[name]) if max(gain.values()) > 0 else None for gain in (first, second)]
    ok = all(into) and into[0] != into[1] and not any(short_gain.values()) and all((text1, text2, text3))

    def gains(gain: dict[str, float]) -> str:
        return ", ".join(f"{name} +{tokens:g}" for name, tokens in gain.items())

    evidence = (
        f"external_kv_transfer prompt tokens: a new {BLOCK_TOKENS}-token prompt through {proxies[0].name}: "
        f"{gains(first)} (decoded on {into[0]}); {BLOCK_TOKENS} tokens cached on {decoded[0].name} directly, then "
        f"those + {BLOCK_TOKENS} more through {proxies[1].name}: {gains(second)} (decoded on {into[1]}); "
        f"a 40-token prompt through {proxies[0].name}: {gains(short_gain)} (run on one node); "
        f"answers {len(text1)}, {len(text2)}, {len(text3)} chars"
    )
    return ok, evidence


def bound(table: Iterable[tuple[str, Callable[[Mixed], Result]]], m: Mixed) -> list[tuple[str, Callable[[], Result]]]:
    """The checks of ``table``, each given the phase's ``m``."""
    return [(name, functools.partial(check, m)) for name, check in table]


def run_all(checks: Iterable[tuple[str, Callable[[], Result]]], record: Callable[[str, bool, str], None]) -> None:
    for name, check in checks:
        try:
            ok, evidence = check()
        except Exception as exc:  # noqa: BLE001 - a check that cannot run is a failed check, with the reason
            ok, evidence = False, f"could not run: {type(exc).__name__}: {exc}"
        record(name, ok, evidence)
