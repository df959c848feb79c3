"""Fixtures for the fault scenarios: a fleet on one real etcd, or on a three-member etcd cluster.

Every test starts its own etcd and fleet (the scenarios break things) and stops them whatever happens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults.fleet import Etcd, Fleet
from tests.support.etcd_cluster import EtcdCluster
from tests.support.etcd_server import EtcdServer
from tests.support.loop_thread import LoopThread
from tests.support.tcp_relay import TcpRelay


@pytest.fixture
def fleet(etcd: EtcdServer, logs_dir: Path) -> Iterator[Fleet]:
    """Not started: a test calls ``fleet.start(...)`` with the shape it needs."""
    started = Fleet(Etcd(etcd.endpoint), logs_dir)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def cluster_fleet(cluster: EtcdCluster, logs_dir: Path) -> Iterator[Fleet]:
    """A fleet whose registrars and replicas know all three members; a longer TTL rides out the election."""
    started = Fleet(Etcd(",".join(cluster.endpoints)), logs_dir, ttl=5)
    try:
        yield started
    finally:
        started.stop()


@dataclass(frozen=True)
class EtcdRelay:
    """A TCP relay in front of the test's etcd: give ``endpoint`` to a process, then ``cut()`` its link (loud) or
    ``partition()`` it (silent)."""

    loop: LoopThread
    relay: TcpRelay

    @property
    def endpoint(self) -> str:
        return self.relay.endpoint

    def cut(self) -> None:
        self.loop.run(self.relay.cut())

    def restore(self) -> None:
        self.loop.run(self.relay.restore())

    def partition(self) -> None:
        """Silently drop every byte from now on; connections stay open (see ``TcpRelay.partition``)."""
        self.loop.run(self.relay.partition())

    def heal(self) -> None:
        self.loop.run(self.relay.heal())


@pytest.fixture
def etcd_relay(etcd: EtcdServer) -> Iterator[EtcdRelay]:
    with LoopThread("etcd-relay") as loop:
        relay = TcpRelay(etcd.client_port)
        loop.run(relay.start())
        try:
            yield EtcdRelay(loop, relay)
        finally:
            loop.run(relay.cut())  # closes every relayed connection while the loop still runs
