"""Fixtures that start real processes on loopback and always stop them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.etcd_server import EtcdServer


@pytest.fixture
def logs_dir(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


@pytest.fixture
def etcd(tmp_path: Path, logs_dir: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path / "etcd-data", logs_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
