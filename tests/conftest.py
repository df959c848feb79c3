"""Fixtures that start real processes on loopback and always stop them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.etcd_cluster import EtcdCluster
from tests.support.etcd_server import EtcdServer
from tests.support.secure_etcd import TlsEtcd, make_certs

T = TypeVar("T")


@pytest.fixture
def logs_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


@pytest.fixture
def cluster(tmp_path: Path, logs_dir: Path) -> Iterator[EtcdCluster]:
    """A three-member etcd cluster on loopback."""
    members = EtcdCluster(tmp_path / "cluster", logs_dir)
    try:
        members.start()
        yield members
    finally:
        members.stop()


@pytest.fixture
def tls_etcd(tmp_path: Path, logs_dir: Path) -> Iterator[TlsEtcd]:
    """etcd serving https only and requiring a client certificate; ``.certs`` has the CA and client files."""
    assert shutil.which("openssl"), "openssl makes the test certificates (.ci/run installs it)"
    server = TlsEtcd(tmp_path / "tls-data", logs_dir, name="tls-etcd")
    server.certs = make_certs(tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd(tmp_path: Path, logs_dir: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd-data", logs_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Reaper:
    """Stops every process handed to it at the end of the test, whatever happened: ``reg = reap(Registrar(...))``."""

    def __init__(self) -> None:
        self._procs: list[Any] = []

    def __call__(self, proc: T) -> T:
        self._procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self._procs):
            proc.stop()


@pytest.fixture
def reap() -> Iterator[Reaper]:
    reaper = Reaper()
    try:
        yield reaper
    finally:
        reaper.stop_all()
