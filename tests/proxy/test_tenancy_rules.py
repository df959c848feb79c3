"""The rules of tenancy on its own objects: what a key line or value means, the queue's order, the buckets."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.app import static_node
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.errors import RateLimited, Unauthorized
from vllm_etcd_proxy.proxy.tenancy.holdings import TenantCounters
from vllm_etcd_proxy.proxy.tenancy.keys import InvalidKey, KeySet, Limits, parse_line, parse_value
from vllm_etcd_proxy.proxy.tenancy.limits import Grant, Shortfall, attempt, duration
from vllm_etcd_proxy.proxy.tenancy.queue import FairQueue, QueueSettings
from vllm_etcd_proxy.proxy.tenancy.replicas import ReplicaView
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet

BAD_LINES = {
    "k rpm=ten": "rpm must be an integer",
    "k rpm=-1": "rpm must be 0 or more",
    "k colour=red": "unknown field 'colour'",
    "k tenant=has space=": "unknown field",
    "k share=0": "share must be 1 or more",
    "k tenant=" + "x" * 65: "tenant must be",
}


def test_a_key_line_names_its_tenant_and_limits_and_a_bare_key_its_own_tenant() -> None:
    digest, limits = parse_line("sk-1 tenant=team-a rpm=60 tpm=1000 concurrency=2 priority=-1 share=3")
    assert digest == hashlib.sha256(b"sk-1").digest()
    assert limits == Limits(tenant="team-a", rpm=60, tpm=1000, concurrency=2, priority=-1, share=3)
    _, bare = parse_line("sk-2")
    assert bare.tenant == "key-" + hashlib.sha256(b"sk-2").hexdigest()[:12] and not bare.limited


@pytest.mark.parametrize("line", sorted(BAD_LINES))
def test_a_bad_key_line_is_refused_with_a_reason_that_never_shows_the_key(line: str) -> None:
    with pytest.raises(InvalidKey, match=BAD_LINES[line]) as refused:
        parse_line(line)
    assert "k " not in str(refused.value)


def test_an_etcd_key_is_named_by_the_digest_and_holds_json() -> None:
    name = hashlib.sha256(b"sk-3").hexdigest()
    assert parse_value(name, b'{"tenant": "t", "rpm": 5, "extra": 1}')[1] == Limits(tenant="t", rpm=5)
    assert parse_value(name, b"")[1].tenant.startswith("key-")
    for bad_name, value, reason in (
        ("sk-3", b"{}", "SHA-256"),
        (name, b"[1]", "not a JSON object"),
        (name, b"{", "not JSON"),
        (name, b'{"rpm": true}', "integer"),
    ):
        with pytest.raises(InvalidKey, match=reason):
            parse_value(bad_name, value)


def test_the_key_set_is_open_while_empty_and_knows_keys_from_every_source() -> None:
    keys = KeySet()
    assert keys.check(None) is None
    keys = KeySet(["flag-key"])
    keys.set_file(dict([parse_line("file-key tenant=f rpm=1")]))
    keys.put_etcd(*parse_value(hashlib.sha256(b"etcd-key").hexdigest(), b'{"tenant": "e"}'))
    assert keys.check(b"Bearer file-key") == Limits(tenant="f", rpm=1)
    assert keys.check("Bearer etcd-key") == Limits(tenant="e")
    assert keys.check("bearer flag-key") is not None
    for wrong in (None, "Bearer other", "file-key"):
        with pytest.raises(Unauthorized):
            keys.check(wrong)


def workers(count: int) -> Fleet:
    """The shares of one of ``count`` workers of a replica without etcd (no records: an even split)."""
    return Fleet(ReplicaView("me", least=count), grace=2.0, decay=7.0)


def admit(counters: TenantCounters, limits: Limits, fleet: Fleet, estimate: int) -> Grant:
    """One request on this replica alone: admitted, or its 429."""
    outcome = attempt(counters, limits, fleet, estimate, time.monotonic())
    if isinstance(outcome, Shortfall):
        assert not outcome.waitable  # no other replica could hand anything over
        raise outcome.refusal(time.monotonic())
    return outcome


def test_rpm_share_refills_over_a_minute_and_says_when_to_retry() -> None:
    counters, limits, fleet = TenantCounters(), Limits(tenant="t", rpm=120), workers(2)
    granted = [admit(counters, limits, fleet, 0) for _ in range(60)]  # 120/min over 2 workers: 60 each
    assert dict(granted[-1].headers)[b"x-ratelimit-remaining-requests"] == b"0"
    with pytest.raises(RateLimited) as refused:
        admit(counters, limits, fleet, 0)
    assert refused.value.type == "requests" and refused.value.headers["Retry-After"] == "1"
    assert duration(0.25) == "250ms" and duration(6.5) == "6.5s" and duration(90) == "1m30s"


def test_tokens_are_reserved_on_the_estimate_and_settled_on_usage() -> None:
    counters, limits, fleet = TenantCounters(), Limits(tenant="t", tpm=100), workers(1)
    first = admit(counters, limits, fleet, 90)
    second = admit(counters, limits, fleet, 90)  # admitted: the bucket was not in debt yet
    with pytest.raises(RateLimited) as refused:
        admit(counters, limits, fleet, 1)
    assert refused.value.type == "tokens"
    first.finish(10)
    second.finish(10)  # the answers used far less than estimated: given back
    admit(counters, limits, fleet, 1)


async def test_the_queue_serves_higher_priority_first_then_tenants_by_share() -> None:
    pool = Pool()
    pool.add(static_node(Role.MIXED, "127.0.0.1:9", ("m",)))
    (node,) = pool.all()
    pool.request_started(node)  # the node's one connection is taken: the model is full
    shares = {"big": 2, "small": 1}
    queue = FairQueue(
        pool, QueueSettings(timeout=10, max_connections=1, when_waiting=0), shares.__getitem__, lambda m, c: None
    )

    async def receive() -> dict[str, object]:  # a client that stays: its disconnect never comes
        return await asyncio.get_running_loop().create_future()

    served: list[str] = []

    async def request(name: str, tenant: str, priority: int) -> None:
        assert await queue.enter("m", tenant, priority, receive)
        served.append(name)
        pool.request_started(node)  # as the forwarder does when the request goes out

    order = [
        ("b1", "big", 1),
        ("b2", "big", 1),
        ("b3", "big", 1),
        ("b4", "big", 1),
        ("s1", "small", 1),
        ("s2", "small", 1),
        ("urgent", "small", 0),
    ]
    tasks = [asyncio.create_task(request(*args)) for args in order]
    while queue.depth("m") < len(order):
        await asyncio.sleep(0)
    for _ in order:
        pool.request_ended(node)
        queue.leave("m")
        while pool.all()[0].in_flight == 0:
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert served == ["urgent", "b1", "s1", "b2", "b3", "s2", "b4"]


def test_a_reload_keeps_the_counters_of_a_tenant_that_still_exists() -> None:
    from prometheus_client import CollectorRegistry

    from vllm_etcd_proxy.proxy.tenancy.admission import Tenancy
    from vllm_etcd_proxy.proxy.tenancy.metrics import TenantMetrics

    keys = KeySet()
    keys.set_file(dict([parse_line("a-key tenant=a rpm=2"), parse_line("b-key tenant=b rpm=2")]))
    tenancy = Tenancy(keys, workers(1), None, TenantMetrics(CollectorRegistry()))

    async def admit_one(key: str) -> None:
        await tenancy.admit(keys.check(f"Bearer {key}"), "m", None, 10, _never, _nowhere)

    asyncio.run(admit_one("a-key"))
    asyncio.run(admit_one("a-key"))
    keys.set_file(dict([parse_line("a-key2 tenant=a rpm=2")]))  # a new key of tenant a; tenant b is gone
    with pytest.raises(RateLimited):
        asyncio.run(admit_one("a-key2"))  # tenant a's minute is still spent


async def _never() -> dict[str, object]:
    return await asyncio.get_running_loop().create_future()


async def _nowhere(message: object) -> None:
    pass
