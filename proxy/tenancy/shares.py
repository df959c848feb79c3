"""How each tenant's limits are held across the live replicas, as this replica sees it from everyone's records
(record.py, replicas.py). No counter is shared per request: a limit is capacity that replicas hold and hand on.

- **Held.** A replica whose record has an entry for a tenant's limit holds that entry's ``cap`` (and, for rpm
  and tpm, a bucket of it); capacity handed on (``to``) is held by nobody until its taker acknowledges it; what a
  replica that left held stays held until it would have refilled.
- **Unheld.** What no record holds, ``limit - held``, is split evenly among the replicas whose records have no
  entry for it, and is full: a replica drops an entry only when its bucket is full (holdings.py). Before anyone
  asked anything each replica holds ``limit / R``. A replica that starts using the limit takes its even part as
  it is; the others see it in its record. When every replica has an entry, what nobody holds (a larger limit,
  capacity a departed replica held once refilled) goes to the first replica in the order all agree on.
- **Handed on.** Capacity moves only from a replica that holds it to one that asked for it (lending.py), so the
  replicas never hold more than the limit together, however traffic falls on them.

When etcd is away (the lease not refreshed, or the watch down), the records a replica sees are frozen: its
holdings stay what they are for ``grace`` seconds, then move linearly to ``limit / R`` over ``decay`` seconds,
finishing before the others can have expired its key (setup.py derives both from the TTL).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping

from vllm_etcd_proxy.proxy.tenancy.record import KINDS, Entry
from vllm_etcd_proxy.proxy.tenancy.replicas import ReplicaView

__all__ = ["KINDS", "Fleet"]

_NOTHING: Mapping[str, int] = {}


class Fleet:
    """This replica's view of how the tenants' limits are held: the replicas and their records (``view``), and
    whether that view is fresh. ``wake`` asks the record to be published now (within the put interval)."""

    def __init__(
        self, view: ReplicaView, *, grace: float, decay: float, watching: Callable[[], bool] = lambda: True
    ) -> None:
        self.view = view
        self.wake = asyncio.Event()
        self._grace, self._decay = grace, decay
        self._watching = watching
        self._contact: float | None = None

    @property
    def me(self) -> str:
        return self.view.me

    @property
    def count(self) -> int:
        return self.view.count

    def refreshed(self) -> None:
        """The replica's lease was refreshed: etcd is there, and if the watch is up the view is fresh."""
        if self._watching():
            self._contact = self.view.clock()

    def decay(self, now: float) -> float:
        """0 while the view is fresh, rising to 1 as holdings move to limit / R when etcd is away."""
        if self._contact is None:
            return 0.0
        return min(1.0, max(0.0, (now - self._contact - self._grace) / self._decay))

    def others(self) -> list[str]:
        return [replica for replica in self.view.members() if replica != self.me]

    def entry(self, replica: str, tenant: str, kind: str) -> Entry | None:
        return self.view.entry(replica, tenant, kind)

    def held_elsewhere(self, tenant: str, kind: str, now: float, taken: Mapping[str, int] = _NOTHING) -> float:
        """What the other replicas hold of the limit by their records: their caps, what they handed on that its
        taker has not acknowledged (or, handed to this replica, not taken: ``taken`` has the sequence of the last
        hand-over it took from each), and what replicas that left held and no live one took yet."""
        view, me = self.view, self.me
        held = view.reserved(tenant, kind, now)
        for replica in self.others():
            entry = view.entry(replica, tenant, kind)
            if entry is None:
                continue
            held += entry.cap
            for taker, transfer in entry.to.items():
                if taker == me:
                    held += transfer.cap if taken.get(replica, 0) < transfer.seq else 0.0
                    continue
                got = view.entry(taker, tenant, kind)
                if got is None or got.got.get(replica, 0) < transfer.seq:
                    held += transfer.cap
        return held

    def unheld_share(self, tenant: str, kind: str, limit: int, now: float) -> float:
        """This replica's even part of what no record holds (it has no entry of its own); whole slots for
        concurrency, dealt in the order every replica agrees on."""
        view = self.view
        others = self.others()
        implicit = [r for r in others if view.entry(r, tenant, kind) is None]
        holders = max(1, self.count - (len(others) - len(implicit)))
        left = max(0.0, limit - self.held_elsewhere(tenant, kind, now))
        if kind != "concurrency":
            return left / holders
        slots = int(left + 1e-9)
        place = sorted([*implicit, self.me]).index(self.me)
        return float(slots // holders + (1 if place < slots % holders else 0))

    def heir(self, tenant: str, kind: str) -> bool:
        """Whether what no record holds goes to this replica: every replica has an entry, and it comes first."""
        view = self.view
        if self.count > len(view.members()):
            return False  # --workers without etcd: the others hold their parts unseen
        return all(view.entry(r, tenant, kind) is not None for r in self.others()) and view.members()[0] == self.me

    def available(
        self, tenant: str, kind: str, limit: int, mine: float, now: float, taken: Mapping[str, int] = _NOTHING
    ) -> float:
        """What the other replicas could hand this one by their records: what their buckets hold (free slots for
        concurrency), and the part of what no record holds that is theirs; ``mine``: what this replica holds or
        handed on unacknowledged, ``taken``: what it took (``held_elsewhere``). Replicas without records
        (``--workers`` without etcd) hand nothing."""
        view, total, implicit = self.view, 0.0, 0
        for replica in self.others():
            entry = view.entry(replica, tenant, kind)
            if entry is None:
                implicit += 1
            else:
                total += max(0.0, entry.spare)
        if implicit:
            unseen = self.count - len(view.members())
            left = max(0.0, limit - self.held_elsewhere(tenant, kind, now, taken) - mine)
            total += left * implicit / (implicit + unseen)
        return total

    def running_elsewhere(self, tenant: str, kind: str) -> bool:
        """Whether another replica's record shows requests of the tenant running in slots it holds: one may end,
        and its slot be handed over, any moment."""
        view = self.view
        for replica in self.others():
            entry = view.entry(replica, tenant, kind)
            if entry is not None and entry.running and entry.cap > 0:
                return True
        return False

    def wants(self, tenant: str, kind: str) -> dict[str, float]:
        """What the other replicas' waiting requests need of the limit, by replica (only those that need some)."""
        out = {}
        for replica in self.others():
            entry = self.view.entry(replica, tenant, kind)
            if entry is not None and entry.want > 0:
                out[replica] = entry.want
        return out

    def asks(self, tenant: str, kind: str) -> dict[str, float]:
        """What the tenant asked of each other replica lately, by their records."""
        out = {}
        for replica in self.others():
            entry = self.view.entry(replica, tenant, kind)
            if entry is not None and entry.ask > 0:
                out[replica] = entry.ask
        return out

    def demand(self, tenant: str, kind: str, mine: float) -> float:
        """The fleet's demand: what every record says the tenant asked, this replica's ``mine`` in place of its."""
        return math.fsum(self.asks(tenant, kind).values()) + mine

    def wanted(self) -> set[tuple[str, str]]:
        """(tenant, kind) that some other replica's waiting requests need, or that some other replica is asked:
        what this replica may have to hand over."""
        out: set[tuple[str, str]] = set()
        for replica in self.others():
            for tenant, kinds in self.view.record(replica).items():
                out.update((tenant, kind) for kind, entry in kinds.items() if entry.want > 0 or entry.ask > 0)
        return out
