"""Nodes by role and model, with the per-replica state routing needs (in-flight count, learned models).

The pool applies events (from discovery, the static flags and the admin API), answers queries, and is the one
writer of every ``NodeState``: the forwarder, the load watcher, the model prober and the ejector report what
they saw through its methods, and the balancer only reads. It does no I/O. Entries are keyed by their etcd key,
or ``{source}:{role}/{node_id}`` for in-memory nodes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import replace

from vllm_etcd_proxy.fleet.records import Node, Role, Sleep, Status
from vllm_etcd_proxy.fleet.vllm import ModelCard
from vllm_etcd_proxy.proxy.discovery.events import PoolEvent, Remove, Snapshot, Upsert
from vllm_etcd_proxy.proxy.discovery.state import NodeState, entry_key

__all__ = ["NodeState", "Pool", "entry_key"]

DEMAND_WINDOW = 60.0
"""Seconds a model counts as in demand after a request asked for it: its nodes' background work comes first."""


class Pool:
    """All nodes known to this replica. ``version`` changes whenever the set or a node's routability does.

    Every change costs in proportion to the nodes it touches, never to the pool's size: the candidates of each
    (role, model) and the routable nodes are kept up to date node by node, a batch of events counts as one
    change, and a background worker learns of a node through ``on_node`` (called for that node only)."""

    def __init__(self) -> None:
        self._entries: dict[str, NodeState] = {}
        self._index: dict[tuple[Role, str], dict[str, NodeState]] = {}
        self._routable: dict[str, NodeState] = {}
        self._ejected: dict[str, NodeState] = {}
        self._model_nodes: dict[str, int] = {}
        """Routable nodes per model name."""
        self._listeners: list[Callable[[NodeState], None]] = []
        self._drop_listeners: list[Callable[[NodeState], None]] = []
        self._demand_listeners: list[Callable[[str], None]] = []
        self._load_listeners: list[Callable[[NodeState], None]] = []
        self._asked_at: dict[str, float] = {}
        self.version = 0

    # -- changes -------------------------------------------------------------------------------------------

    def on_node(self, listener: Callable[[NodeState], None]) -> None:
        """Call ``listener(state)`` for a node that was added, or whose record, models or routability changed."""
        self._listeners.append(listener)

    def on_load(self, listener: Callable[[NodeState], None]) -> None:
        """Call ``listener(state)`` after each load scrape of a node (the fair queue looks for room then)."""
        self._load_listeners.append(listener)

    def on_drop(self, listener: Callable[[NodeState], None]) -> None:
        """Call ``listener(state)`` for a node that left the pool."""
        self._drop_listeners.append(listener)

    def on_demand(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(model)`` when a model is asked for after ``DEMAND_WINDOW`` seconds without a request."""
        self._demand_listeners.append(listener)

    def _changed(self) -> None:
        self.version += 1

    def _unindex(self, state: NodeState) -> None:
        key = state.entry_key
        for name in state.models:
            nodes = self._index.get((state.node.role, name))
            if nodes is not None and nodes.pop(key, None) is not None and not nodes:
                del self._index[(state.node.role, name)]
        if self._routable.pop(key, None) is not None:
            for name in state.models:
                left = self._model_nodes.get(name, 0) - 1
                if left > 0:
                    self._model_nodes[name] = left
                else:
                    self._model_nodes.pop(name, None)
        self._ejected.pop(key, None)

    def _reindex(self, state: NodeState) -> None:
        """Put ``state`` (already un-indexed, and still in the pool) back where it now belongs; tell listeners."""
        key = state.entry_key
        if state.serving and state.models_known:
            for name in state.models:
                self._index.setdefault((state.node.role, name), {})[key] = state
        if state.routable:
            self._routable[key] = state
            for name in state.models:
                self._model_nodes[name] = self._model_nodes.get(name, 0) + 1
        if state.ejected:
            self._ejected[key] = state
        for listener in self._listeners:
            listener(state)

    def apply(self, event: PoolEvent) -> None:
        """Apply one discovery event. Snapshots replace every node that came from etcd."""
        self.apply_all((event,))

    def apply_all(self, events: Iterable[PoolEvent]) -> None:
        """Apply discovery's events in order (one watch response's), as one change."""
        for event in events:
            if isinstance(event, Snapshot):
                fresh = {entry_key(n) for n in event.nodes}
                for key in [k for k, s in self._entries.items() if s.node.key is not None and k not in fresh]:
                    self._drop(key)
                for node in event.nodes:
                    self._upsert(node)
            elif isinstance(event, Upsert):
                self._upsert(event.node)
            elif isinstance(event, Remove):
                self._drop(event.key)
        self._changed()

    def add(self, node: Node) -> bool:
        """Add an in-memory node (static flag or admin API). False if one with that id and role exists."""
        key = entry_key(node)
        if key in self._entries or self.find(node.role, node.host_port, memory_only=True):
            return False
        self._upsert(node)
        self._changed()
        return True

    def remove(self, state: NodeState) -> None:
        if self._entries.get(state.entry_key) is state:
            self._drop(state.entry_key)
        self._changed()

    def _drop(self, key: str) -> None:
        state = self._entries.pop(key, None)
        if state is not None:
            self._unindex(state)
            for listener in self._drop_listeners:
                listener(state)

    def _upsert(self, node: Node) -> None:
        key = entry_key(node)
        old = self._entries.get(key)
        if old is not None and old.node == node:
            return  # a put that changed nothing (a registrar's re-put, a re-list)
        if old is not None:
            self._unindex(old)
            if old.node.url == node.url:
                # Same server: keep counters and learned models so a status flip does not reset them.
                if node.sleep is Sleep.AWAKE and old.node.sleep is not Sleep.AWAKE:
                    old.asleep = False  # its sleep mark was cleared by whoever woke it: awake before the next scrape
                old.node = node
                self._reindex(old)
                return
        state = self._entries[key] = NodeState(node=node)
        self._reindex(state)

    def get(self, key: str) -> NodeState | None:
        """The node with this entry key now (a worker holding a key finds whether its node is still there)."""
        return self._entries.get(key)

    def set_learned_models(self, state: NodeState, models: Iterable[str], cards: Iterable[ModelCard] = ()) -> None:
        """Record what GET /v1/models answered for a node whose record names no models."""
        state.learned_cards = {card["id"]: card for card in cards}
        learned = tuple(dict.fromkeys(models))
        if state.learned_models != learned or not state.learned:
            current = self._entries.get(state.entry_key) is state
            if current:
                self._unindex(state)
            state.learned_models = learned
            state.learned = True
            if current:
                self._reindex(state)
                self._changed()

    def set_adapter_loaded(self, state: NodeState, name: str, loaded: bool) -> None:
        """This replica loaded LoRA adapter ``name`` on the node, or learned the node no longer has it."""
        adapters = tuple(a for a in state.loaded_adapters if a != name) + ((name,) if loaded else ())
        if adapters != state.loaded_adapters:
            current = self._entries.get(state.entry_key) is state
            if current:
                self._unindex(state)
            state.loaded_adapters = adapters
            if not loaded and name in state.learned_models:
                state.learned_models = tuple(m for m in state.learned_models if m != name)
            if current:
                self._reindex(state)
                self._changed()

    # -- what others saw of a node (the one place NodeState is written) ---------------------------------------

    def request_started(self, state: NodeState, *, prefill: bool = False) -> None:
        """A leg of this replica's went to the node (``prefill``: a prefill leg, the prompt only)."""
        state.in_flight += 1
        state.prefilling += prefill

    def request_ended(self, state: NodeState, *, prefill: bool = False) -> None:
        state.in_flight -= 1
        state.prefilling -= prefill
        state.served += 1

    def set_load(self, state: NodeState, running: int, waiting: int, kv_usage: float, at: float) -> None:
        """The node's own figures from its /metrics (every replica's requests, not only ours), scraped at ``at``."""
        state.node_running, state.node_waiting, state.kv_usage = running, waiting, kv_usage
        state.load_at = at
        for listener in self._load_listeners:
            listener(state)

    def set_lora(self, state: NodeState, running: frozenset[str], waiting: frozenset[str], slots: int | None) -> None:
        """The node's adapters with running and waiting requests, and its slots (``vllm:lora_requests_info``)."""
        state.lora_running, state.lora_waiting, state.max_loras = running, waiting, slots

    def set_sleep_mark(self, state: NodeState, mark: Sleep) -> None:
        """Change the sleep mark of the node's record as this replica knows it (at once, before etcd's watch
        brings the same change; the only place it is kept for nodes without a key)."""
        if state.node.sleep is mark:
            return
        current = self._entries.get(state.entry_key) is state
        if current:
            self._unindex(state)
        if mark is Sleep.AWAKE:
            state.asleep = False
        state.node = replace(state.node, sleep=mark)
        if current:
            self._reindex(state)
            self._changed()

    def set_finished(self, state: NodeState, finished: float | None, at: float) -> None:
        """The node's count of finished requests at a scrape (after ``set_load``): busy or finishing, it is active."""
        if finished != state.finished or state.node_running or state.node_waiting or state.in_flight:
            state.active_at = at
        state.finished = finished

    def set_asleep(self, state: NodeState, asleep: bool) -> None:
        """What the node's /metrics says of its sleep mode (read live by ``admits``: no index to rebuild)."""
        state.asleep = asleep

    def hold_busy(self, state: NodeState, seconds: float) -> None:
        """The node answered 503: give it no new requests for ``seconds``."""
        state.busy_until = time.monotonic() + seconds

    def set_token_latency(self, state: NodeState, seconds: float | None) -> None:
        """The node's recent mean time between output tokens (its speed; None until known)."""
        state.node_itl = seconds

    def set_prefix_hit_rate(self, state: NodeState, rate: float | None) -> None:
        """The node's recent prefix-cache hit rate (shown, not routed on)."""
        state.prefix_hit_rate = rate

    def set_health(
        self,
        state: NodeState,
        *,
        failures: int,
        probation: bool,
        ejections: int | None = None,
        probe_at: float | None = None,
    ) -> None:
        """The ejector's counters (its rules decide the values; see ejection.py)."""
        state.failures, state.probation = failures, probation
        if ejections is not None:
            state.ejections = ejections
        if probe_at is not None:
            state.probe_at = probe_at

    def set_ejected(self, state: NodeState, ejected: bool) -> None:
        """Take a node out of this replica's routing, or put it back."""
        if state.ejected != ejected:
            current = self._entries.get(state.entry_key) is state
            if current:
                self._unindex(state)
            state.ejected = ejected
            if current:
                self._reindex(state)
                self._changed()

    # -- queries ------------------------------------------------------------------------------------------

    def all(self) -> list[NodeState]:
        return list(self._entries.values())

    def by_role(self, role: Role) -> list[NodeState]:
        return [s for s in self._entries.values() if s.node.role is role]

    def find(self, role: Role, host_port: str, *, memory_only: bool = False) -> list[NodeState]:
        """Nodes of ``role`` whose URL or id is ``host_port`` (the admin API's way to name a node)."""
        found = []
        for state in self._entries.values():
            if state.node.role is not role:
                continue
            if memory_only and state.node.key is not None:
                continue
            if host_port in (state.node.host_port, state.node.node_id):
                found.append(state)
        return found

    def serves(self, role: Role, model: str) -> bool:
        """Whether some serving node of ``role`` has ``model`` (ejected or not; unlike ``candidates`` it marks no
        demand)."""
        return bool(self._index.get((role, model)))

    def candidates(self, role: Role, model: str) -> list[NodeState]:
        """Routable nodes of ``role`` serving ``model`` (serving, models known, not ejected). A request asks this,
        so it also marks ``model`` as in demand (see ``in_demand``) when some node serves it."""
        nodes = self._index.get((role, model))
        if not nodes:
            return []  # a name no node serves is not remembered: clients cannot grow the table
        self._asked(model)
        return [s for s in nodes.values() if s.admits]

    def available(self, role: Role, model: str) -> bool:
        """Whether ``candidates(role, model)`` has a node, without making the list (a fleet may have thousands);
        marks the demand alike."""
        nodes = self._index.get((role, model))
        if not nodes:
            return False
        self._asked(model)
        return any(s.admits for s in nodes.values())

    def _asked(self, model: str) -> None:
        now = time.monotonic()
        last = self._asked_at.get(model)
        self._asked_at[model] = now
        if last is None or now - last > DEMAND_WINDOW:
            for listener in self._demand_listeners:
                listener(model)

    def sleeping(self, model: str) -> list[NodeState]:
        """The nodes of ``model`` that sleep or go to sleep (marked in their record, or asleep by their /metrics),
        not ejected; a scan of every node: for a model with no node awake only."""
        return [
            s
            for s in self._entries.values()
            if s.sleeping and not s.ejected and s.node.status is Status.SERVING and model in s.models
        ]

    def last_asked(self, model: str) -> float | None:
        """``time.monotonic()`` of this replica's last request for ``model`` (None: none yet)."""
        return self._asked_at.get(model)

    def serving(self, model: str) -> list[NodeState]:
        """Every node of any role that would serve ``model`` if it were not ejected (no demand recorded)."""
        return [s for role in Role for s in self._index.get((role, model), {}).values()]

    def in_demand(self, state: NodeState, window: float = DEMAND_WINDOW) -> bool:
        """Whether a request asked for one of the node's models within ``window`` seconds."""
        now = time.monotonic()
        return any(now - self._asked_at.get(m, -math.inf) <= window for m in state.models)

    def routable(self) -> Collection[NodeState]:
        """The routable nodes, kept up to date (a view: do not hold it across awaits)."""
        return self._routable.values()

    def ejected(self) -> Collection[NodeState]:
        """The nodes this replica ejected (a view)."""
        return self._ejected.values()

    def models(self) -> list[str]:
        """Models served by at least one routable node, sorted."""
        return sorted(self._model_nodes)
