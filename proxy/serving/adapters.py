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
- One load per burst across replicas: a load is claimed in etcd (``load/{role}/{adapter}``, discovery/claims.py)
  by the replica that starts it; the others wait for its claim to say on which node the adapter now is, even
  when their own views of the nodes' loads would have picked another node.
- A node at its adapter slots (``max_lora`` of its ``vllm:lora_requests_info``) that is to load one more: its
  least recently used registered adapter (by this replica's requests) is unloaded first, never one with requests
  in flight through this replica (``POST /v1/unload_lora_adapter``).
- A disaggregated base model's adapter is loaded on a prefill node and on a decode node before the legs run
  (``ensure`` for each role's group, then the exchange among the nodes that have it).
Unregistered adapters are never loaded, and are unloaded from the nodes that list them (``UNLOAD_RETRY``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

import httpx
import orjson

from vllm_etcd_proxy.fleet.adapters import Adapter
from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.adapters import AdapterRegistry
from vllm_etcd_proxy.proxy.discovery.claims import Claims
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ModelNotFound, NoNodeAvailable, UpstreamFailed
from vllm_etcd_proxy.proxy.routing.balancer import _stable_hash, node_load, prefer_adapter
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Upstream
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger(__name__)

ROLES = (Role.MIXED, Role.DECODE)
"""Nodes adapters are loaded on: those a request that is not disaggregated goes to."""
DISAGGREGATED = ((Role.PREFILL,), (Role.DECODE,))
"""The role groups a disaggregated base model's adapter is loaded on: a prefill node and a decode node."""
LOAD_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
"""A load may fetch the adapter from a hub first."""
FAILED_HOLD = 30.0
"""Seconds a node whose load of an adapter failed is not asked to load it again."""
MAX_LOADS = 3
"""Nodes one request tries to load its adapter on before it fails."""
OUTGROW_SLACK = 4
"""Requests the adapter's least loaded node may carry beyond a node without it before it is loaded there too."""
UNLOAD_RETRY = 10.0
"""Seconds between passes over the nodes that still list an unregistered adapter."""
UNLOAD_FOR = 60.0
"""Seconds an unregistered adapter is looked for on the nodes before this replica gives up."""


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
        *,
        claims: Claims,
        me: str = "",
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._registry = registry
        self._client = client
        self._headers = headers
        self._claims = claims
        self._me = me
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._failed: dict[tuple[str, str], float] = {}
        self._used: dict[tuple[str, str], float] = {}
        """(node, adapter) -> when this replica last sent the node a request for it (least recently used first)."""
        self._in_flight: dict[tuple[str, str], int] = {}
        """(node, adapter) -> this replica's requests for it open on the node (never unloaded under them)."""
        self._sending: dict[str, int] = {}
        """Adapter -> this replica's requests for it waiting for their node's answer (a non-streamed one comes
        whole): never unloaded anywhere meanwhile."""
        self._elsewhere: dict[str, asyncio.Event] = {}
        """Per claim name: set when another replica's load says where the adapter is, or its claim goes."""
        self._unloads: dict[str, asyncio.Task[None]] = {}
        claims.listen("load", self._claim_changed)
        registry.on_unregistered(self._unregistered)

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

    def _have(self, name: str, roles: tuple[Role, ...] = ROLES) -> list[NodeState]:
        return [s for role in roles for s in self._pool.candidates(role, name)]

    def _targets(self, adapter: Adapter, roles: tuple[Role, ...] = ROLES) -> list[NodeState]:
        """Nodes of the base model that could load the adapter now, best first."""
        nodes = [
            s
            for role in roles
            for s in self._pool.candidates(role, adapter.base)
            if adapter.name not in s.models and not self._held(s, adapter.name)
        ]

        def rank(state: NodeState) -> tuple[bool, int, int]:
            full = state.max_loras is not None and len(state.lora_running) >= state.max_loras
            return full, node_load(state), -_stable_hash(f"{adapter.name}#{state.node.node_id}")  # its home first

        return sorted(nodes, key=rank)

    async def ensure(self, adapter: Adapter, roles: tuple[Role, ...] = ROLES) -> None:
        """Return once some routable node of ``roles`` has ``adapter`` (loading it if none has); raise
        ``ProxyError`` else."""
        answers: list[str] = []
        while not (have := self._have(adapter.name, roles)):
            pending = [t for (key, name), t in self._loads.items() if name == adapter.name and self._of(key, roles)]
            if not pending:
                if len(answers) >= MAX_LOADS or not (targets := self._targets(adapter, roles)):
                    raise self._failure(adapter, answers)
                pending = [self._start(targets[0], adapter, roles)]
            try:
                await asyncio.shield(pending[0])
            except LoadFailed as exc:
                answers.append(str(exc))
                continue
            if not self._have(adapter.name, roles):
                return  # loaded, but the node is not taking requests now: the forwarder says so
        self._grow(adapter, have, roles)

    def _of(self, key: str, roles: tuple[Role, ...]) -> bool:
        state = self._pool.get(key)
        return state is not None and state.node.role in roles

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

    def _grow(self, adapter: Adapter, have: list[NodeState], roles: tuple[Role, ...]) -> None:
        if any(name == adapter.name for _, name in self._loads):
            return
        if not all(s.node_waiting for s in have):
            return  # some node of the adapter does not queue: it copes
        targets = self._targets(adapter, roles)
        if targets and min(node_load(s) for s in have) >= node_load(targets[0]) + OUTGROW_SLACK:
            log.info("adapter outgrows its nodes name=%s nodes=%d", adapter.name, len(have))
            self._start(targets[0], adapter, roles)

    async def reload(self, state: NodeState, adapter: Adapter) -> None:
        """The node answered 404 for the adapter: it no longer has it. Load it there again (or elsewhere)."""
        self._pool.set_adapter_loaded(state, adapter.name, False)
        roles = (state.node.role,) if state.node.role is Role.PREFILL else ROLES
        if self._pool.get(state.entry_key) is state and not self._held(state, adapter.name):
            task = self._loads.get((state.entry_key, adapter.name)) or self._start(state, adapter, roles)
            try:
                await asyncio.shield(task)
                return
            except LoadFailed:
                pass
        await self.ensure(adapter, roles)

    def _start(self, state: NodeState, adapter: Adapter, roles: tuple[Role, ...]) -> asyncio.Task[None]:
        key = (state.entry_key, adapter.name)
        task = self._loads[key] = asyncio.create_task(
            self._claimed_load(state, adapter, roles), name=f"load-lora-{adapter.name}"
        )

        def done(finished: asyncio.Task[None]) -> None:
            self._loads.pop(key, None)
            if not finished.cancelled():
                finished.exception()  # a background load's failure is logged, not raised to nobody

        task.add_done_callback(done)
        return task

    async def _claimed_load(self, state: NodeState, adapter: Adapter, roles: tuple[Role, ...]) -> None:
        """Load ``adapter`` on ``state`` under the fleet's claim of its load; when another replica holds the claim,
        wait for it to say where the adapter is instead (``LoadFailed`` if it gave up)."""
        name = f"load/{roles[0].value}/{adapter.name}"
        # Listened for before the claim is asked for: the holder may publish and release in between.
        waiting = self._elsewhere[name] = asyncio.Event()
        try:
            claim = await self._claims.take(name, orjson.dumps({"by": self._me}))
            if claim is None:
                await self._loaded_elsewhere(waiting, adapter, roles)
                return
            try:
                if not self._have(adapter.name, roles):  # another replica's load ended just before our claim
                    await self._load(state, adapter)
                    await claim.publish(orjson.dumps({"by": self._me, "loaded": state.node.node_id}))
            finally:
                await claim.release()
        finally:
            if self._elsewhere.get(name) is waiting:
                del self._elsewhere[name]

    async def _loaded_elsewhere(self, waiting: asyncio.Event, adapter: Adapter, roles: tuple[Role, ...]) -> None:
        try:
            await asyncio.wait_for(waiting.wait(), LOAD_TIMEOUT.read)
        except TimeoutError:
            raise LoadFailed(f"another replica's load of {adapter.name!r} did not finish") from None
        if not self._have(adapter.name, roles):
            raise LoadFailed(f"another replica's load of {adapter.name!r} did not succeed")

    def _claim_changed(self, what: str, value: bytes | None) -> None:
        """Another replica's load claim (``role/adapter``) said where the adapter now is, or went."""
        group, _, name = what.partition("/")
        loaded = _loaded_on(value)
        if loaded is not None:
            roles = ROLES if group == Role.MIXED.value else tuple(r for r in Role if r.value == group)
            for state in self._pool.all():
                if state.node.node_id == loaded and state.node.role in roles:
                    self._pool.set_adapter_loaded(state, name, True)
        if loaded is not None or value is None:
            waiting = self._elsewhere.get(f"load/{what}")
            if waiting is not None:
                waiting.set()

    async def _load(self, state: NodeState, adapter: Adapter) -> None:
        await self._make_room(state, adapter)
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

    # -- adapter slots: the least recently used registered adapter makes room ---------------------------------

    def sending(self, adapter: Adapter, change: int) -> None:
        count = self._sending.get(adapter.name, 0) + change
        if count > 0:
            self._sending[adapter.name] = count
        else:
            self._sending.pop(adapter.name, None)

    def used(self, state: NodeState, adapter: Adapter) -> Callable[[], None]:
        """A request for ``adapter`` was sent to the node: it counts as recently used and in flight until the
        returned call (at the end of its answer)."""
        key = (state.entry_key, adapter.name)
        self._used[key] = time.monotonic()
        self._in_flight[key] = self._in_flight.get(key, 0) + 1

        def done() -> None:
            left = self._in_flight.get(key, 0) - 1
            if left > 0:
                self._in_flight[key] = left
            else:
                self._in_flight.pop(key, None)

        return done

    async def _make_room(self, state: NodeState, adapter: Adapter) -> None:
        """A node at its adapter slots: unload its least recently used registered adapters (none in flight here)
        until one more fits."""
        slots = state.max_loras
        held = [m for m in state.models if m != adapter.name and self._registry.get(m) is not None]
        if slots is None or len(held) < slots:
            return
        key = state.entry_key
        idle = [m for m in held if not self._in_flight.get((key, m)) and m not in self._sending]
        idle.sort(key=lambda m: self._used.get((key, m), 0.0))
        for name in idle[: len(held) - slots + 1]:
            log.info(
                "adapter slots full node=%s slots=%d: unloading the least recently used name=%s",
                state.node.node_id,
                slots,
                name,
            )
            await self._unload(state, name)

    async def _unload(self, state: NodeState, name: str) -> bool:
        """``POST /v1/unload_lora_adapter``; True when the node no longer has it (vLLM's 404 included)."""
        try:
            response = await self._client.post(
                f"{state.node.url}/v1/unload_lora_adapter",
                json={"lora_name": name},
                headers=self._headers,
                timeout=LOAD_TIMEOUT,
            )
        except httpx.HTTPError as exc:
            log.warning("adapter unload failed name=%s node=%s error=%s", name, state.node.node_id, type(exc).__name__)
            return False
        gone = response.status_code in (200, 404)
        outcome = "unloaded" if gone else "unload_failed"
        self._metrics.adapter_loads.labels(name, outcome).inc()
        log.info("adapter unload name=%s node=%s status=%d", name, state.node.node_id, response.status_code)
        if gone:
            self._pool.set_adapter_loaded(state, name, False)
            self._used.pop((state.entry_key, name), None)
        return gone

    # -- unregistered adapters leave the nodes -------------------------------------------------------------------

    def _unregistered(self, name: str) -> None:
        if name not in self._unloads:
            task = self._unloads[name] = asyncio.create_task(self._unload_everywhere(name), name=f"unload-{name}")
            task.add_done_callback(lambda _: self._unloads.pop(name, None))

    async def _unload_everywhere(self, name: str) -> None:
        """Unload an adapter no longer registered from every node that lists it, for up to ``UNLOAD_FOR`` s."""
        deadline = time.monotonic() + UNLOAD_FOR
        while time.monotonic() < deadline and self._registry.get(name) is None:
            holders = [s for s in self._pool.all() if name in s.models and s.models[0] != name]
            if not holders:
                return
            results = [await self._unload(state, name) for state in holders]
            if all(results):
                return
            await asyncio.sleep(UNLOAD_RETRY)

    def close(self) -> None:
        for task in [*self._loads.values(), *self._unloads.values()]:
            task.cancel()


def _message(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
        text = error.get("message") if isinstance(error, dict) else response.text
    except (ValueError, AttributeError):
        text = response.text
    return str(text)[:300]


Opener = Callable[[], Awaitable[Upstream | ErrorAnswer]]


async def with_adapter(
    loader: AdapterLoader, adapter: Adapter, open_leg: Opener, groups: tuple[tuple[Role, ...], ...] = (ROLES,)
) -> Upstream | ErrorAnswer:
    """Run a request for ``adapter``: loaded first where needed (on a node of each role group its legs use),
    retried once after a node that lost it; the node's answer counts the adapter in flight there until it ends."""
    for roles in groups:
        await loader.ensure(adapter, roles)
    loader.sending(adapter, +1)  # its node is chosen in the forwarder: until then the adapter is in flight anywhere
    try:
        answer = await open_leg()
        if isinstance(answer, Upstream) and answer.status == 404:
            answer.close("ok")
            await loader.reload(answer.state, adapter)
            answer = await open_leg()
        if isinstance(answer, Upstream):
            answer.after = loader.used(answer.state, adapter)
    finally:
        loader.sending(adapter, -1)
    return answer


def _loaded_on(value: bytes | None) -> str | None:
    """The node a load claim says the adapter was loaded on, if it says so."""
    try:
        node_id = orjson.loads(value).get("loaded") if value else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return node_id if isinstance(node_id, str) else None
