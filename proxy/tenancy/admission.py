"""The request path's door to tenancy: ``Tenancy.admit`` applies the key's limits and the queue, and the
``Ticket`` it returns ends the request (tokens charged, the queue's next turn given)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from starlette.types import Message, Receive, Send

from vllm_etcd_proxy.proxy.errors import ClientLeft, QueueTimeout, RateLimited
from vllm_etcd_proxy.proxy.tenancy.demand import TenantReport
from vllm_etcd_proxy.proxy.tenancy.keys import KeySet, Limits
from vllm_etcd_proxy.proxy.tenancy.limits import Grant, TenantCounters, admit, estimate_tokens
from vllm_etcd_proxy.proxy.tenancy.metrics import OPEN, TenantMetrics
from vllm_etcd_proxy.proxy.tenancy.queue import FairQueue
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet


class Relayed(Protocol):
    """What the relay saw of an answer (serving's ``Tally``)."""

    streamed: bool
    chunks: int


_KINDS = {"requests": "rpm", "tokens": "tpm", "concurrency": "concurrency"}


class Ticket:
    """One admitted request: ``wrap`` adds the ``x-ratelimit-*`` headers, ``finish`` ends it (once)."""

    __slots__ = ("_tenancy", "_grant", "_model", "_tenant", "_prompt_estimate", "_done")

    def __init__(
        self, tenancy: Tenancy, grant: Grant | None, model: str | None, tenant: str, prompt_estimate: int
    ) -> None:
        self._tenancy = tenancy
        self._grant = grant
        self._model = model
        self._tenant = tenant
        self._prompt_estimate = prompt_estimate
        self._done = False

    def wrap(self, send: Send) -> Send:
        if self._grant is None or not self._grant.headers:
            return send
        extra = self._grant.headers

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return with_headers

    def finish(
        self, status: int, prompt: int | None = None, completion: int | None = None, tally: Relayed | None = None
    ) -> None:
        """The request ended with ``status``; ``prompt``/``completion``: its answer's ``usage`` where it had one,
        ``tally``: what the relay saw of it."""
        if self._done:
            return
        self._done = True
        tokens: int | None = 0
        if status == 499:
            tokens = None  # the client left mid-way: what the node spent is unknown, the estimate stands
        elif 200 <= status < 300:
            if completion is None and tally is not None and tally.streamed:
                completion = tally.chunks  # vLLM sends about one token per event
            if prompt is None:
                prompt = self._prompt_estimate
            tokens = prompt + (completion or 0)
        if self._grant is not None:
            self._grant.finish(tokens)
        tenancy = self._tenancy
        if tokens:
            tenancy.metrics.child(tenancy.metrics.tokens, self._tenant).inc(tokens)
        if self._model is not None and tenancy.queue is not None:
            tenancy.queue.leave(self._model)


class Tenancy:
    """Limits per tenant (shared with the other replicas) and the fair queue; built once in the app."""

    def __init__(self, keys: KeySet, fleet: Fleet, queue: FairQueue | None, metrics: TenantMetrics) -> None:
        self.keys = keys
        self.fleet = fleet
        self.queue = queue
        self.metrics = metrics
        self._counters: dict[str, TenantCounters] = {}
        self._version = keys.version

    def share(self, tenant: str) -> int:
        """A tenant's weight in the queue."""
        limits = self.keys.tenants().get(tenant)
        return limits.share if limits is not None else 1

    @property
    def counters(self) -> Mapping[str, TenantCounters]:
        """The tenants seen on this replica (that the key set still names), by name."""
        return self._counters

    def reports(self) -> dict[str, TenantReport]:
        """What this replica publishes about its tenants (replicas.py): those that asked something lately."""
        now, named = time.monotonic(), self.keys.tenants()
        out = {}
        for tenant, counters in self._counters.items():
            limits = named.get(tenant)
            if limits is not None and limits.limited and (report := counters.report(limits, now)) is not None:
                out[tenant] = report
        return out

    def admit_session(self, limits: Limits | None) -> Ticket | None:
        """A WebSocket session holds one of its tenant's concurrency slots while it lasts (``RateLimited`` when
        none is free); None when its key has no concurrency limit."""
        if limits is None or not limits.concurrency:
            return None
        try:
            grant = admit(self._counters_of(limits.tenant), limits, self.fleet, 0, session=True)
        except RateLimited:
            self.metrics.child(self.metrics.rejections, limits.tenant, "concurrency").inc()
            raise
        return Ticket(self, grant, None, limits.tenant, 0)

    def _counters_of(self, tenant: str) -> TenantCounters:
        if self._version != self.keys.version:
            # The set changed: forget tenants it no longer names (their requests in flight keep their counters).
            self._version = self.keys.version
            named = self.keys.tenants()
            self._counters = {t: c for t, c in self._counters.items() if t in named}
            self.fleet.keep_only(named)
        counters = self._counters.get(tenant)
        if counters is None:
            counters = self._counters[tenant] = TenantCounters()
        return counters

    async def admit(
        self,
        limits: Limits | None,
        model: str | None,
        body: dict[str, Any] | None,
        raw_length: int,
        receive: Receive,
        send: Send,
    ) -> tuple[Ticket, Send]:
        """Admit the request or raise ``RateLimited``, ``QueueTimeout``, or ``ClientLeft`` (gone while queued);
        returns its ticket, and ``send`` with the ``x-ratelimit-*`` headers added when the key has limits."""
        tenant = limits.tenant if limits is not None else OPEN
        grant = self._grant(limits, tenant, estimate_tokens(raw_length, body))
        if self.queue is not None and model is not None:
            await self._wait_turn(self.queue, model, tenant, _priority(limits, body), grant, receive)
        self.metrics.child(self.metrics.requests, tenant).inc()
        ticket = Ticket(self, grant, model, tenant, raw_length // 4)
        return ticket, ticket.wrap(send)

    def _grant(self, limits: Limits | None, tenant: str, estimate: int) -> Grant | None:
        """The key's limits applied (None: it has none); a request over one is counted and ``RateLimited``."""
        if limits is None or not limits.limited:
            return None
        try:
            return admit(self._counters_of(tenant), limits, self.fleet, estimate)
        except RateLimited as exc:
            self.metrics.child(self.metrics.rejections, tenant, _KINDS.get(exc.type, exc.type)).inc()
            raise

    async def _wait_turn(
        self, queue: FairQueue, model: str, tenant: str, priority: int, grant: Grant | None, receive: Receive
    ) -> None:
        """Wait for the request's turn in the fair queue; one that gets none gives its grant back."""
        metrics = self.metrics
        started = time.monotonic()
        try:
            entered = await queue.enter(model, tenant, priority, receive)
        except QueueTimeout:
            metrics.child(metrics.rejections, tenant, "queue_timeout").inc()
            _give_back(grant)
            raise
        except BaseException:
            _give_back(grant)
            raise
        waited = time.monotonic() - started
        if not entered:
            metrics.child(metrics.queue_left, tenant).inc()
            _give_back(grant)
            raise ClientLeft("the client left while its request was queued")
        if waited > 0.0005:
            metrics.child(metrics.queue_wait, tenant).observe(waited)


def _priority(limits: Limits | None, body: dict[str, Any] | None) -> int:
    """The key's priority in the queue, else the body's ``priority`` (vLLM's field), else 0."""
    if limits is not None and limits.priority is not None:
        return limits.priority
    asked = body.get("priority") if body is not None else None
    return asked if isinstance(asked, int) and not isinstance(asked, bool) else 0


def _give_back(grant: Grant | None) -> None:
    """A request that was not sent costs no tokens (its concurrency slot is freed)."""
    if grant is not None:
        grant.finish(0)
