"""A node fails while it streams: a burst of long requests on its model through every replica, what the node was
generating at the moment of the fault, and the answers those requests should have got.

    burst = Burst.spawn(load, fleet.replicas, MODEL)       # long streams and full answers, all at once
    wait_until(lambda: burst.busy(victim), 15, "...")      # >= AT_ONCE streams generating on the victim
    at_fault = Snapshot.of(victim)                         # right before the fault
    ... kill -9 the victim, or make it hang ...
    burst.outcomes()                                       # once each has ended

The simulated model is deterministic, so "the same answer" is checkable: ``differing(outcomes, expected)``
against ``load.expected_answers`` from a healthy node of the victim's role.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tests.faults.fleet import FleetNode
from tests.faults.load import Answer, Kind, Load, Outcome
from tests.support.proxy_proc import ProxyProc

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BURST_STREAMS = 40
"""Long streams in a burst, alternating over the replicas and over chat and completions: each of the model's two
nodes gets about half (least-load alternates; cache-aware hashes each distinct prompt), so at least one of them
has comfortably more than AT_ONCE."""
BURST_FULL = 12
"""Long non-streamed requests in a burst: a few of them are on the victim too (at least 2 of 12 on a node that
holds most of the streams, but for a 1-in-300 split)."""
BURST_TOKENS = 200
"""Tokens of a burst request: ~2 s at the nodes' 10 ms per token, so none ends before the fault."""
AT_ONCE = 16
"""Streams the victim must be serving at the moment of the fault."""
GENERATING = 2
"""Tokens a request must have generated to count as mid-stream: the client already has part of the answer."""


@dataclass(frozen=True)
class Snapshot:
    """The request ids a node was generating at one moment (GET /sim/requests), streamed or not."""

    streams: frozenset[str]
    full: frozenset[str]

    @classmethod
    def of(cls, node: FleetNode, *, min_tokens: int = 0, among: Iterable[str] | None = None) -> Snapshot:
        wanted = None if among is None else set(among)
        running = [
            r
            for r in node.sim.requests()
            if r["state"] == "running"
            and r["completion_tokens"] >= min_tokens
            and (wanted is None or r["request_id"] in wanted)
        ]
        return cls(
            streams=frozenset(r["request_id"] for r in running if r["stream"]),
            full=frozenset(r["request_id"] for r in running if not r["stream"]),
        )


@dataclass(frozen=True)
class Burst:
    """Requests spawned on a load all at once; ``futures`` by request id."""

    futures: Mapping[str, Future[Outcome]]

    @classmethod
    def spawn(
        cls,
        load: Load,
        replicas: Sequence[ProxyProc],
        model: str,
        *,
        tag: str = "burst",
        streams: int = BURST_STREAMS,
        full: int = BURST_FULL,
        tokens: int = BURST_TOKENS,
        full_tokens: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Burst:
        """``streams`` streamed and ``full`` non-streamed requests for ``model``, alternating chat and completions
        and the replicas; ids ``{tag}-r{replica}-{n}`` (streams) and ``{tag}-r{replica}-full{n}``."""
        futures: dict[str, Future[Outcome]] = {}
        for n in range(streams + full):
            stream = n < streams
            kind = Kind(model=model, stream=stream, path=(CHAT, COMPLETIONS)[n % 2])
            index = (n // 2) % len(replicas)
            request_id = f"{tag}-r{index}-{n if stream else f'full{n}'}"
            futures[request_id] = load.spawn(
                replicas[index].url,
                kind,
                request_id=request_id,
                extra=extra,
                max_tokens=tokens if stream else full_tokens or tokens,
            )
        return cls(futures)

    def on(self, node: FleetNode, min_tokens: int = GENERATING) -> Snapshot:
        """This burst's requests generating on ``node`` with at least ``min_tokens`` tokens."""
        return Snapshot.of(node, min_tokens=min_tokens, among=self.futures)

    def busy(self, node: FleetNode, streams: int = AT_ONCE, full: int = 2) -> bool:
        """At least ``streams`` of the burst's streams and ``full`` of its full answers generating on ``node``."""
        seen = self.on(node)
        return len(seen.streams) >= streams and len(seen.full) >= full

    def outcomes(self, timeout: float = 60.0) -> list[Outcome]:
        return [future.result(timeout=timeout) for future in self.futures.values()]


def differing(outcomes: Iterable[Outcome], expected: Mapping[str, Answer]) -> list[str]:
    """One line per outcome whose answer is not the expected one (empty when all are)."""
    return [
        f"{o.request_id} via {o.replica} node={o.node} {o.result}: {_difference(o.answer, expected[o.request_id])}"
        for o in outcomes
        if o.answer != expected[o.request_id]
    ]


def _difference(got: Answer | None, want: Answer) -> str:
    if got is None:
        return "no answer"
    if got.text != want.text:
        words, wanted = got.text.split(), want.text.split()
        pairs = enumerate(zip(words, wanted, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(words), len(wanted)))
        return (
            f"{len(words)} words where a healthy node gives {len(wanted)}, differing from word {at}: "
            f"got {words[at : at + 3]}, want {wanted[at : at + 3]}"
        )
    return f"finish/usage {got.finish_reason}/{got.usage}, a healthy node gives {want.finish_reason}/{want.usage}"
