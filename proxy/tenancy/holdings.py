"""What this replica holds of a tenant's limits, what the tenant asks of it, and what it hands on and takes.

Each limit the tenant has is a ``Holding``: capacity (``cap``: per minute for rpm and tpm, requests in flight for
concurrency) and, for rpm and tpm, a token bucket of it that holds a minute's worth and refills it continuously
over a minute. A holding is *explicit* once the tenant asked something here (it then has an entry in the record)
and until it is dropped; before, the replica holds its even part of what no record holds (shares.py), full. It
hands capacity on (``give``) as ``cap`` with ``level`` of it unspent, keeping the hand-over in its record until the
taker acknowledges it; a taker adds what it takes once (``take``). An idle holding whose bucket is full and that
hands nothing on is dropped after ``KEEP`` seconds, or at once when it holds nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from vllm_etcd_proxy.proxy.tenancy.keys import Limits
from vllm_etcd_proxy.proxy.tenancy.record import (
    WINDOW,
    Entry,
    Transfer,
    exact,
    rounded,
    rounded_fill,
    rounded_up,
)
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet

TAU = 2.0
"""Seconds over which a tenant's asks fade by a factor e."""
STEADY = 1.25
"""A published ask changes when the measured one is more than this factor away from it."""
IDLE = 1.0
"""Seconds without a request of the tenant after which this replica hands everything it holds of it to replicas
whose requests wait for capacity (its client went elsewhere): at least this, and ``IDLE_GAPS`` of the tenant's
usual gaps between requests here."""
IDLE_GAPS = 3.0
GAP_WEIGHT = 0.3
"""Weight of the latest gap in the moving average of the gaps between the tenant's requests here."""
HORIZON = 2.0
"""A busy replica keeps what its own requests would take in this many seconds, and hands on the rest."""
KEEP = 60.0
"""Seconds an idle, full holding stays in the record before it is dropped."""
HEIR_MARK = 5.0
"""Seconds a holding's record says it took the part of a replica that left (the others stop counting it then)."""
HELD_WEIGHT = 0.2
"""Weight of the latest request in the moving average of how long requests hold a slot."""


class Decaying:
    """A value that fades by a factor e every ``TAU`` seconds: a rate (``add``) or a peak (``reach``)."""

    __slots__ = ("value", "at")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0

    def read(self, now: float) -> float:
        return self.value * math.exp(-(now - self.at) / TAU) if self.value else 0.0

    def add(self, amount: float, now: float) -> None:
        """``amount`` more units were asked now (the value is then a rate per second)."""
        self.value = self.read(now) + amount / TAU
        self.at = now

    def reach(self, level: float, now: float) -> None:
        """``level`` was wanted now (the value is then the recent peak)."""
        self.value = max(level, self.read(now))
        self.at = now


class Steady:
    """An ask as published: it follows the measure only once that moved by more than a factor ``STEADY``, so that
    a steady tenant's record does not change."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def follow(self, measured: float) -> float:
        if not measured or not self.value or not 1 / STEADY <= measured / self.value <= STEADY:
            self.value = rounded(measured)
        return self.value


class Holding:
    """This replica's part of one tenant's limit of one kind (see the module's docstring)."""

    __slots__ = ("kind", "explicit", "cap", "level", "at", "want", "out", "taken", "heir_of", "dropped", "limit")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.explicit = False
        self.cap = 0.0
        self.level = 0.0
        """Unspent units of the bucket (rpm, tpm; below 0 in debt)."""
        self.at = 0.0
        self.want = 0.0
        """What the requests waiting here for capacity need now."""
        self.out: dict[str, Transfer] = {}
        """Hand-overs not acknowledged yet, by taker."""
        self.taken: dict[str, int] = {}
        """The sequence of the last hand-over taken, by giver (while its record still shows one)."""
        self.heir_of: dict[str, float] = {}
        """Replicas that left whose part this one took, and when (shown in the record for ``HEIR_MARK`` s)."""
        self.dropped: float | None = None
        """What a dropped holding held (full), while this replica's published record may still show it."""
        self.limit = 0

    @property
    def rate(self) -> bool:
        return self.kind != "concurrency"

    def effective(self, fleet: Fleet, limit: int, now: float) -> float:
        """The capacity in force: ``cap``, moving to limit / R while etcd is away."""
        decay = fleet.decay(now)
        return self.cap + decay * (limit / fleet.count - self.cap) if decay else self.cap

    def prepare(self, fleet: Fleet, tenant: str, limit: int, now: float) -> float:
        """Ready to admit or hand on: explicit, following a changed limit, refilled. The capacity in force."""
        if not self.explicit:
            self._claim(fleet, tenant, limit, now)
        elif limit != self.limit:
            ratio = limit / self.limit if self.limit else 1.0
            self.cap = self.cap * ratio if self.rate else float(math.floor(self.cap * ratio + 1e-9))
            self.level *= ratio
            self.limit = limit
        cap = self.effective(fleet, limit, now)
        self.refill(cap, now)
        return cap

    def refill(self, cap: float, now: float) -> None:
        """The bucket refilled at ``cap`` a minute since it was last looked at (rates only)."""
        if not self.rate:
            return
        if self.level > cap:
            self.level = cap  # etcd away and the part in force shrinking
        elif cap > 0:
            self.level = min(cap, self.level + (now - self.at) * cap / WINDOW)
        self.at = now

    def _claim(self, fleet: Fleet, tenant: str, limit: int, now: float) -> None:
        """Start holding explicitly: this replica's even part of what no record holds, full (or what it dropped,
        while its own record still shows that)."""
        if self.dropped is not None and fleet.entry(fleet.me, tenant, self.kind) is not None:
            share = self.dropped
        else:
            share = fleet.unheld_share(tenant, self.kind, limit, now)
        self.explicit, self.cap, self.level, self.at, self.limit, self.dropped = True, share, share, now, limit, None

    def give(self, taker: str, cap: float, level: float, seq: int) -> None:
        """Hand ``cap`` of the limit with ``level`` of it unspent to ``taker`` (one hand-over to it at a time)."""
        cap, level = exact(cap), exact(level)
        self.cap = self.cap - cap if self.cap - cap > 1e-6 * max(cap, 1.0) else 0.0
        self.level -= level
        self.out[taker] = Transfer(seq=seq, cap=cap, level=level)

    def take(self, giver: str, transfer: Transfer) -> bool:
        """Add a hand-over from ``giver`` once; whether it was new."""
        if transfer.seq <= self.taken.get(giver, 0):
            return False
        self.cap += transfer.cap
        self.level += transfer.level
        self.taken[giver] = transfer.seq
        return True

    def inherit(self, replica: str, cap: float, now: float) -> None:
        """Take what ``replica``, which left, held (its heir, replicas.py): as spent, since it may have been."""
        self.cap += cap
        self.heir_of[replica] = now

    def inherit_unheld(self, fleet: Fleet, tenant: str, limit: int, now: float) -> bool:
        """Take what no record holds (this replica is its heir, shares.py), full; whether there was any."""
        left = limit - fleet.held_elsewhere(tenant, self.kind, now, self.taken) - self.cap
        left -= math.fsum(t.cap for t in self.out.values())
        if not self.rate:
            left = float(int(left + 1e-9))
        if left < (1.0 if not self.rate else limit * 1e-6):
            return False
        self.cap += left
        if self.rate:
            self.level += left
        return True

    def entry(self, ask: float, short: float, running: int) -> Entry:
        """This holding as the record has it."""
        if self.rate:
            fill = self.level / self.cap if self.cap > 0 else 1.0
            return Entry(
                cap=rounded_up(self.cap, 9),
                fill=rounded_fill(min(1.0, fill)),
                ask=ask,
                want=rounded_up(self.want),
                short=short,
                to=dict(self.out),
                got=dict(self.taken),
                heir_of=tuple(self.heir_of),
            )
        return Entry(
            cap=float(round(self.cap)),
            running=running,
            ask=ask,
            want=float(math.ceil(self.want - 1e-9)),
            short=short,
            to=dict(self.out),
            got=dict(self.taken),
            heir_of=tuple(self.heir_of),
        )

    def droppable(self, idle_for: float, running: int) -> bool:
        """Idle long enough, full, handing and waiting for nothing: the record may forget it."""
        if not self.explicit or self.want or self.out or self.taken or self.heir_of or running:
            return False
        if self.cap <= 0:
            return idle_for > IDLE
        return idle_for > KEEP and (not self.rate or self.level >= self.cap - 1e-9)

    def drop(self) -> None:
        self.dropped = self.cap
        self.explicit, self.cap, self.level = False, 0.0, 0.0


class TenantCounters:
    """One tenant on this replica: its holdings by kind, what it asks, what runs. Kept across key reloads while
    the tenant exists."""

    __slots__ = (
        "holdings",
        "running",
        "asked",
        "asked_tokens",
        "wanted",
        "refused",
        "gap",
        "held",
        "published",
        "published_short",
        "last_ask",
    )

    def __init__(self) -> None:
        self.holdings: dict[str, Holding] = {}
        self.running = 0
        self.asked = Decaying()
        self.asked_tokens = Decaying()
        self.wanted = Decaying()
        self.refused = {kind: Decaying() for kind in ("rpm", "tpm", "concurrency")}
        """What was refused here for want of capacity, by limit (a rate per second)."""
        self.gap = 0.0
        """The usual gap between the tenant's requests here (seconds, a moving average; 0: none yet)."""
        self.held = 0.0
        """How long its requests held a concurrency slot here lately (seconds, a moving average; 0: none yet)."""
        self.published = {kind: Steady() for kind in ("rpm", "tpm", "concurrency")}
        self.published_short = {kind: Steady() for kind in ("rpm", "tpm", "concurrency")}
        self.last_ask = -math.inf

    def holding(self, kind: str) -> Holding:
        holding = self.holdings.get(kind)
        if holding is None:
            holding = self.holdings[kind] = Holding(kind)
        return holding

    def ask(self, limits: Limits, estimate: int, now: float) -> None:
        """A request arrived: it counts as asked whether it is admitted or not."""
        if self.last_ask > -math.inf:
            gap = now - self.last_ask
            self.gap = gap if not self.gap else self.gap + GAP_WEIGHT * (gap - self.gap)
        self.last_ask = now
        if limits.rpm or limits.concurrency:
            self.asked.add(1, now)
        if limits.tpm:
            self.asked_tokens.add(estimate, now)
        if limits.concurrency:
            self.wanted.reach(self.running + 1, now)

    def released(self, held: float) -> None:
        """A request that held a concurrency slot for ``held`` seconds ended."""
        self.held = held if not self.held else self.held + HELD_WEIGHT * (held - self.held)

    def explicit(self) -> list[str]:
        """The kinds it holds explicitly (its record's entries)."""
        return [kind for kind, holding in self.holdings.items() if holding.explicit]

    def idle(self, now: float) -> bool:
        """Nothing asked for ``IDLE`` s and three of its usual gaps, nothing waiting: its client went elsewhere
        (or went quiet)."""
        quiet = max(IDLE, IDLE_GAPS * self.gap)
        return now - self.last_ask > quiet and not any(h.want for h in self.holdings.values())

    def concurrency_demand(self, now: float) -> float:
        """Requests it would have in flight here if nothing refused them: what it asks a second times how long a
        request holds a slot (Little's law), and at least the most it wanted at once lately."""
        return max(self.wanted.read(now), self.asked.read(now) * self.held)

    def asking(self, kind: str, now: float) -> float:
        """What it asks of this limit here: per minute for rpm and tpm, in flight for concurrency."""
        if kind == "rpm":
            return self.asked.read(now) * WINDOW
        if kind == "tpm":
            return self.asked_tokens.read(now) * WINDOW
        return self.concurrency_demand(now)

    def reserve(self, kind: str, now: float) -> float:
        """What a busy replica keeps of a rate limit for its own next requests: their units over ``HORIZON`` s."""
        return self.asking(kind, now) / WINDOW * HORIZON

    def report(self, limits: Limits, now: float) -> dict[str, Entry]:
        """The tenant's entries in this replica's record: its explicit holdings."""
        out, idle = {}, self.idle(now)  # an idle replica asks nothing (its client went elsewhere)
        for kind, holding in self.holdings.items():
            if holding.explicit and getattr(limits, kind):
                ask = self.published[kind].follow(0.0 if idle else self.asking(kind, now))
                refused = 0.0 if idle else self.refused[kind].read(now) * (1 if kind == "concurrency" else WINDOW)
                short = self.published_short[kind].follow(refused if refused > 0.05 else 0.0)
                out[kind] = holding.entry(ask, short, self.running if kind == "concurrency" else 0)
        return out

    def settle(self, limits: Limits, now: float) -> bool:
        """Drop the holdings that may be forgotten (and those of limits the key no longer has), and old marks of
        parts inherited; whether the record changes."""
        dropped = False
        for kind, holding in self.holdings.items():
            holding.refill(holding.cap, now)
            for replica in [r for r, at in holding.heir_of.items() if now - at > HEIR_MARK]:
                del holding.heir_of[replica]
                dropped = True
            gone = not getattr(limits, kind) and holding.explicit and not (holding.out or holding.taken)
            if gone or holding.droppable(now - self.last_ask, self.running if kind == "concurrency" else 0):
                holding.drop()
                dropped = True
        return dropped


def spare_parts(total: float, wants: Mapping[str, float]) -> dict[str, float]:
    """``total`` split among the replicas of ``wants`` in proportion to what each wants."""
    whole = math.fsum(wants.values())
    return {replica: total * want / whole for replica, want in wants.items()} if whole > 0 else {}
