"""How capacity moves between replicas (shares.py says how it is held): a replica whose requests wait for capacity
publishes what they ``want``; replicas that hold some hand it over in their records; the taker adds it and
acknowledges it in its own. Each hand-over is taken once and is held by nobody in between, so the replicas never
hold more than the limit together.

- **Whom a replica hands to.** Replicas whose records want capacity of the limit, in proportion to what each
  wants, one hand-over to each at a time (the next once it acknowledged the last).
- **What.** An idle replica (nothing asked here for ``IDLE`` s, nothing waiting: its client went elsewhere) hands
  on everything it holds of the limit, its bucket's level with it; one whose bucket is full does so as soon as the
  tenant asks another replica, waiting or not (a full bucket's refill is lost). A busy one hands on what its
  bucket holds beyond what its own requests would take in ``HORIZON`` s; for concurrency, the free slots its own
  waiting requests do not need.
- **Rebalancing.** Otherwise, a replica that holds more than its part of the fleet's asks hands the excess to
  replicas that refused requests lately and hold less than half of their part, its bucket's fill with it: a
  tenant's refill follows where it asks, as one bucket's first-come first-served would give it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vllm_etcd_proxy.proxy.tenancy.holdings import Holding, TenantCounters, spare_parts
from vllm_etcd_proxy.proxy.tenancy.record import Record
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet

REBALANCE_UNDER = 0.5


@dataclass(frozen=True, slots=True)
class Giver:
    """This replica about to hand on capacity of one tenant's limit: its holding, the tenant's counters here, the
    limit, the fleet's view, the time, and where each hand-over's sequence number comes from."""

    holding: Holding
    counters: TenantCounters
    tenant: str
    limit: int
    fleet: Fleet
    now: float
    seq: Callable[[], int]

    @property
    def kind(self) -> str:
        return self.holding.kind

    def prepare(self) -> float:
        return self.holding.prepare(self.fleet, self.tenant, self.limit, self.now)

    def give(self, parts: Mapping[str, float], cap: float, level: float) -> None:
        """``cap`` with ``level`` of it, split among the replicas of ``parts`` in proportion."""
        for replica, part in spare_parts(1.0, parts).items():
            self.holding.give(replica, cap * part, level * part, self.seq())


def hand_on(giver: Giver) -> str:
    """Hand capacity of the tenant's limit to replicas whose requests wait for it, or to where it asks, or
    rebalance it by the fleet's asks; why anything was handed on ("" when nothing was)."""
    holding, fleet = giver.holding, giver.fleet
    if fleet.decay(giver.now) or (holding.explicit and holding.cap < giver.limit * 1e-6):
        return ""  # etcd away: nobody could take it; or nothing worth handing
    wants = {r: w for r, w in fleet.wants(giver.tenant, giver.kind).items() if r not in holding.out}
    if wants:
        if (_lend_rate if holding.rate else _lend_slots)(giver, wants):
            return "wanted"
    elif holding.rate and giver.counters.idle(giver.now) and _hand_full(giver):
        return "full"
    # A replica whose own requests wait keeps what it holds.
    if holding.explicit and not holding.want and _rebalance(giver):
        return "rebalanced"
    return ""


def _lend_rate(giver: Giver, wants: dict[str, float]) -> bool:
    holding = giver.holding
    giver.prepare()
    level = holding.level
    if level <= 0:
        return False
    if giver.counters.idle(giver.now):
        cap = holding.cap  # its client went elsewhere: all of it, as full as it is
    else:
        # What the waiting requests want, in proportion to what this replica could spare of what every replica
        # whose record shows some could (each of them hands its own part: the want is not met twice over).
        spare = level - giver.counters.reserve(giver.kind, giver.now)
        if spare <= 0:
            return False
        fleet = giver.fleet
        entries = (fleet.entry(r, giver.tenant, giver.kind) for r in fleet.others())
        others = math.fsum(max(0.0, e.spare) for e in entries if e is not None)
        want = math.fsum(wants.values())
        if spare + others < min(1.0, want):
            return False  # all of them together could not admit one of the waiting requests
        level = cap = min(spare, want * spare / (spare + others))
        if level < giver.limit * 1e-9:
            return False
    giver.give(wants, cap, level)
    return True


def _hand_full(giver: Giver) -> bool:
    """An idle replica whose bucket is full hands it to the replicas the tenant asks now (in proportion to their
    asks): a full bucket's refill is lost, and theirs are spending."""
    holding = giver.holding
    asks = {r: a for r, a in giver.fleet.asks(giver.tenant, giver.kind).items() if r not in holding.out}
    if not asks:
        return False
    cap = giver.prepare()
    if cap <= 0 or holding.level < cap - 1e-9:
        return False
    giver.give(asks, holding.cap, holding.level)
    return True


def _lend_slots(giver: Giver, wants: dict[str, float]) -> bool:
    holding = giver.holding
    cap = giver.prepare()
    # A free slot goes to a request that waits for one, first come first served: this replica's own waiting
    # requests first, then the others'. (A slot kept for a request that may come is a slot a waiting one lacks.)
    spare = int(min(holding.cap, cap) - giver.counters.running - math.ceil(holding.want - 1e-9) + 1e-9)
    handed = False
    for replica in sorted(wants):
        slots = min(spare, math.ceil(wants[replica] - 1e-9))
        if slots <= 0:
            break
        holding.give(replica, float(slots), 0.0, giver.seq())
        spare -= slots
        handed = True
    return handed


def _rebalance(giver: Giver) -> bool:
    holding, limit = giver.holding, giver.limit
    mine = giver.counters.published[giver.kind].value  # what the others see this replica ask
    asks = giver.fleet.asks(giver.tenant, giver.kind)
    total = math.fsum(asks.values()) + mine
    if not asks or total <= 0:
        return False
    unit = 1.0 if giver.kind != "tpm" else limit / 100
    excess = holding.cap - limit * mine / total
    if excess < unit:
        return False
    deficits, excesses = _parts(giver, asks, total)
    excesses.append(excess)
    if not deficits:
        return False
    giver.prepare()
    # Every replica over its part gives its share of the deficit: together they fill it once.
    given = min(excess, math.fsum(deficits.values()) * excess / math.fsum(excesses))
    if not holding.rate:
        given = float(int(min(given, holding.cap - giver.counters.running) + 1e-9))
        if given < 1:
            return False
    fill = holding.level / holding.cap if holding.rate and holding.cap > 0 else 0.0
    for replica, part in spare_parts(given, deficits).items():
        cap = part if holding.rate else float(round(part))
        if cap > 0:
            holding.give(replica, cap, cap * fill, giver.seq())
    return True


def _parts(giver: Giver, asks: dict[str, float], total: float) -> tuple[dict[str, float], list[float]]:
    """By the other replicas' records: what those that refused requests lately lack of their part of the fleet's
    asks (those holding less than half of it), and how much the rest hold beyond theirs."""
    deficits, excesses = {}, []
    for replica, ask in asks.items():
        entry = giver.fleet.entry(replica, giver.tenant, giver.kind)
        if entry is None:
            continue
        part = giver.limit * ask / total
        if replica not in giver.holding.out and entry.short > 0 and entry.cap < REBALANCE_UNDER * part:
            deficits[replica] = part - entry.cap
        else:
            excesses.append(max(0.0, entry.cap - part))
    return deficits, excesses


def take_from(
    giver: str, record: Record, me: str, holding_for: Callable[[str, str], Holding | None]
) -> list[tuple[str, str]]:
    """Add what ``giver``'s record hands to this replica (each hand-over once); the (tenant, kind) taken."""
    taken = []
    for tenant, kinds in record.items():
        for kind, entry in kinds.items():
            transfer = entry.to.get(me)
            if transfer is None:
                continue
            holding = holding_for(tenant, kind)
            if holding is not None and holding.take(giver, transfer):
                taken.append((tenant, kind))
    return taken


def settle_with(replica: str, fleet: Fleet, tenants: dict[str, TenantCounters], *, gone: bool) -> bool:
    """Forget the hand-overs to ``replica`` that it acknowledged (all of them when it is ``gone``: the others hold
    them as what it held), and the acknowledgements of its hand-overs that its record no longer shows; whether
    anything changed."""
    me, changed = fleet.me, False
    for tenant, counters in tenants.items():
        for kind, holding in counters.holdings.items():
            entry = None if gone else fleet.entry(replica, tenant, kind)
            sent = holding.out.get(replica)
            if sent is not None and (gone or (entry is not None and entry.got.get(me, 0) >= sent.seq)):
                del holding.out[replica]
                changed = True
            if replica in holding.taken and (entry is None or me not in entry.to):
                del holding.taken[replica]
                changed = True
    return changed
