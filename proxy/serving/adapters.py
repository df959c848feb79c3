"""LoRA adapters on demand: a request for a registered adapter is served after the adapter is loaded on a node of
its base model, and it goes where the adapter is active (``routing.balancer.prefer_adapter``).

- No routable node has the adapter: a node of the base model is chosen (a free adapter slot first, then the
  least loaded, ties broken by a hash of adapter and node as in ``prefer_adapter``, so replicas agree) and asked
  ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``. One load per node and adapter is in flight in this
  replica: requests that arrive meanwhile wait for it. vLLM's "has already been loaded" counts as success. A load
  that fails holds that node back for the adapter (``FAILED_HOLD``) and the next node is tried, up to
  ``MAX_LOADS`` in one request; then the request fails with 502 and the nodes' answers.
- The adapter's nodes all queue requests (``vllm:num_requests_waiting``, from --scrape-load) and carry
  ``OUTGROW_SLACK`` more than a node of the base model without it: it is loaded there too, in the background
  (the request goes on to the nodes that have it).
- A node answers 404 for an adapter this replica thought it had (it restarted): the adapter is loaded again
  and the request retried, once.
Unregistered adapters are never loaded; copies already loaded stay on their nodes until vLLM drops them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

import httpx

from vllm_etcd_proxy.fleet.adapters import Adapter
from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.adapters import AdapterRegistry
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ModelNotFound, NoNodeAvailable, UpstreamFailed
from vllm_etcd_proxy.proxy.routing.balancer import _stable_hash, node_load, prefer_adapter
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Upstream
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger(__name__)

ROLES = (Role.MIXED, Role.DECODE)
"""Nodes adapters are loaded on: those a request that is not disaggregated goes to."""
LOAD_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
"""A load may fetch the adapter from a hub first."""
FAILED_HOLD = 30.0
"""Seconds a node whose load of an adapter failed is not asked to load it again."""
MAX_LOADS = 3
"""Nodes one request tries to load its adapter on before it fails."""
OUTGROW_SLACK = 4
"""Requests the adapter's least loaded node may carry beyond a node without it before it is loaded there too."""


class LoadFailed(Exception):
    """A node did not load the adapter; the message says what it answered."""


class AdapterLoader:
    """Loads registered adapters where requests need them; built in the app's lifespan, ``close``d there."""

    def __init__(
        self,
        pool: Pool,
        registry: AdapterRegistry,
        client: httpx.AsyncClient,
        metrics: ProxyMetrics,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._registry = registry
        self._client = client
        self._headers = headers
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failed: dict[tuple[str, str], float] = {}

    def registered(self, model: str) -> Adapter | None:
        return self._registry.get(model)

    def listed(self, served: list[str]) -> list[Adapter]:
        """The registered adapters whose base model is among ``served``."""
        bases = set(served)
        return [a for a in self._registry.all() if a.base in bases and a.name not in bases]

    def _held(self, state: NodeState, name: str) -> bool:
        """The node failed to load the adapter less than ``FAILED_HOLD`` seconds ago."""
        return self._failed.get((state.entry_key, name), 0.0) > time.monotonic()

    def narrow(self, model: str, candidates: list[NodeState]) -> list[NodeState]:
        """A request's candidates: ``prefer_adapter``'s when ``model`` is an adapter (registered, or one whose card
        on the first candidate has a ``parent``: adapters the nodes list themselves), else as they are."""
        if self._registry.get(model) is not None:
            return prefer_adapter(candidates, model)
        card = candidates[0].cards.get(model) if candidates else None
        if card is not None and card.get("parent"):
            return prefer_adapter(candidates, model)
        return candidates

    def _have(self, name: str) -> list[NodeState]:
        return [s for role in ROLES for s in self._pool.candidates(role, name)]

    def _targets(self, adapter: Adapter) -> list[NodeState]:
        """Nodes of the base model that could load the adapter now, best first."""
        nodes = [
            s
            for role in ROLES
            for s in self._pool.candidates(role, adapter.base)
            if adapter.name not in s.models and not self._held(s, adapter.name)
        ]

        def rank(state: NodeState) -> tuple[bool, int, int]:
            full = state.max_loras is not None and len(state.lora_running) >= state.max_loras
            return full, node_load(state), -_stable_hash(f"{adapter.name}#{state.node.node_id}")  # its home first

        return sorted(nodes, key=rank)

    async def ensure(self, adapter: Adapter) -> None:
        """Return once some routable node has ``adapter`` (loading it if none has); raise ``ProxyError`` else."""
        answers: list[str] = []
        while not (have := self._have(adapter.name)):
            pending = [t for (_, name), t in self._loads.items() if name == adapter.name]
            if not pending:
                if len(answers) >= MAX_LOADS or not (targets := self._targets(adapter)):
                    raise self._failure(adapter, answers)
                pending = [self._start(targets[0], adapter)]
            try:
                await asyncio.shield(pending[0])
            except LoadFailed as exc:
                answers.append(str(exc))
                continue
            if not self._have(adapter.name):
                return  # loaded, but the node is not taking requests now: the forwarder says so
        self._grow(adapter, have)

    def _failure(self, adapter: Adapter, answers: list[str]) -> Exception:
        if not answers and not self._pool.serving(adapter.base):  # its base model is served nowhere: unknown
            served = self._pool.models()
            known = ", ".join(sorted({*served, *(a.name for a in self.listed(served))})) or "none"
            return ModelNotFound(f"The model `{adapter.name}` does not exist. Known models: {known}.", param="model")
        if answers:
            return UpstreamFailed(
                f"LoRA adapter {adapter.name!r} could not be loaded on a node of {adapter.base!r}: "
                + "; ".join(answers)
            )
        return NoNodeAvailable(
            f"no node of base model {adapter.base!r} is available to load LoRA adapter {adapter.name!r}; retry shortly"
        )

    def _grow(self, adapter: Adapter, have: list[NodeState]) -> None:
        if any(name == adapter.name for _, name in self._loads):
            return
        if not all(s.node_waiting for s in have):
            return  # some node of the adapter does not queue: it copes
        targets = self._targets(adapter)
        if targets and min(node_load(s) for s in have) >= node_load(targets[0]) + OUTGROW_SLACK:
            log.info("adapter outgrows its nodes name=%s nodes=%d", adapter.name, len(have))
            self._start(targets[0], adapter)

    async def reload(self, state: NodeState, adapter: Adapter) -> None:
        """The node answered 404 for the adapter: it no longer has it. Load it there again (or elsewhere)."""
        self._pool.set_adapter_loaded(state, adapter.name, False)
        if self._pool.get(state.entry_key) is state and not self._held(state, adapter.name):
            task = self._loads.get((state.entry_key, adapter.name)) or self._start(state, adapter)
            try:
                await asyncio.shield(task)
                return
            except LoadFailed:
                pass
        await self.ensure(adapter)

    def _start(self, state: NodeState, adapter: Adapter) -> asyncio.Task[None]:
        key = (state.entry_key, adapter.name)
        task = self._loads[key] = asyncio.create_task(self._load(state, adapter), name=f"load-lora-{adapter.name}")

        def done(finished: asyncio.Task[None]) -> None:
            self._loads.pop(key, None)
            if not finished.cancelled():
                finished.exception()  # a background load's failure is logged, not raised to nobody

        task.add_done_callback(done)
        return task

    async def _load(self, state: NodeState, adapter: Adapter) -> None:
        node = state.node
        body = {"lora_name": adapter.name, "lora_path": adapter.path}
        log.info("loading adapter name=%s node=%s", adapter.name, node.node_id)
        try:
            response = await self._client.post(
                f"{node.url}/v1/load_lora_adapter", json=body, headers=self._headers, timeout=LOAD_TIMEOUT
            )
        except httpx.HTTPError as exc:
            self._fail(state, adapter, f"{type(exc).__name__}")
        already = response.status_code == 400 and "has already been loaded" in response.text
        if response.status_code != 200 and not already:
            hint = (
                " (is VLLM_ALLOW_RUNTIME_LORA_UPDATING set on it?)"
                if response.status_code == 404 and "detail" in response.text
                else ""
            )
            self._fail(state, adapter, f"{response.status_code} {_message(response)}{hint}")
        log.info("adapter loaded name=%s node=%s already=%s", adapter.name, node.node_id, already)
        self._metrics.adapter_loads.labels(adapter.name, "already" if already else "loaded").inc()
        self._failed.pop((state.entry_key, adapter.name), None)
        self._pool.set_adapter_loaded(state, adapter.name, True)

    def _fail(self, state: NodeState, adapter: Adapter, answer: str) -> NoReturn:
        self._failed[(state.entry_key, adapter.name)] = time.monotonic() + FAILED_HOLD
        self._metrics.adapter_loads.labels(adapter.name, "failed").inc()
        log.warning("adapter load failed name=%s node=%s answer=%s", adapter.name, state.node.node_id, answer)
        raise LoadFailed(f"node {state.node.node_id} answered {answer}")

    def close(self) -> None:
        for task in list(self._loads.values()):
            task.cancel()


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        text = error.get("message") if isinstance(error, dict) else response.text
    except (ValueError, AttributeError):
        text = response.text
    return str(text)[:300]


Opener = Callable[[], Awaitable[Upstream | ErrorAnswer]]


async def with_adapter(loader: AdapterLoader, adapter: Adapter, open_leg: Opener) -> Upstream | ErrorAnswer:
    """Run one leg for ``adapter``: loaded first where needed, retried once after a node that lost it."""
    await loader.ensure(adapter)
    answer = await open_leg()
    if isinstance(answer, Upstream) and answer.status == 404:
        answer.close("ok")
        await loader.reload(answer.state, adapter)
        answer = await open_leg()
    return answer
