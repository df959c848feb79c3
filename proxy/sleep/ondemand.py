"""Wake on demand (``--wake-on-demand``): a request whose model has no node awake but some asleep waits in this
replica while exactly one node of the model is woken, fleet-wide.

The replica that takes the ``wake/{model}`` claim (discovery/claims.py: an etcd transaction, under a lease) wakes
one of the model's sleeping mixed or decode nodes, in an order every replica agrees on; a node that fails to wake
is held back for ``FAILED_HOLD`` seconds and the next one tried. Replicas that find the claim taken wait for the
node to become routable (its sleep mark cleared, or its /metrics saying it is awake) or for the claim to go (its
holder gave up or died: they try in turn). Requests are served as soon as a node is routable; after
``--wake-timeout`` they get 503 with ``Retry-After`` (``code: wake_timeout``), and at once when no node of the
model could be woken (for ``HOPELESS_HOLD`` seconds). A client that leaves stops waiting. Waking a decode node
of a disaggregated model also wakes one of its prefill nodes when none is awake, without the requests waiting
for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import orjson
from starlette.types import Message, Receive

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.claims import CLAIM_TTL, Claim, Claims
from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ClientLeft, NoNodeAvailable, WakeTimeout
from vllm_etcd_proxy.proxy.routing.balancer import _stable_hash
from vllm_etcd_proxy.proxy.sleep.metrics import SleepMetrics
from vllm_etcd_proxy.proxy.sleep.waker import Waker, woke

log = logging.getLogger(__name__)

SERVING_ROLES = (Role.MIXED, Role.BOTH, Role.DECODE)
"""Roles of nodes that serve a request alone: waking one of them makes the model servable."""
FAILED_HOLD = 30.0
"""Seconds a node that failed to wake is not tried again by this replica."""
HOPELESS_HOLD = 5.0
"""Seconds requests for a model none of whose nodes could be woken get 503 at once."""
MAX_WAITING = 1024
"""Requests of one model that may wait for its wake in a replica; more get 503 at once."""


class WakeOnDemand:
    """The request path's one call: ``ready(model, receive)`` returns once the model has a node to route to."""

    def __init__(
        self,
        pool: Pool,
        waker: Waker,
        claims: Claims,
        metrics: SleepMetrics,
        *,
        timeout: float,
        base_of: Callable[[str], str],
        me: str,
    ) -> None:
        self._pool, self._waker, self._claims, self._metrics = pool, waker, claims, metrics
        self._timeout = timeout
        self._base_of = base_of
        self._me = me
        self._waiting: dict[str, int] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, float] = {}
        self._hopeless: dict[str, float] = {}
        pool.on_node(self._node_changed)
        pool.on_load(self._node_changed)
        claims.listen("wake", self._claim_changed)

    async def ready(self, model: str | None, receive: Receive) -> None:
        """Return when ``model`` (a LoRA adapter: its base) has a node awake, or has none asleep either (routing
        then answers as without this); raises ``WakeTimeout``, ``NoNodeAvailable`` or ``ClientLeft``."""
        if model is None:
            return
        base = self._base_of(model)
        if self._awake(base) or not self._sleepers(base):
            return
        await self._wait(base, receive)

    def _awake(self, model: str) -> bool:
        return any(self._pool.available(role, model) for role in SERVING_ROLES)

    def _sleepers(self, model: str) -> list[NodeState]:
        """The model's sleeping nodes a wake would make it servable with, in the order every replica tries them."""
        now = time.monotonic()
        nodes = [
            s
            for s in self._pool.sleeping(model)
            if s.node.role in SERVING_ROLES and self._failed.get(s.entry_key, 0.0) <= now
        ]
        return sorted(nodes, key=lambda s: (s.node.role is not Role.MIXED, _stable_hash(f"{model}#{s.node.node_id}")))

    async def _wait(self, model: str, receive: Receive) -> None:
        metrics, started = self._metrics, time.monotonic()
        if self._waiting.get(model, 0) >= MAX_WAITING:
            metrics.child(metrics.waited, model, "full").inc()
            raise WakeTimeout(f"{MAX_WAITING} requests already wait for a node of model {model!r} to wake; retry")
        self._waiting[model] = self._waiting.get(model, 0) + 1
        outcome = "served"
        try:
            async with asyncio.timeout(self._timeout):
                await self._until_awake(model, receive)
        except TimeoutError:
            outcome = "timeout"
            raise WakeTimeout(
                f"no node of model {model!r} woke within {self._timeout:g}s; retry shortly",
                retry_after=max(1, math.ceil(self._timeout / 4)),
            ) from None
        except NoNodeAvailable:
            outcome = "failed"
            raise
        except ClientLeft:
            outcome = "left"
            raise
        finally:
            self._leave(model)
            metrics.child(metrics.waited, model, outcome).inc()
            metrics.child(metrics.wait_seconds, model).observe(time.monotonic() - started)

    async def _until_awake(self, model: str, receive: Receive) -> None:
        left = asyncio.ensure_future(receive())
        try:
            while True:
                changed = self._event(model)
                if self._awake(model):
                    return
                if self._hopeless.get(model, 0.0) > time.monotonic():
                    raise NoNodeAvailable(f"no sleeping node of model {model!r} could be woken; retry shortly")
                self._start(model)
                await _first(changed, left)
                if left.done():
                    if left.result().get("type") in ("http.disconnect", "websocket.disconnect"):
                        raise ClientLeft("the client left while its request waited for a node to wake")
                    left = asyncio.ensure_future(receive())
        finally:
            left.cancel()

    def _leave(self, model: str) -> None:
        count = self._waiting.get(model, 0) - 1
        if count > 0:
            self._waiting[model] = count
            return
        self._waiting.pop(model, None)
        self._changed.pop(model, None)

    def _event(self, model: str) -> asyncio.Event:
        event = self._changed.get(model)
        if event is None:
            event = self._changed[model] = asyncio.Event()
        return event

    def _fire(self, model: str) -> None:
        event = self._changed.pop(model, None)
        if event is not None:
            event.set()  # its waiters look again, and wait on a new event
            if model in self._waiting:
                self._changed[model] = asyncio.Event()

    def _node_changed(self, state: NodeState) -> None:
        if self._waiting:
            for model in state.models:
                if model in self._waiting:
                    self._fire(model)

    def _claim_changed(self, model: str, value: bytes | None) -> None:
        """A ``wake/`` claim was taken, published or released: a node its holder woke is awake here too (the
        nodes it has no mark for would otherwise wait for their next scrape)."""
        node_id = _woken(value)
        if node_id is not None:
            for state in self._pool.sleeping(model):
                if state.node.node_id == node_id:
                    self._pool.set_asleep(state, False)
        if model in self._waiting:
            self._fire(model)

    # -- this replica's part: take the claim, wake one node ----------------------------------------------------

    def _start(self, model: str) -> None:
        task = self._tasks.get(model)
        if task is None or task.done():
            task = self._tasks[model] = asyncio.create_task(self._wake_model(model), name=f"wake {model}")
            task.add_done_callback(lambda t: self._ended(model, t))

    def _ended(self, model: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(model) is task:
            del self._tasks[model]
        if not task.cancelled() and task.exception() is not None:
            log.error("wake of model=%s failed", model, exc_info=task.exception())
        self._fire(model)

    async def _wake_model(self, model: str) -> None:
        """While requests wait and no node is awake: wake one (holding the claim), or wait for whoever holds it."""
        while model in self._waiting and not self._awake(model):
            claim = await self._claims.take(f"wake/{model}", orjson.dumps({"by": self._me}))
            if claim is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._event(model).wait(), CLAIM_TTL)
                continue
            try:
                if self._awake(model):
                    return  # woken by the replica that held the claim before us
                if not await self._wake_one(model, claim):
                    self._hopeless[model] = time.monotonic() + HOPELESS_HOLD
                    log.warning("no sleeping node of model=%s could be woken", model)
                    return
            finally:
                await claim.release()

    async def _wake_one(self, model: str, claim: Claim) -> bool:
        for state in self._sleepers(model):
            if woke(await self._waker.wake(state, reason="demand")):
                await claim.publish(orjson.dumps({"by": self._me, "woke": state.node.node_id}))
                self._fire(model)  # its waiters go on now (the pool may not have told of the node yet)
                if state.node.role is Role.DECODE:
                    await self._wake_prefill(model)
                return True
            self._failed[state.entry_key] = time.monotonic() + FAILED_HOLD
        return False

    async def _wake_prefill(self, model: str) -> None:
        """A disaggregated model's decode node woke: one of its prefill nodes too, when none is awake."""
        if self._pool.available(Role.PREFILL, model):
            return
        for state in self._pool.sleeping(model):
            if state.node.role is Role.PREFILL and woke(await self._waker.wake(state, reason="demand")):
                return

    def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()


async def _first(changed: asyncio.Event, left: asyncio.Future[Message]) -> None:
    """Wait until ``changed`` is set or the client's next message (``left``) came."""
    waiter = asyncio.ensure_future(changed.wait())
    try:
        await asyncio.wait((waiter, left), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _woken(value: bytes | None) -> str | None:
    """The node a ``wake/`` claim's holder says it woke, if it says so."""
    try:
        node_id = orjson.loads(value).get("woke") if value else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return node_id if isinstance(node_id, str) else None
