"""fleet.etcd against a real etcd: KV, leases, watch, failure translation, endpoints and auth."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support.aio import eventually, holds
from tests.support.etcd_cluster import EtcdCluster
from tests.support.etcd_server import EtcdServer
from tests.support.procs import HOST, free_port
from tests.support.secure_etcd import AuthEtcd, TlsEtcd
from vllm_etcd_proxy.fleet.etcd import (
    Compacted,
    EtcdAuthError,
    EtcdClient,
    EtcdSettings,
    EtcdUnavailable,
    EventType,
    LeaseLost,
    WatchBatch,
    parse_endpoints,
)
from vllm_etcd_proxy.fleet.etcd import client as etcd_client


@pytest.fixture(scope="module")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the tests that neither kill nor reconfigure it (saves a start per test)."""
    root = tmp_path_factory.mktemp("shared-etcd")
    (root / "logs").mkdir()
    server = EtcdServer(root / "data", root / "logs", name="shared")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
async def client(shared_etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with EtcdClient(EtcdSettings(endpoints=(shared_etcd.endpoint,))) as c:
        shared_etcd.etcdctl("del", "", "--from-key")  # every test starts from an empty keyspace
        yield c


@pytest.fixture
async def own_client(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    """A client of the test's own etcd, for tests that kill it."""
    async with EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as c:
        yield c


async def _present(client: EtcdClient, key: str) -> bool:
    return await client.get(key) is not None


async def _absent(client: EtcdClient, key: str) -> bool:
    return await client.get(key) is None


# Endpoints and settings


def test_parse_endpoints_accepts_urls_and_host_port() -> None:
    assert parse_endpoints(" http://127.0.0.1:2379, 127.0.0.1:2380/ ,") == (
        "http://127.0.0.1:2379",
        "127.0.0.1:2380",
    )


@pytest.mark.parametrize("text", ["", " , ", "ftp://127.0.0.1:2379", "http://user:pw@127.0.0.1:2379"])
def test_parse_endpoints_rejects_bad_input(text: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoints(text)


def test_settings_refuse_keepalive_faster_than_etcd_allows() -> None:
    with pytest.raises(ValueError, match="keepalive_time"):
        EtcdSettings(endpoints=("127.0.0.1:2379",), keepalive_time=1.0)


def test_settings_repr_hides_password() -> None:
    settings = EtcdSettings(endpoints=("127.0.0.1:2379",), user="root", password="s3cret")
    assert "s3cret" not in repr(settings)


async def test_connect_names_endpoints_when_none_answers() -> None:
    dead = (f"http://{HOST}:{free_port()}", f"{HOST}:{free_port()}")
    client = EtcdClient(EtcdSettings(endpoints=dead, timeout=1.0))
    with pytest.raises(EtcdUnavailable) as info:
        await client.connect()
    await client.close()
    assert dead[0] in str(info.value) and dead[1] in str(info.value)


# KV


async def test_put_get_delete_round_trip(client: EtcdClient) -> None:
    revision = await client.put("/t/a", "one")
    kv = await client.get("/t/a")
    assert kv is not None and kv.value == b"one" and kv.mod_revision == revision
    assert await client.delete("/t/a") == 1
    assert await client.get("/t/a") is None
    assert await client.delete("/t/a") == 0


async def test_a_conditional_put_or_delete_happens_only_while_the_key_is_unchanged(client: EtcdClient) -> None:
    first = await client.put_if("/t/claim", b"mine", mod_revision=0)
    assert first > 0 and await client.put_if("/t/claim", b"theirs", mod_revision=0) == 0  # it exists now
    assert (await client.get("/t/claim")).value == b"mine"  # type: ignore[union-attr]
    second = await client.put_if("/t/claim", b"changed", mod_revision=first)
    assert second > first and await client.put_if("/t/claim", b"stale", mod_revision=first) == 0
    assert not await client.delete_if("/t/claim", mod_revision=first)
    assert await client.delete_if("/t/claim", mod_revision=second)
    assert await client.get("/t/claim") is None
    lease = await client.grant(5)
    assert await client.put_if("/t/claim", b"leased", mod_revision=0, lease=lease)
    await client.revoke(lease)
    assert await client.get("/t/claim") is None


async def test_get_prefix_pages_through_every_key_at_one_revision(
    client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_client, "_PAGE", 2)
    for i in range(5):
        await client.put(f"/t/p/{i}", str(i))
    latest = await client.put("/t/q", "outside")
    revision, kvs = await client.get_prefix("/t/p/")
    assert [kv.key for kv in kvs] == [f"/t/p/{i}".encode() for i in range(5)]
    assert revision == latest


# Leases


async def test_keep_alive_keeps_key_beyond_its_ttl(client: EtcdClient) -> None:
    lease = await client.grant(2)
    await client.put("/t/leased", "x", lease=lease)
    refreshed: list[int] = []
    task = asyncio.create_task(client.keep_alive(lease, 2, refreshed.append))
    try:
        await holds(lambda: _present(client, "/t/leased"), 4.0, "leased key present")
        assert refreshed and all(ttl > 0 for ttl in refreshed)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_key_vanishes_after_ttl_when_keep_alive_stops(client: EtcdClient) -> None:
    lease = await client.grant(2)
    await client.put("/t/leased", "x", lease=lease)
    refreshed: list[int] = []
    task = asyncio.create_task(client.keep_alive(lease, 2, refreshed.append))
    await eventually(lambda: bool(refreshed), 3.0, "first refresh")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await eventually(lambda: _absent(client, "/t/leased"), 5.0, "leased key expired")
    assert await client.time_to_live(lease) == -1


async def test_revoke_deletes_leased_keys_and_tolerates_a_gone_lease(client: EtcdClient) -> None:
    lease = await client.grant(30)
    await client.put("/t/leased", "x", lease=lease)
    assert 0 < await client.time_to_live(lease) <= 30
    await client.revoke(lease)
    assert await client.get("/t/leased") is None
    await client.revoke(lease)
    assert await client.time_to_live(lease) == -1


async def test_keep_alive_raises_lease_lost_when_revoked_elsewhere(shared_etcd: EtcdServer, client: EtcdClient) -> None:
    lease = await client.grant(3)
    task = asyncio.create_task(client.keep_alive(lease, 3))
    shared_etcd.etcdctl("lease", "revoke", f"{lease:x}")
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task, 5.0)


async def test_keep_alive_raises_lease_lost_when_etcd_is_gone_longer_than_ttl(
    etcd: EtcdServer, own_client: EtcdClient
) -> None:
    lease = await own_client.grant(2)
    refreshed: list[int] = []
    task = asyncio.create_task(own_client.keep_alive(lease, 2, refreshed.append))
    await eventually(lambda: bool(refreshed), 3.0, "first refresh")
    etcd.kill()
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(task, 6.0)


# Watch

WRITES = [("put", "/w/a", "1"), ("put", "/w/b", "2"), ("delete", "/w/a", ""), ("put", "/w/b", "3")]
"""A scripted sequence; the watch must report it in this order."""


async def _collect(client: EtcdClient, start: int, count: int) -> list[WatchBatch]:
    batches: list[WatchBatch] = []
    seen = 0
    async with contextlib.aclosing(client.watch_prefix("/w/", start)) as watch:
        async for batch in watch:
            batches.append(batch)
            seen += len(batch.events)
            if seen >= count:
                return batches
    raise AssertionError("watch ended")


async def test_watch_sees_puts_and_deletes_in_order(client: EtcdClient) -> None:
    start = await client.put("/x/before", "ignored") + 1
    for op, key, value in WRITES:
        await (client.put(key, value) if op == "put" else client.delete(key))
    await client.put("/x/outside", "ignored")
    batches = await asyncio.wait_for(_collect(client, start, len(WRITES)), 5.0)
    assert batches[0].created and not batches[0].events
    events = [e for b in batches for e in b.events]
    assert [(e.type, e.kv.key, e.kv.value) for e in events] == [
        (EventType.PUT, b"/w/a", b"1"),
        (EventType.PUT, b"/w/b", b"2"),
        (EventType.DELETE, b"/w/a", b""),
        (EventType.PUT, b"/w/b", b"3"),
    ]
    assert batches[-1].revision >= events[-1].kv.mod_revision


async def test_watch_from_compacted_revision_raises_compacted(client: EtcdClient, shared_etcd: EtcdServer) -> None:
    first = await client.put("/w/a", "1")
    last = await client.put("/w/a", "2")
    shared_etcd.etcdctl("compact", str(last))
    with pytest.raises(Compacted) as info:
        await asyncio.wait_for(_collect(client, first, 1), 5.0)
    assert info.value.compact_revision == last


async def test_watch_raises_unavailable_when_etcd_dies(etcd: EtcdServer, own_client: EtcdClient) -> None:
    created = asyncio.Event()

    async def watch() -> None:
        async for batch in own_client.watch_prefix("/w/", 1):
            if batch.created:
                created.set()

    task = asyncio.create_task(watch())
    await asyncio.wait_for(created.wait(), 5.0)
    etcd.kill()
    with pytest.raises(EtcdUnavailable):
        await asyncio.wait_for(task, 5.0)


# Several endpoints


async def test_unary_calls_and_keep_alive_fail_over_when_a_member_dies(cluster: EtcdCluster) -> None:
    async with EtcdClient(EtcdSettings(endpoints=cluster.endpoints, timeout=2.0)) as client:
        assert client.current_endpoint == cluster.endpoints[0]
        # A TTL that outlasts a leader election on a loaded machine (the client gives a lease up once no refresh
        # succeeded within its TTL); held for longer than the TTL, so only a keep-alive that failed over keeps it.
        lease = await client.grant(6)
        await client.put("/f/a", "1", lease=lease)
        refreshed: list[int] = []
        keeper = asyncio.create_task(client.keep_alive(lease, 6, refreshed.append))
        try:
            await eventually(lambda: bool(refreshed), 3.0, "first refresh")
            cluster.members[0].kill()
            await client.put("/f/b", "2")
            assert client.current_endpoint != cluster.endpoints[0]
            _, kvs = await client.get_prefix("/f/")
            assert [kv.value for kv in kvs] == [b"1", b"2"]
            await holds(lambda: _present(client, "/f/a"), 8.0, "leased key kept alive through another member")
            assert not keeper.done()
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper


async def test_keep_alive_survives_an_etcd_restart_shorter_than_the_ttl(
    etcd: EtcdServer, own_client: EtcdClient
) -> None:
    lease = await own_client.grant(6)
    await own_client.put("/l/k", "v", lease=lease)
    refreshed: list[int] = []
    keeper = asyncio.create_task(own_client.keep_alive(lease, 6, refreshed.append))
    try:
        await eventually(lambda: bool(refreshed), 3.0, "first refresh")
        etcd.kill()
        etcd.stop()
        etcd.start()
        count = len(refreshed)
        await eventually(lambda: len(refreshed) > count, 6.0, "refresh after the restart")
        assert await own_client.get("/l/k") is not None
        assert not keeper.done()
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper


# Auth and TLS (servers in tests/support/secure_etcd.py)


@pytest.fixture
def auth_etcd(tmp_path: Path, logs_dir: Path) -> Iterator[AuthEtcd]:
    server = AuthEtcd(tmp_path / "auth-data", logs_dir, name="auth")
    try:
        server.start()
        server.etcdctl("user", "add", "root:s3cret")
        server.etcdctl("auth", "enable")
        yield server
    finally:
        server.stop()


async def test_auth_token_is_sent_and_renewed_when_etcd_rejects_it(
    auth_etcd: AuthEtcd, caplog: pytest.LogCaptureFixture
) -> None:
    settings = EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root", password="s3cret")
    async with EtcdClient(settings) as client:
        await client.put("/a/k", "v")
        await asyncio.sleep(3.0)  # the behaviour under test: the token expires while the client is idle
        with caplog.at_level("INFO", logger="vllm_etcd_proxy.fleet.etcd.client"):
            assert await client.put("/a/k", "w") > 0
        assert "authenticating again" in caplog.text
        assert "s3cret" not in caplog.text


async def test_wrong_password_or_no_credentials_raise_auth_error(auth_etcd: AuthEtcd) -> None:
    wrong = EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root", password="nope")
    with pytest.raises(EtcdAuthError):
        async with EtcdClient(wrong):
            pass
    async with EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,))) as anonymous:
        with pytest.raises(EtcdAuthError):
            await anonymous.put("/a/k", "v")


async def test_tls_with_client_certificate(tls_etcd: TlsEtcd) -> None:
    c = tls_etcd.certs
    settings = EtcdSettings(
        endpoints=(tls_etcd.endpoint,), cacert=c["cacert"], cert=c["client_cert"], key=c["client_key"]
    )
    async with EtcdClient(settings) as client:
        await client.put("/tls/k", "v")
        kv = await client.get("/tls/k")
        assert kv is not None and kv.value == b"v"
    untrusted = EtcdSettings(endpoints=(tls_etcd.endpoint,), timeout=1.0)
    with pytest.raises(EtcdUnavailable):
        async with EtcdClient(untrusted):
            pass
