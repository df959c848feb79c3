"""What bench.routing runs: the routers compared and the scenarios they are compared in. Plain data.

A router is a way of sending the sessions' requests to the nodes: straight (an oracle that pins each session,
or spraying), through this project's replicas with one policy, or through vllm-router processes. A scenario
is a fleet and a workload: preamble length, chat or completions, one slow node, a prefill/decode fleet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SESSION_HEADER = "X-Session-ID"
"""Read by this project's affinity policies (--affinity-header) and by vllm-router's sticky_least_loaded."""


@dataclass(frozen=True, kw_only=True)
class Router:
    label: str
    kind: str
    """oracle, direct, proxy or vllm-router."""
    policy: str = ""
    replicas: int = 1
    header: bool = False
    """Send the session id in SESSION_HEADER."""
    extra: tuple[str, ...] = ()
    """More flags for each replica."""

    @property
    def name(self) -> str:
        return f"{self.label} R={self.replicas}" if self.kind in ("proxy", "vllm-router") else self.label


ORACLE = Router(label="oracle (direct, session % nodes)", kind="oracle")
SPRAY = Router(label="round-robin, direct", kind="direct")


def proxy(policy: str, replicas: int, header: bool = False, extra: tuple[str, ...] = ()) -> Router:
    label = policy + (f" + {SESSION_HEADER}" if header else "") + "".join(f" {x}" for x in extra)
    return Router(label=label, kind="proxy", policy=policy, replicas=replicas, header=header, extra=extra)


def vllm_router(policy: str, replicas: int) -> Router:
    # Only the sticky policy reads a session header; cache_aware routes by the prompt's text, as ours does.
    header = policy == "sticky_least_loaded"
    label = f"vllm-router {policy}" + (f" + {SESSION_HEADER}" if header else "")
    return Router(label=label, kind="vllm-router", policy=policy, replicas=replicas, header=header)


def full_set(proxy_replicas: tuple[int, ...], router_replicas: tuple[int, ...]) -> tuple[Router, ...]:
    """Every router the issue names, at every replica count."""
    policies = (
        ("kv-aware", False),
        ("cache-aware", False),
        ("consistent-hash", False),
        ("consistent-hash", True),
        ("least-load", False),
    )
    ours = [proxy(p, r, h) for p, h in policies for r in proxy_replicas]
    peers = [vllm_router(p, r) for p in ("cache_aware", "sticky_least_loaded") for r in router_replicas]
    return (ORACLE, SPRAY, *ours, *peers)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    description: str
    routers: tuple[Router, ...]
    api: str = "chat"
    system_words: int = 50
    first_words: int = 50
    slow_factor: float = 1.0
    """The last node's timings times this (1: all healthy)."""
    pd: bool = False
    """Half the nodes prefill, half decode (else all mixed)."""
    baseline: str | None = None
    """The all-healthy scenario with the same workload, to compare TTFT p99 with."""


def routers_in(prefixes: list[str], every: tuple[Router, ...]) -> tuple[Router, ...]:
    """The routers of ``every`` whose name starts with one of ``prefixes`` (all of them for an empty list)."""
    if not prefixes:
        return every
    unknown = [p for p in prefixes if not any(r.name.startswith(p) for r in every)]
    if unknown:
        raise ValueError(f"no router named {unknown}; known: {sorted(r.name for r in every)}")
    return tuple(r for r in every if any(r.name.startswith(p) for p in prefixes))


def scenarios(
    *,
    proxy_replicas: tuple[int, ...],
    router_replicas: tuple[int, ...],
    short_words: int,
    long_words: int,
    pd_first_words: int,
    slow_factor: float,
    quick: bool,
) -> dict[str, Scenario]:
    """Every scenario by name, in running order. ``quick`` keeps a few routers per scenario (a smoke run)."""
    full = full_set(proxy_replicas, router_replicas)
    r_mid = proxy_replicas[len(proxy_replicas) // 2]
    few = (
        ORACLE,
        SPRAY,
        *(proxy(p, r) for p in ("kv-aware", "cache-aware") for r in proxy_replicas),
        proxy("consistent-hash", r_mid, header=True),
        proxy("least-load", r_mid),
        vllm_router("cache_aware", router_replicas[-1]),
        *(vllm_router("sticky_least_loaded", r) for r in router_replicas),
    )
    pd_routers = (
        *(proxy("cache-aware", r, extra=("--pd-min-prompt-tokens", str(m))) for m in (0, 256) for r in router_replicas),
        proxy("kv-aware", router_replicas[-1], extra=("--pd-min-prompt-tokens", "256")),
        proxy("least-load", router_replicas[-1], extra=("--pd-min-prompt-tokens", "0")),
    )
    if quick:
        full = (ORACLE, proxy("cache-aware", r_mid), vllm_router("sticky_least_loaded", 1))
        few = (proxy("cache-aware", r_mid),)
        pd_routers = (proxy("cache-aware", r_mid, extra=("--pd-min-prompt-tokens", "0")),)
    return {
        "chat-short": Scenario(
            name="chat-short",
            routers=full,
            system_words=short_words,
            description=f"chat, shared system prompt of {short_words} words",
        ),
        "chat-long": Scenario(
            name="chat-long",
            routers=few,
            system_words=long_words,
            description=f"chat, shared system prompt of {long_words} words (longer than any session's own part)",
        ),
        "completions": Scenario(
            name="completions",
            routers=few,
            api="completions",
            system_words=short_words,
            description=f"/v1/completions, the conversation as one text prompt, shared preamble of {short_words} words",
        ),
        "token-ids": Scenario(
            name="token-ids",
            routers=few,
            api="token-ids",
            system_words=short_words,
            description=f"completions's workload with the prompt as token ids (which the kv-aware index reads "
            f"without a tokenizer), shared preamble of {short_words} words",
        ),
        "slow-node": Scenario(
            name="slow-node",
            routers=few if not quick else full[1:2],
            system_words=short_words,
            slow_factor=slow_factor,
            baseline="chat-short",
            description=f"chat-short's workload with the last node {slow_factor:g}x slower from the start "
            "(ttft, itl and prefill per token)",
        ),
        "pd": Scenario(
            name="pd",
            routers=pd_routers,
            system_words=short_words,
            first_words=pd_first_words,
            pd=True,
            description=f"2 prefill + 2 decode nodes; chat, shared system prompt of {short_words} words, first "
            f"message {pd_first_words} words (a pasted document), later ones as in chat-short",
        ),
    }


def cache_blocks(
    *,
    system_words: int,
    first_words: int,
    followup_words: int,
    max_tokens: int,
    turns: int,
    concurrency: int,
    nodes: int,
    block_size: int,
) -> int:
    """The prefix cache per node: the shared preamble plus twice a node's fair share of the sessions running at
    once, each at its longest. Routing that keeps sessions apart never evicts a live session then; spraying every
    live session over every node does. Tokens as the simulator counts them: a word each, plus the template's
    markers (a few per message)."""
    shared = (system_words + 2) // block_size
    own = first_words + 3 + (turns - 1) * (max_tokens + followup_words + 4) + max_tokens
    per_session = math.ceil(own / block_size) + 1
    blocks = shared + 2 * math.ceil(concurrency / nodes) * per_session
    return math.ceil(blocks / 16) * 16
