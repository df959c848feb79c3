"""Each tenant's limits split among the live replicas in proportion to what it asked of each lately (Doorman's
idea: capacity apportioned by the clients' reported wants), computed by every replica alike from the records all
of them publish (demand.py, replicas.py), so that no counter is shared per request.

With R replicas whose records say the tenant asked d_j of replica j (D their sum), replica i's share of a
per-minute limit L is::

    share_i = L * d_i / D          when d_i > 0
    share_i = L * FLOOR / R        when d_i = 0 (a floor)
    share_i = L / R                when D = 0 (nobody asked anything lately)

The floor lets a replica that starts seeing the tenant admit its first requests before its demand is published
(within a second); the shares sum to at most L * (1 + FLOOR * (R - 1) / R). A concurrency limit C is split the
same way, each share rounded up, with a floor of one request: the shares sum to at most C + R - 1.

When etcd is away (the lease not refreshed, or the watch down), the records a replica sees are frozen: its
shares stay the ones it computed last for ``grace`` seconds, then decay linearly to L / R over ``decay`` seconds,
finishing before the others can have expired its key and taken its part (setup.py derives both from the TTL).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vllm_etcd_proxy.proxy.tenancy.replicas import ReplicaView

FLOOR = 0.05
KINDS = ("rpm", "tpm", "concurrency")


def apportion(limit: float, demands: Mapping[str, float], count: int, floor: float) -> dict[str, float]:
    """The share of ``limit`` of each replica of ``demands`` (by replica, in the order every replica agrees on),
    out of ``count`` replicas (those not in ``demands`` asked nothing); ``floor``: the share of one that asked
    nothing while others did."""
    total = math.fsum(demands.values())
    if total <= 0:
        return {replica: limit / count for replica in demands}
    return {replica: limit * demand / total if demand > 0 else floor for replica, demand in demands.items()}


def floor_of(kind: str, limit: float, count: int) -> float:
    """A replica's share while the tenant asks only others: a small part of a rate, one request in flight."""
    return 1.0 if kind == "concurrency" else limit * FLOOR / count


@dataclass(frozen=True, slots=True)
class _Cached:
    version: int
    limit: int
    decay: float
    split: dict[str, float]


class Fleet:
    """This replica's view of how the tenants' limits are split: the replicas and their records (``view``), and
    whether that view is fresh. ``wake`` is set when a tenant this replica did not publish yet asks something."""

    def __init__(
        self, view: ReplicaView, *, grace: float, decay: float, watching: Callable[[], bool] = lambda: True
    ) -> None:
        self.view = view
        self.wake = asyncio.Event()
        self._grace, self._decay = grace, decay
        self._watching = watching
        self._contact: float | None = None
        self._cache: dict[tuple[str, str], _Cached] = {}

    @property
    def me(self) -> str:
        return self.view.me

    @property
    def count(self) -> int:
        return self.view.count

    def refreshed(self) -> None:
        """The replica's lease was refreshed: etcd is there, and if the watch is up the view is fresh."""
        if self._watching():
            self._contact = time.monotonic()

    def decay(self, now: float) -> float:
        """0 while the view is fresh, rising to 1 as the shares decay to limit / R when etcd is away."""
        if self._contact is None:
            return 0.0
        return min(1.0, max(0.0, (now - self._contact - self._grace) / self._decay))

    def split(self, tenant: str, kind: str, limit: int, now: float) -> dict[str, float]:
        """Every seen replica's share of ``tenant``'s ``kind`` limit now. The same object while nothing changed,
        so that a bucket can tell at a glance that it has nothing to follow."""
        decay = self.decay(now)
        cached = self._cache.get((tenant, kind))
        version = self.view.version
        if cached is not None and (cached.version, cached.limit, cached.decay) == (version, limit, decay):
            return cached.split
        view = self.view
        demands = {replica: view.report(replica, tenant).demand(kind) for replica in view.members()}
        split = apportion(limit, demands, view.count, floor_of(kind, limit, view.count))
        if decay:
            fair = limit / view.count
            split = {replica: share + decay * (fair - share) for replica, share in split.items()}
        self._cache[(tenant, kind)] = _Cached(version, limit, decay, split)
        return split

    def given_fill(self, replica: str, tenant: str, kind: str, share: float) -> float:
        """How full the part of its ``share`` that ``replica`` gave up was, from its record
        (``TenantReport.given_fill``; full when it has none of the tenant); 0 for a replica that left (what it
        held is not handed on: better to admit too little than too much)."""
        if replica != self.me and not self.view.seen(replica):
            return 0.0
        return self.view.report(replica, tenant).given_fill(kind, share)

    def quiet_givers(self, old: Mapping[str, float], new: Mapping[str, float], tenant: str, now: float) -> bool:
        """Whether every replica whose share fell from ``old`` to ``new`` can hold nothing of ``tenant`` it did not
        publish (``ReplicaView.quiet``): then a share that grows may be taken at once."""
        view = self.view
        return all(
            view.quiet(replica, tenant, now)
            for replica, share in old.items()
            if replica != self.me and share > new.get(replica, 0.0)
        )

    def running(self, replica: str, tenant: str) -> int:
        return self.view.report(replica, tenant).running

    def demand(self, tenant: str, kind: str) -> float:
        """The fleet's demand: the sum of what every record says the tenant asked."""
        view = self.view
        return math.fsum(view.report(replica, tenant).demand(kind) for replica in view.members())

    def keep_only(self, tenants: Mapping[str, object]) -> None:
        """Forget the splits of tenants the key set no longer names."""
        self._cache = {key: cached for key, cached in self._cache.items() if key[0] in tenants}
