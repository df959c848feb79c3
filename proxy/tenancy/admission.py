"""The request path's door to tenancy: ``Tenancy.admit`` applies the key's limits and the queue, and the
``Ticket`` it returns ends the request (tokens charged, the queue's next turn given)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from starlette.types import Message, Receive, Send

from vllm_etcd_proxy.proxy.errors import ClientLeft, ProxyError, QueueTimeout
from vllm_etcd_proxy.proxy.tenancy.holdings import Holding, TenantCounters
from vllm_etcd_proxy.proxy.tenancy.keys import KeySet, Limits
from vllm_etcd_proxy.proxy.tenancy.lending import Giver, hand_on, settle_with, take_from
from vllm_etcd_proxy.proxy.tenancy.limits import Grant, Shortfall, attempt, estimate_tokens
from vllm_etcd_proxy.proxy.tenancy.metrics import OPEN, TenantMetrics
from vllm_etcd_proxy.proxy.tenancy.queue import FairQueue
from vllm_etcd_proxy.proxy.tenancy.record import Record
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet

log = logging.getLogger(__name__)

HOLD_MAX = 3.0
"""Seconds a request may wait for capacity that another replica's record says it could hand over (a record is
put within a second of a change, and a hand-over takes two)."""
TICK = 0.25


class Relayed(Protocol):
    """What the relay saw of an answer (serving's ``Tally``)."""

    streamed: bool
    chunks: int


_KINDS = {"requests": "rpm", "tokens": "tpm", "concurrency": "concurrency"}


class Ticket:
    """One request's claim on its tenant, from before its body is read to its end: ``wrap`` adds the
    ``x-ratelimit-*`` headers, ``estimated`` puts the body's token estimate in place of the headers', ``routed``
    says it reached the queue (a request refused before it gives back its part of the rate limits), ``finish``
    ends it (once)."""

    __slots__ = ("_tenancy", "grant", "limits", "model", "tenant", "_prompt_estimate", "_routed", "_done")

    def __init__(self, tenancy: Tenancy, grant: Grant | None, limits: Limits | None, prompt_estimate: int) -> None:
        self._tenancy = tenancy
        self.grant = grant
        self.limits = limits
        self.tenant = limits.tenant if limits is not None else OPEN
        self.model: str | None = None
        """The model whose queue it entered (its turn is given on when it ends)."""
        self._prompt_estimate = prompt_estimate
        self._routed = False
        self._done = False

    def wrap(self, send: Send) -> Send:
        if self.grant is None or not self.grant.headers:
            return send
        extra = self.grant.headers

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return with_headers

    def estimated(self, raw_length: int, body: dict[str, Any] | None) -> None:
        """The body was read: its estimate of the request's tokens replaces the one made from its length."""
        self._prompt_estimate = raw_length // 4
        if self.grant is not None and self.grant.limits.tpm:
            self.grant.reserve(estimate_tokens(raw_length, body))

    def routed(self) -> None:
        self._routed = True

    def finish(
        self, status: int, prompt: int | None = None, completion: int | None = None, tally: Relayed | None = None
    ) -> None:
        """The request ended with ``status``; ``prompt``/``completion``: its answer's ``usage`` where it had one,
        ``tally``: what the relay saw of it."""
        if self._done:
            return
        self._done = True
        tokens: int | None = 0
        if status == 499 and self._routed:
            tokens = None  # the client left mid-way: what the node spent is unknown, the estimate stands
        elif 200 <= status < 300:
            if completion is None and tally is not None and tally.streamed:
                completion = tally.chunks  # vLLM sends about one token per event
            if prompt is None:
                prompt = self._prompt_estimate
            tokens = prompt + (completion or 0)
        if self.grant is not None:
            self.grant.finish(tokens, refund=not self._routed)
        tenancy = self._tenancy
        if tokens:
            tenancy.metrics.child(tenancy.metrics.tokens, self.tenant).inc(tokens)
        if self.model is not None and tenancy.queue is not None:
            tenancy.queue.leave(self.model)


class Tenancy:
    """Limits per tenant (held with the other replicas) and the fair queue; built once in the app. Wired to the
    replicas' view: a record that changes may hand capacity to this replica, acknowledge what it handed on, or
    want what it holds (lending.py); ``run`` looks again every ``TICK`` s (a holding that went idle, one to drop)."""

    def __init__(self, keys: KeySet, fleet: Fleet, queue: FairQueue | None, metrics: TenantMetrics) -> None:
        self.keys = keys
        self.fleet = fleet
        self.queue = queue
        self.metrics = metrics
        self._counters: dict[str, TenantCounters] = {}
        self._version = keys.version
        self._seq = itertools.count(1)
        self._change = asyncio.Event()
        fleet.view.on_change = self.view_changed

    def share(self, tenant: str) -> int:
        """A tenant's weight in the queue."""
        limits = self.keys.tenants().get(tenant)
        return limits.share if limits is not None else 1

    @property
    def counters(self) -> Mapping[str, TenantCounters]:
        """The tenants seen on this replica (that the key set still names), by name."""
        return self._counters

    def holds(self, tenant: str, kind: str, limit: int) -> float:
        """What this replica holds of a tenant's limit now (its even part of what nobody holds, until it uses it)."""
        now = self.fleet.view.clock()
        counters = self._counters.get(tenant)
        holding = counters.holdings.get(kind) if counters is not None else None
        if holding is None or not holding.explicit:
            return self.fleet.unheld_share(tenant, kind, limit, now)
        return holding.effective(self.fleet, limit, now)

    def asking(self, tenant: str, kind: str) -> float:
        counters = self._counters.get(tenant)
        return counters.asking(kind, self.fleet.view.clock()) if counters is not None else 0.0

    def reports(self) -> Record:
        """What this replica publishes about its tenants (replicas.py): every limit it holds explicitly."""
        now, named = self.fleet.view.clock(), self.keys.tenants()
        out: Record = {}
        for tenant, counters in self._counters.items():
            limits = named.get(tenant)
            if limits is not None and limits.limited and (entries := counters.report(limits, now)):
                out[tenant] = entries
        return out

    def _counters_of(self, tenant: str) -> TenantCounters:
        if self._version != self.keys.version:
            # The set changed: forget tenants it no longer names (their requests in flight keep their counters).
            self._version = self.keys.version
            named = self.keys.tenants()
            self._counters = {t: c for t, c in self._counters.items() if t in named}
        counters = self._counters.get(tenant)
        if counters is None:
            counters = self._counters[tenant] = TenantCounters()
        return counters

    async def admit_limits(self, limits: Limits | None, declared: int | None, receive: Receive | None = None) -> Ticket:
        """The key's limits (before the body is read, tpm on an estimate from the declared length). Raises
        ``RateLimited``, or ``ClientLeft`` when the client left while its request waited (watched through
        ``receive`` only when given: before the body is read, its next message is the body)."""
        grant = None
        if limits is not None and limits.limited:
            grant = await self._admit_limited(limits, estimate_tokens(declared or 0, None), receive)
        return Ticket(self, grant, limits, (declared or 0) // 4)

    async def queue_turn(
        self, ticket: Ticket, model: str | None, body: dict[str, Any] | None, raw_length: int, receive: Receive
    ) -> None:
        """After the body was read and a flow picked: the tokens estimated from the body, then the fair queue.
        Raises ``QueueTimeout``, or ``ClientLeft`` (gone while queued)."""
        ticket.estimated(raw_length, body)
        ticket.routed()
        if self.queue is not None and model is not None:
            await self._wait_turn(self.queue, model, ticket.tenant, _priority(ticket.limits, body), receive)
            ticket.model = model
        self.metrics.child(self.metrics.requests, ticket.tenant).inc()

    async def admit(
        self,
        limits: Limits | None,
        model: str | None,
        body: dict[str, Any] | None,
        raw_length: int,
        receive: Receive,
        send: Send,
    ) -> tuple[Ticket, Send]:
        """``admit_limits`` and ``queue_turn`` at once, for a request whose body is read; its ticket, and ``send``
        with the ``x-ratelimit-*`` headers added when the key has limits. A request refused is finished."""
        ticket = await self.admit_limits(limits, raw_length, receive)
        try:
            await self.queue_turn(ticket, model, body, raw_length, receive)
        except ProxyError as exc:
            ticket.finish(exc.status)
            raise
        return ticket, ticket.wrap(send)

    async def _admit_limited(self, limits: Limits, estimate: int, receive: Receive | None) -> Grant:
        """The key's limits applied: admitted on what this replica holds, or after waiting (up to ``HOLD_MAX`` s)
        for what another replica's record says it could hand over; else ``RateLimited``."""
        counters, fleet, metrics = self._counters_of(limits.tenant), self.fleet, self.metrics
        now = fleet.view.clock()
        counters.ask(limits, estimate, now)
        explicit = counters.explicit()
        outcome = attempt(counters, limits, fleet, estimate, now)
        if counters.explicit() != explicit:
            fleet.wake.set()  # the record has the tenant now
        deadline, waited = now + HOLD_MAX, False
        left: asyncio.Future[Message] | None = None
        try:
            while not isinstance(outcome, Grant):
                if not outcome.waitable or now >= deadline:
                    refusal = outcome.refusal(now)
                    metrics.child(metrics.rejections, limits.tenant, _KINDS.get(refusal.type, refusal.type)).inc()
                    if waited:
                        metrics.child(metrics.held, limits.tenant, "refused").inc()
                    raise refusal
                waited = True
                left = await self._wait(outcome, receive, left, deadline - now)
                now = fleet.view.clock()
                outcome = attempt(counters, limits, fleet, estimate, now)
        finally:
            if left is not None:
                left.cancel()
        outcome.on_end = self._notify
        if waited:
            metrics.child(metrics.held, limits.tenant, "admitted").inc()
        return outcome

    async def _wait(
        self, short: Shortfall, receive: Receive | None, left: asyncio.Future[Message] | None, timeout: float
    ) -> asyncio.Future[Message] | None:
        """One wait of a request for capacity: what it wants in the record until the replicas' view or a holding
        changes, or ``timeout``. Raises ``ClientLeft`` when the client disconnected meanwhile."""
        short.wait(+1)
        self.fleet.wake.set()
        change = asyncio.ensure_future(self._change.wait())
        try:
            if receive is not None and left is None:
                left = asyncio.ensure_future(receive())
            waiting: set[asyncio.Future[Any]] = {change} if left is None else {change, left}
            await asyncio.wait(waiting, timeout=max(0.0, timeout), return_when=asyncio.FIRST_COMPLETED)
        finally:
            change.cancel()
            short.wait(-1)
        if left is not None and left.done():
            if left.result().get("type") == "http.disconnect":
                raise ClientLeft("the client left while its request waited for its tenant's limit")
            left = None
        return left

    def _notify(self) -> None:
        """Wake the requests waiting for capacity: something they wait for may have changed."""
        self._change.set()
        self._change = asyncio.Event()

    # The replicas' records (lending.py)

    def _holding_for(self, tenant: str, kind: str, now: float) -> Holding | None:
        """This replica's holding of a limit the key set has, ready to take or hand on; None for one it has not."""
        limits = self.keys.tenants().get(tenant)
        limit = getattr(limits, kind) if limits is not None else 0
        if not limit:
            return None
        holding = self._counters_of(tenant).holding(kind)
        holding.prepare(self.fleet, tenant, limit, now)
        return holding

    def _hand_on(self, tenant: str, kind: str, now: float) -> bool:
        limits = self.keys.tenants().get(tenant)
        limit = getattr(limits, kind) if limits is not None else 0
        if not limit:
            return False
        counters = self._counters_of(tenant)
        holding = counters.holding(kind)
        if not holding.explicit and self.fleet.unheld_share(tenant, kind, limit, now) <= 0:
            return False  # nothing to hand on: no entry needed
        before = dict(holding.out)
        why = hand_on(Giver(holding, counters, tenant, limit, self.fleet, now, lambda: next(self._seq)))
        if not why:
            return False
        for taker, transfer in holding.out.items():
            if before.get(taker) != transfer:
                self.metrics.child(self.metrics.handovers, tenant, kind, "given").inc()
                log.debug(
                    "handed over tenant=%s limit=%s to=%s cap=%.6g level=%.6g why=%s",
                    tenant,
                    kind,
                    taker,
                    transfer.cap,
                    transfer.level,
                    why,
                )
        return True

    def view_changed(self, replica: str | None) -> None:
        """``replica``'s record was put or deleted (None: the folder was listed again)."""
        fleet = self.fleet
        now = fleet.view.clock()
        if replica is None:
            replicas = set(fleet.others())
            for counters in self._counters.values():
                for holding in counters.holdings.values():
                    replicas.update(holding.out.keys() | holding.taken.keys())
        else:
            replicas = {replica}
        changed = False
        for name in sorted(replicas - {fleet.me}):
            changed |= self._exchange(name, now)
        if changed:
            fleet.wake.set()
        self._notify()

    def _exchange(self, name: str, now: float) -> bool:
        """Take what ``name``'s record hands here, settle what was acknowledged, hand on what it wants."""
        view = self.fleet.view
        if not view.seen(name):
            for tenant, kind, cap in view.bequest(name):
                holding = self._holding_for(tenant, kind, now)
                if holding is not None and name not in holding.heir_of:
                    holding.inherit(name, cap, now)
                    self.metrics.child(self.metrics.handovers, tenant, kind, "taken").inc()
            settle_with(name, self.fleet, self._counters, gone=True)
            return True
        record = view.record(name)
        taken = take_from(name, record, self.fleet.me, lambda tenant, kind: self._holding_for(tenant, kind, now))
        for tenant, kind in taken:
            self.metrics.child(self.metrics.handovers, tenant, kind, "taken").inc()
        changed = settle_with(name, self.fleet, self._counters, gone=False) or bool(taken)
        for tenant, kinds in record.items():
            for kind, entry in kinds.items():
                if entry.want > 0:
                    changed |= self._hand_on(tenant, kind, now)
        return changed

    def tick(self, now: float) -> None:
        """What changes without a record: a holding that went idle hands on what others wait for, rebalances, is
        dropped; what nobody holds goes to its heir."""
        fleet, named, changed = self.fleet, self.keys.tenants(), False
        for tenant, kind in fleet.wanted():
            changed |= self._hand_on(tenant, kind, now)
        for tenant, counters in list(self._counters.items()):
            limits = named.get(tenant)
            if limits is None:
                continue
            for kind, holding in counters.holdings.items():
                limit: int = getattr(limits, kind)
                if limit and holding.explicit and not fleet.decay(now):
                    changed |= self._hand_on(tenant, kind, now)
                    if fleet.heir(tenant, kind):
                        changed |= holding.inherit_unheld(fleet, tenant, limit, now)
            changed |= counters.settle(limits, now)
        if changed:
            fleet.wake.set()
            self._notify()

    def lost(self) -> None:
        """This replica's lease was lost: the others took back what its record held. It holds nothing (its debts
        and its requests in flight stay) until it is handed capacity again."""
        for counters in self._counters.values():
            for holding in counters.holdings.values():
                if holding.explicit:
                    holding.cap, holding.level = 0.0, min(holding.level, 0.0)
                holding.out.clear()
                holding.taken.clear()
                holding.dropped = None
        self.fleet.wake.set()

    async def run(self) -> None:
        """Look at the holdings every ``TICK`` s (a supervised background task)."""
        while True:
            await asyncio.sleep(TICK)
            self.tick(self.fleet.view.clock())

    async def _wait_turn(self, queue: FairQueue, model: str, tenant: str, priority: int, receive: Receive) -> None:
        """Wait for the request's turn in the fair queue (one that gets none is finished by its ticket)."""
        metrics = self.metrics
        started = time.monotonic()
        try:
            entered = await queue.enter(model, tenant, priority, receive)
        except QueueTimeout:
            metrics.child(metrics.rejections, tenant, "queue_timeout").inc()
            raise
        waited = time.monotonic() - started
        if not entered:
            metrics.child(metrics.queue_left, tenant).inc()
            raise ClientLeft("the client left while its request was queued")
        if waited > 0.0005:
            metrics.child(metrics.queue_wait, tenant).observe(waited)


def _priority(limits: Limits | None, body: dict[str, Any] | None) -> int:
    """The key's priority in the queue, else the body's ``priority`` (vLLM's field), else 0."""
    if limits is not None and limits.priority is not None:
        return limits.priority
    asked = body.get("priority") if body is not None else None
    return asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
