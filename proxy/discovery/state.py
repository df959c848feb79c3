"""One node as a replica sees it: ``NodeState``, written only by ``Pool`` (pool.py), read by the balancer."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm_etcd_proxy.fleet.records import Node, Sleep, Status
from vllm_etcd_proxy.fleet.vllm import ModelCard


@dataclass(eq=False, slots=True)
class NodeState:
    """One node as this replica sees it. Written only through ``Pool``'s methods; the balancer reads it (within
    one synchronous ``choose`` call, so every field it reads is from the same moment)."""

    node: Node
    learned_models: tuple[str, ...] = ()
    """Models from the node's GET /v1/models, used when the record names none."""
    learned: bool = False
    """True once the node's GET /v1/models answered."""
    learned_cards: Mapping[str, ModelCard] = field(default_factory=dict)
    """The entries of that answer by model id, as the node gave them."""
    in_flight: int = 0
    """Requests this replica has open on the node right now."""
    prefilling: int = 0
    """Of those, prefill legs (the prompt only, for a decode node to pull): the rest decode or run whole."""
    node_waiting: int = 0
    """Requests waiting in the node's own queue (all replicas'), from its /metrics when --scrape-load is on."""
    node_running: int = 0
    """Requests the node is running (all replicas'), from its /metrics when --scrape-load is on."""
    kv_usage: float = 0.0
    """The node's KV-cache usage, 0 to 1, from its /metrics when --scrape-load is on."""
    node_itl: float | None = None
    """The node's recent mean seconds between output tokens, from its /metrics (None: not known yet)."""
    prefix_hit_rate: float | None = None
    """The node's prefix-cache hits per queried token over the last seconds, from its /metrics (None: unknown)."""
    load_at: float | None = None
    """``time.monotonic()`` of the last successful scrape of the node's /metrics (None: never)."""
    served: int = 0
    """Requests completed through this replica (any outcome)."""
    failures: int = 0
    """Consecutive failures (connect errors, timeouts, 5xx); reset by a success."""
    ejected: bool = False
    """True while this replica does not route to the node (after repeated failures, until a probe succeeds)."""
    ejections: int = 0
    """Ejections in a row without a healthy spell in between; the probe back-off doubles with each."""
    probe_at: float = 0.0
    """monotonic() time of the next health probe while ejected."""
    probation: bool = False
    """Back from ejection but not yet proven: takes one request at a time until one succeeds."""
    asleep: bool = False
    """The node's /metrics says its engine sleeps (vLLM's sleep mode): no new requests until it wakes."""
    busy_until: float = 0.0
    """monotonic() time until which the node gets no new requests: it answered 503 (scaling, overloaded)."""
    loaded_adapters: tuple[str, ...] = ()
    """LoRA adapters this replica loaded on the node (served beside ``models`` until the node says otherwise)."""
    lora_running: frozenset[str] = frozenset()
    """Adapters with running requests on the node (its newest ``vllm:lora_requests_info``; --scrape-load)."""
    lora_waiting: frozenset[str] = frozenset()
    """Adapters with requests waiting on the node (same gauge)."""
    max_loras: int | None = None
    """The node's adapter slots (``max_lora`` of the gauge); None when it does not say."""
    finished: float | None = None
    """Requests the node finished since it started (``vllm:request_success_total``; None: never scraped)."""
    active_at: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when this replica last saw the node busy or finishing requests (any replica's), or
    first saw it: the start of its idle time (``--sleep-after-idle``)."""

    entry_key: str = field(init=False)
    """The node's key in the pool (``entry_key``), worked out once: a state's node is only ever replaced by a
    record of the same entry (pool.py), and routing reads it for every candidate of every request."""

    def __post_init__(self) -> None:
        self.entry_key = entry_key(self.node)

    @property
    def models_known(self) -> bool:
        return bool(self.node.models) or self.learned

    @property
    def models(self) -> tuple[str, ...]:
        base = self.node.models or self.learned_models
        if not self.loaded_adapters:
            return base
        return base + tuple(a for a in self.loaded_adapters if a not in base)

    @property
    def cards(self) -> Mapping[str, ModelCard]:
        """The node's own model list entries, from its record or from asking it."""
        return self.node.cards or self.learned_cards

    @property
    def serving(self) -> bool:
        """Its record lets it take requests: status serving, no sleep mark."""
        return self.node.status is Status.SERVING and self.node.sleep is Sleep.AWAKE

    @property
    def routable(self) -> bool:
        return self.serving and self.models_known and not self.ejected

    @property
    def sleeping(self) -> bool:
        """Marked for sleep in its record, or asleep by its own /metrics."""
        return self.node.sleep is not Sleep.AWAKE or self.asleep

    @property
    def admits(self) -> bool:
        """Takes a request now: not ejected, awake, not busy, and on probation only while it has none in flight."""
        if self.ejected or self.asleep or (self.probation and self.in_flight):
            return False
        return not self.busy_until or time.monotonic() >= self.busy_until


def entry_key(node: Node) -> str:
    return node.key if node.key is not None else f"{node.source.value}:{node.role.value}/{node.node_id}"
