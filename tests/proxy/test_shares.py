"""The rules of limits held by the replicas, on their own objects: a few replicas' tenancy wired to each other as
etcd would wire them (a record put in every replica's view once it changed), on a clock of the test's own."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy
from vllm_etcd_proxy.proxy.tenancy.holdings import IDLE, KEEP
from vllm_etcd_proxy.proxy.tenancy.keys import KeySet, Limits, parse_line
from vllm_etcd_proxy.proxy.tenancy.limits import Grant, Shortfall, attempt
from vllm_etcd_proxy.proxy.tenancy.metrics import TenantMetrics
from vllm_etcd_proxy.proxy.tenancy.record import Entry, InvalidRecord, Transfer, decode, encode
from vllm_etcd_proxy.proxy.tenancy.replicas import ReplicaView
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet

KEYS = (
    "rate-key tenant=rate rpm=600 tpm=60000",
    "small-key tenant=small rpm=10",
    "conc-key tenant=conc concurrency=4",
)
BAD_RECORDS = {
    b"{": "not JSON",
    b"[1]": "'tenants' object",
    b'{"tenants": []}': "'tenants' object",
    b'{"tenants": {"t": 1}}': "not an object",
    b'{"tenants": {"t": {"rpm": 1}}}': "rpm: not an object",
    b'{"tenants": {"t": {"rpm": {"cap": "many"}}}}': "cap must be a number",
    b'{"tenants": {"t": {"rpm": {"cap": -1}}}}': "cap must be 0 or more",
    b'{"tenants": {"t": {"rpm": {"to": {"r": [0, 1, 1]}}}}}': "sequence of 1 or more",
    b'{"tenants": {"t": {"rpm": {"to": {"r": [1, 1]}}}}}': "[sequence, cap, level]",
    b'{"tenants": {"t": {"rpm": {"got": {"r": 1.5}}}}}': "whole number",
    b'{"tenants": {"t": {"rpm": {"heir_of": [1]}}}}': "list of replica ids",
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Replicas:
    """``count`` replicas of one fleet sharing one key set; ``publish`` is etcd and the replicas' puts."""

    def __init__(self, count: int) -> None:
        self.clock = Clock()
        self.keys = KeySet()
        self.keys.set_file(dict(parse_line(line) for line in KEYS))
        self.tenancies = [
            Tenancy(
                self.keys,
                Fleet(ReplicaView(f"r{i}", clock=self.clock), grace=2.0, decay=7.0),
                None,
                TenantMetrics(CollectorRegistry()),
            )
            for i in range(count)
        ]
        self.published = {f"r{i}": encode({}) for i in range(count)}  # what a replica puts when it starts
        for tenancy in self.tenancies:
            tenancy.fleet.view.replace(dict(self.published))
        self.admitted: dict[str, int] = {}

    def publish(self) -> None:
        """Every record that changed put and watched, until none changes (as etcd and the put loops would)."""
        for _ in range(20):
            if not self.publish_once():
                return
        raise AssertionError("the records never settled")

    def publish_once(self) -> bool:
        """The records that changed put and watched once, then every replica's tick; whether any changed."""
        changed = False
        for tenancy in self.tenancies:
            name, value = tenancy.fleet.me, encode(tenancy.reports())
            if value != self.published.get(name):
                self.published[name], changed = value, True
                for other in self.tenancies:
                    other.fleet.view.put(name, value)
        self.tick()
        return changed

    def tick(self) -> None:
        for tenancy in self.tenancies:
            tenancy.tick(self.clock())

    def later(self, seconds: float) -> None:
        self.clock.now += seconds
        self.tick()
        self.publish()

    def limits(self, key: str) -> Limits:
        limits = self.keys.check(f"Bearer {key}")
        assert limits is not None
        return limits

    def one(self, replica: int, key: str, estimate: int = 0) -> Grant | None:
        """One request through ``replica``: admitted on what it holds, or once the records said what the others
        would hand over while it waited; None when refused."""
        tenancy, limits = self.tenancies[replica], self.limits(key)
        counters = tenancy._counters_of(limits.tenant)
        counters.ask(limits, estimate, self.clock())
        for _ in range(8):  # while it waits, its replica looks again at every record put
            outcome = attempt(counters, limits, tenancy.fleet, estimate, self.clock())
            if isinstance(outcome, Grant):
                self.admitted[limits.tenant] = self.admitted.get(limits.tenant, 0) + 1
                return outcome
            if not outcome.waitable:
                break
            outcome.wait(+1)
            self.publish_once()
            outcome.wait(-1)
        assert isinstance(outcome, Shortfall)
        outcome.refusal(self.clock())
        return None

    def ask(self, replica: int, key: str, times: int, *, estimate: int = 0) -> list[Grant]:
        """``times`` requests through ``replica``, one after another; the grants of those admitted."""
        return [grant for _ in range(times) if (grant := self.one(replica, key, estimate)) is not None]

    def holds(self, replica: int, tenant: str, kind: str = "rpm") -> float:
        limits = self.keys.tenants()[tenant]
        return self.tenancies[replica].holds(tenant, kind, getattr(limits, kind))

    def held(self, tenant: str, kind: str = "rpm") -> float:
        """What the replicas hold of a limit together: their holdings, what they handed on that was not taken yet
        (the taker's own state says), and the even parts of what no record holds."""
        total, by_name = 0.0, {t.fleet.me: t for t in self.tenancies}
        for i, tenancy in enumerate(self.tenancies):
            counters = tenancy.counters.get(tenant)
            holding = counters.holdings.get(kind) if counters is not None else None
            if holding is None or not holding.explicit:
                total += self.holds(i, tenant, kind)
                continue
            total += holding.cap
            for taker, transfer in holding.out.items():
                theirs = by_name[taker].counters.get(tenant) if taker in by_name else None
                taken = theirs.holdings[kind].taken.get(tenancy.fleet.me, 0) if theirs else 0
                total += transfer.cap if taken < transfer.seq else 0.0
        return total


def test_a_record_round_trips_and_a_bad_one_is_refused_with_a_reason() -> None:
    record = {
        "t": {
            "rpm": Entry(cap=540.0, fill=0.5, ask=610.0, want=2.0, to={"r2": Transfer(seq=7, cap=60.0, level=1.5)}),
            "concurrency": Entry(cap=3.0, running=2, got={"r1": 4}, heir_of=("r9",)),
        }
    }
    assert decode(encode(record)) == record
    assert decode(b"") == {} and decode(b'{"tenants": {}, "later": 1}') == {}
    assert decode(b'{"tenants": {"t": {"later": {}}}}') == {"t": {}}  # a kind of a later version: ignored
    for value, reason in BAD_RECORDS.items():
        with pytest.raises(InvalidRecord, match=reason):
            decode(value)
    view = ReplicaView("me")
    assert "not JSON" in str(view.replace({"other": b"{"}))
    assert view.count == 2  # a replica whose record is bad still counts, holding nothing


def test_before_any_record_each_replica_holds_an_even_part() -> None:
    fleet = Replicas(3)
    assert [fleet.holds(i, "rate") for i in range(3)] == [200, 200, 200]
    assert [fleet.holds(i, "conc", "concurrency") for i in range(3)] == [2, 1, 1]  # whole slots, dealt in order


@pytest.mark.parametrize("count", [2, 4])
def test_a_tenant_through_one_replica_gets_the_whole_limit_and_the_fleet_no_more(count: int) -> None:
    fleet = Replicas(count)
    assert len(fleet.ask(0, "rate-key", 700)) == 600  # the others hand their even parts over
    assert fleet.holds(0, "rate") == 600 and all(fleet.holds(i, "rate") == 0 for i in range(1, count))
    assert sum(len(fleet.ask(i, "rate-key", 10)) for i in range(count)) == 0  # the minute is spent everywhere
    assert fleet.held("rate") == pytest.approx(600)


def test_bursts_at_every_replica_at_once_are_admitted_the_limit_and_no_more() -> None:
    fleet = Replicas(4)
    admitted = 0
    for _ in range(200):  # one request at each replica in turn, records exchanged only when one waits
        for replica in range(4):
            admitted += fleet.one(replica, "rate-key") is not None
    assert admitted == 600
    assert fleet.held("rate") == pytest.approx(600)


def test_an_idle_replica_hands_all_it_holds_to_one_whose_requests_wait() -> None:
    fleet = Replicas(3)
    assert len(fleet.ask(0, "small-key", 5)) == 5  # of rpm=10: r0 took the others' parts and spent half
    fleet.later(IDLE + 0.5)  # its client went elsewhere
    assert len(fleet.ask(2, "small-key", 11)) == 5  # what was left, as one replica holding the limit would admit
    assert fleet.holds(2, "small") == pytest.approx(10) and fleet.holds(0, "small") == pytest.approx(0, abs=1e-6)


def test_a_busy_replica_hands_over_what_a_waiting_request_wants_and_keeps_the_rest() -> None:
    fleet = Replicas(2)
    for _ in range(35):  # r0's client asks 100 a second: after 300, r1 (idle) handed its part over
        assert len(fleet.ask(0, "rate-key", 10)) == 10
        fleet.later(0.1)
    assert fleet.holds(0, "rate") == pytest.approx(600)
    assert len(fleet.ask(1, "rate-key", 1)) == 1
    assert fleet.holds(1, "rate") <= 2 and fleet.holds(0, "rate") >= 598
    assert fleet.held("rate") == pytest.approx(600)


def test_a_replica_refused_for_want_of_capacity_gets_its_part_of_the_refill() -> None:
    fleet = Replicas(2)
    fleet.ask(0, "rate-key", 600)  # r0 holds and spent everything
    for _ in range(30):  # 90 / 10, the minute spent: r1's requests are refused at once
        fleet.ask(0, "rate-key", 9)
        fleet.ask(1, "rate-key", 1)
        fleet.later(0.1)
    assert 0 < fleet.holds(1, "rate") < 300, "r1 holds a part of the limit (and so of its refill)"
    assert fleet.held("rate") == pytest.approx(600)


def test_a_replica_that_left_hands_what_it_held_to_its_heir_as_spent() -> None:
    fleet = Replicas(3)
    assert len(fleet.ask(1, "rate-key", 300)) == 300  # r1 holds the whole 600, 300 of it unspent
    fleet.later(IDLE + 0.5)  # r0 and r2, which handed their parts over, drop their empty entries
    r0, r2 = fleet.tenancies[0], fleet.tenancies[2]
    r2.fleet.view.delete("r1")  # its lease expired; r2 sees it first
    assert fleet.holds(2, "rate") == 0, "what r1 held is nobody's to hand out until its heir has it"
    r0.fleet.view.delete("r1")
    fleet.tenancies.pop(1)
    fleet.publish()
    assert fleet.holds(0, "rate") == pytest.approx(600), "r0 comes first: it is the heir"
    assert fleet.holds(1, "rate") == 0  # r2
    assert fleet.ask(0, "rate-key", 1) == [], "what r1 left counts as spent"
    fleet.later(6)
    assert len(fleet.ask(0, "rate-key", 100)) == 60  # refilling at the whole limit's rate


def test_holdings_move_to_an_even_part_when_etcd_is_away() -> None:
    fleet = Replicas(2)
    fleet.ask(0, "rate-key", 301)
    assert fleet.holds(0, "rate") == 600
    fleet.tenancies[0].fleet.refreshed()  # the last word from etcd
    fleet.clock.now += 2.0 + 7.0
    assert fleet.holds(0, "rate") == 300


def test_concurrency_slots_are_handed_whole_and_the_fleet_runs_no_more_than_the_limit() -> None:
    fleet = Replicas(2)
    running = fleet.ask(0, "conc-key", 6)
    assert len(running) == 4 and fleet.ask(1, "conc-key", 1) == []
    for grant in running[:2]:
        grant.finish(0)
    fleet.later(IDLE + 0.5)
    assert len(fleet.ask(1, "conc-key", 3)) == 2  # r0's free slots, r0 still running two
    assert fleet.held("conc", "concurrency") == 4


def test_a_replica_whose_lease_was_lost_holds_nothing_and_the_fleet_no_more() -> None:
    fleet = Replicas(2)
    fleet.ask(0, "rate-key", 10)
    fleet.publish()  # r0 holds the whole 600: r1 handed its full part to where the tenant asks
    assert fleet.holds(0, "rate") == pytest.approx(600)
    fleet.tenancies[1].fleet.view.delete("r0")  # r0 was cut off: its key expired, and r1 is its heir
    fleet.tenancies[0].lost()  # r0 learns it when its keepalive fails, and puts its record again
    fleet.publish()
    assert fleet.holds(0, "rate") == 0 and fleet.holds(1, "rate") == pytest.approx(600)
    assert fleet.ask(1, "rate-key", 1) == [], "what r0 held counts as spent"


def test_a_full_idle_holding_is_dropped_and_its_part_is_even_again() -> None:
    fleet = Replicas(2)
    fleet.ask(0, "small-key", 1)
    fleet.later(KEEP / 2)
    assert b"small" in fleet.published["r0"], "full, but asked within the minute"
    fleet.later(KEEP / 2 + 1)
    assert b"small" not in fleet.published["r0"] and b"small" not in fleet.published["r1"]
    assert [fleet.holds(i, "small") for i in range(2)] == [5, 5]


def test_a_changed_limit_changes_what_each_replica_holds() -> None:
    fleet = Replicas(2)
    assert len(fleet.ask(0, "small-key", 4)) == 4  # of its even part, 5
    fleet.keys.set_file(dict(parse_line(line.replace("rpm=10", "rpm=20")) for line in KEYS))
    assert len(fleet.ask(0, "small-key", 30)) == 12  # its part doubled, as full as it was, and r1's 10
    assert fleet.one(1, "small-key") is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["ask", "end", "later", "publish"]), st.integers(0, 2), st.integers(1, 30)),
        max_size=40,
    )
)
def test_the_replicas_never_hold_more_than_the_limit_however_requests_fall(steps: list[tuple[str, int, int]]) -> None:
    fleet = Replicas(3)
    running: list[list[Grant]] = [[], [], []]
    admitted, spent_seconds = 0, 0.0
    for step, replica, amount in steps:
        if step == "ask":
            grants = fleet.ask(replica, "small-key", amount) + fleet.ask(replica, "conc-key", 1)
            admitted += sum(grant.limits.rpm > 0 for grant in grants)
            running[replica] += [grant for grant in grants if grant.limits.concurrency]
        elif step == "end" and running[replica]:
            running[replica].pop().finish(0)
        elif step == "later":
            fleet.later(amount / 10)
            spent_seconds += amount / 10
        else:
            fleet.publish()
        if step in ("later", "publish"):  # the views agree once the records settled
            assert fleet.held("small") <= 10 + 1e-6
        assert sum(map(len, running)) <= 4
    assert admitted <= 10 + math.floor(spent_seconds * 10 / 60) + 1
