"""The rules of limits shared by demand, on their own objects: a few replicas' tenancy wired to each other as etcd
would wire them (each one's record put in every replica's view), without processes."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client import CollectorRegistry

from vllm_etcd_proxy.proxy.errors import RateLimited
from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy
from vllm_etcd_proxy.proxy.tenancy.demand import InvalidRecord, TenantReport, decode, encode
from vllm_etcd_proxy.proxy.tenancy.keys import KeySet, Limits, parse_line
from vllm_etcd_proxy.proxy.tenancy.limits import SETTLE, Grant, admit
from vllm_etcd_proxy.proxy.tenancy.metrics import TenantMetrics
from vllm_etcd_proxy.proxy.tenancy.replicas import PUBLISH_INTERVAL, QUIET_MARGIN, ReplicaView
from vllm_etcd_proxy.proxy.tenancy.shares import FLOOR, Fleet, apportion

KEYS = ("rate-key tenant=rate rpm=600 tpm=60000", "conc-key tenant=conc concurrency=4")
BAD_RECORDS = {
    b"{": "not JSON",
    b"[1]": "'tenants' object",
    b'{"tenants": []}': "'tenants' object",
    b'{"tenants": {"t": 1}}': "not an object",
    b'{"tenants": {"t": {"rpm": "many"}}}': "rpm must be a number",
    b'{"tenants": {"t": {"running": -1}}}': "running must be 0 or more",
}


class Replicas:
    """``count`` replicas of one fleet, sharing one key set; ``publish`` is etcd: every record to every view."""

    def __init__(self, count: int, *, grace: float = 2.0, decay: float = 7.0, settled: bool = True) -> None:
        """``settled``: the replicas' first records are old by the time the test starts (as in a fleet that has
        run a while), so that a replica whose record lacks a tenant is known to hold nothing of it."""
        self.keys = KeySet()
        self.keys.set_file(dict(parse_line(line) for line in KEYS))
        self.tenancies = [
            Tenancy(
                self.keys,
                Fleet(ReplicaView(f"r{i}"), grace=grace, decay=decay),
                None,
                TenantMetrics(CollectorRegistry()),
            )
            for i in range(count)
        ]
        self.published = {i: encode({}) for i in range(count)}  # what a replica puts when it starts
        for tenancy in self.tenancies:
            tenancy.fleet.view.replace({f"r{i}": value for i, value in self.published.items()})
        if settled:
            time.sleep(PUBLISH_INTERVAL + QUIET_MARGIN + 0.05)

    def publish(self) -> None:
        """Each replica's record to every view, when it changed (as a replica puts it)."""
        for i, tenancy in enumerate(self.tenancies):
            value = encode(tenancy.reports())
            if value != self.published[i]:
                self.published[i] = value
                for other in self.tenancies:
                    other.fleet.view.put(f"r{i}", value)

    def limits(self, key: str) -> Limits:
        limits = self.keys.check(f"Bearer {key}")
        assert limits is not None
        return limits

    def ask(self, replica: int, key: str, times: int, *, estimate: int = 0) -> list[Grant]:
        """``times`` requests through ``replica``; the grants of those admitted (not finished)."""
        tenancy, limits = self.tenancies[replica], self.limits(key)
        grants = []
        for _ in range(times):
            try:
                grants.append(admit(tenancy._counters_of(limits.tenant), limits, tenancy.fleet, estimate))
            except RateLimited:
                pass
        return grants

    def drain(self, replica: int, key: str) -> int:
        """Requests through ``replica`` until it refuses, records exchanged in between; how many were admitted."""
        admitted = 0
        for _ in range(5):
            admitted += len(self.ask(replica, key, 2000))
            self.publish()
        return admitted


def test_a_limit_is_split_in_proportion_to_demand_with_a_floor_for_a_replica_that_asks_nothing() -> None:
    assert apportion(600, {"a": 90, "b": 10, "c": 0}, 3, 10) == {"a": 540, "b": 60, "c": 10}
    assert apportion(600, {"a": 0, "b": 0}, 3, 10) == {"a": 200, "b": 200}  # nobody asked: even, c included
    # Every replica computes the same split, in whatever order it learnt the records.
    assert apportion(7, {"b": 1 / 3, "a": 2 / 3}, 2, 0.1) == apportion(7, {"a": 2 / 3, "b": 1 / 3}, 2, 0.1)


@pytest.mark.parametrize("count", [2, 4])
def test_a_tenant_through_one_replica_gets_the_whole_limit_and_the_others_nothing_more(count: int) -> None:
    fleet = Replicas(count)
    started = time.monotonic()
    first = len(fleet.ask(0, "rate-key", 2000))
    assert math.floor(600 / count) <= first <= 600 / count + 1  # before any record: the even split
    admitted = first + fleet.drain(0, "rate-key")
    others = sum(fleet.drain(i, "rate-key") for i in range(1, count))
    refilled = (time.monotonic() - started) * 600 / 60
    assert 599 <= admitted <= 600 + refilled + 1
    # The fleet's bucket is spent: a replica that starts seeing the tenant starts as empty as the others.
    assert admitted + others <= 600 * (1 + FLOOR) + refilled + count


def test_traffic_that_moves_to_another_replica_gets_the_refill_not_a_second_bucket() -> None:
    fleet = Replicas(2)
    started = time.monotonic()
    first = len(fleet.ask(0, "rate-key", 2000)) + fleet.drain(0, "rate-key")
    moved = 0
    for _ in range(3):  # demand fades from r0 and grows on r1; r1 takes its larger share once it settled
        moved += fleet.drain(1, "rate-key")
        time.sleep(SETTLE)
    moved += fleet.drain(1, "rate-key")
    refilled = (time.monotonic() - started) * 600 / 60
    assert first >= 599 and moved <= 600 * FLOOR + refilled + 2
    split = fleet.tenancies[1].fleet.split("rate", "rpm", 600, time.monotonic())
    assert split["r1"] > split["r0"], "the share followed the demand"
    assert fleet.tenancies[1].counters["rate"].requests.capacity > 300, "and r1 took most of it"


def test_a_share_that_grows_waits_while_the_replicas_that_gave_it_up_may_not_have_published_it() -> None:
    fleet = Replicas(2, settled=False)  # every record just arrived: r1 may have admitted what it did not publish
    fleet.ask(0, "rate-key", 1)
    fleet.publish()
    assert len(fleet.ask(0, "rate-key", 2000)) <= 300  # the even split until the larger share settles
    time.sleep(SETTLE)
    assert len(fleet.ask(0, "rate-key", 2000)) >= 290  # r1 never spent its part: handed over full


def test_what_a_giver_spends_after_it_gave_is_not_held_against_what_it_gave() -> None:
    fleet = Replicas(2)
    assert len(fleet.ask(0, "rate-key", 100)) == 100  # of r0's even share, 300
    fleet.publish()
    assert len(fleet.ask(1, "rate-key", 15)) == 15  # r1 starts at its floor (15, full) and spends it
    fleet.publish()  # the split follows the demand, 100 : 15
    first = len(fleet.ask(0, "rate-key", 1))  # r0 sees its larger share, to be taken once it settled
    time.sleep(SETTLE)
    # r0 takes what r1 gave of its even share, never spent: full, though r1's own bucket is empty now.
    assert first + len(fleet.ask(0, "rate-key", 2000)) >= 200 + 600 * 100 / 115 - 300 - 2


def test_a_split_demand_shares_the_limit_and_the_tpm_bucket_alike() -> None:
    fleet = Replicas(2, settled=False)
    for _ in range(6):  # 90 / 10
        fleet.ask(0, "rate-key", 90, estimate=10)
        fleet.ask(1, "rate-key", 10, estimate=10)
        fleet.publish()
    now = time.monotonic()
    for kind, limit in (("rpm", 600), ("tpm", 60000)):
        split = fleet.tenancies[0].fleet.split("rate", kind, limit, now)
        assert split == fleet.tenancies[1].fleet.split("rate", kind, limit, now)
        assert split["r0"] == pytest.approx(0.9 * limit, rel=0.05) and sum(split.values()) == pytest.approx(limit)


def test_a_concurrency_share_grows_only_after_it_settled_and_never_into_slots_still_held() -> None:
    fleet = Replicas(2, settled=False)
    held = fleet.ask(1, "conc-key", 10)  # r1 first: an even split, 2 each
    assert len(held) == 2
    fleet.publish()
    assert len(fleet.ask(1, "conc-key", 1)) == 0  # r1 asked more: its share is 4 now, but not settled yet
    for grant in held:
        grant.finish(0)
    fleet.publish()
    assert len(fleet.ask(0, "conc-key", 1)) == 1  # r0's floor: one request
    # r1 still runs 2 of its own while the demand moves to r0: r0 takes no slot they hold.
    held = fleet.ask(1, "conc-key", 2)
    fleet.publish()
    r0 = fleet.tenancies[0].fleet
    r0_counters = fleet.tenancies[0].counters["conc"]
    now = time.monotonic()
    allowed = r0_counters.slots.allowed(r0.split("conc", "concurrency", 4, now), r0, "conc", 4, now)
    assert allowed <= 4 + 2 - 1 - 2


def test_shares_decay_to_the_even_split_when_etcd_is_away() -> None:
    fleet = Replicas(2, grace=0.0, decay=0.05, settled=False)
    fleet.drain(0, "rate-key")
    r0 = fleet.tenancies[0].fleet
    assert r0.split("rate", "rpm", 600, time.monotonic())["r0"] == 600
    r0.refreshed()  # the last word from etcd
    deadline = time.monotonic() + 5
    while r0.decay(time.monotonic()) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r0.split("rate", "rpm", 600, time.monotonic()) == {"r0": 300, "r1": 300}


def test_a_dead_replicas_demand_stops_counting_when_its_key_goes() -> None:
    fleet = Replicas(2)
    fleet.drain(1, "rate-key")
    r0 = fleet.tenancies[0].fleet
    assert r0.split("rate", "rpm", 600, time.monotonic())["r0"] == 600 * FLOOR / 2
    r0.view.delete("r1")  # its lease expired
    assert r0.split("rate", "rpm", 600, time.monotonic()) == {"r0": 600}


def test_a_record_round_trips_and_a_bad_one_is_refused_with_a_reason() -> None:
    reports = {"t": TenantReport(rpm=12.0, rpm_fill=0.5, concurrency=3.0, running=2)}
    assert decode(encode(reports)) == reports
    assert decode(b"") == {} and decode(b'{"tenants": {}, "later": 1}') == {}
    for value, reason in BAD_RECORDS.items():
        with pytest.raises(InvalidRecord, match=reason):
            decode(value)
    view = ReplicaView("me")
    assert "not JSON" in str(view.replace({"other": b"{"}))
    assert view.count == 2  # a replica whose record is bad still counts, with no demand
