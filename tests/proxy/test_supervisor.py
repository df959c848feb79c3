"""Background loops under the replica's supervisor, on a real node: a loop whose inner call fails with an
unexpected exception is logged at once with its traceback, counted, and comes back doing its work."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tests.support.aio import eventually
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.fleet.records import Node, Role, Source
from vllm_etcd_proxy.proxy.discovery.loadwatch import LoadWatcher
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.supervisor import Supervisor
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics
from vllm_etcd_proxy.proxy.upstream.transport import HttpTransport, UpstreamRequest, UpstreamResponse


class FailsOnce:
    """The load scrape's transport, whose first send raises what no code of ours expects."""

    def __init__(self, real: HttpTransport) -> None:
        self.real, self.calls = real, 0

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug in the scrape")
        return await self.real.send(request)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    with SimNode(tmp_path_factory.mktemp("supervisor"), "supervised-node") as sim:
        yield sim


async def test_a_loop_that_fails_is_logged_counted_and_restarted(
    node: SimNode, caplog: pytest.LogCaptureFixture
) -> None:
    pool = Pool()
    pool.add(Node(node_id=node.host_port, role=Role.MIXED, url=node.url, models=("sim-model",), source=Source.STATIC))
    state = pool.all()[0]
    metrics = ProxyMetrics(CollectorRegistry())
    transport = FailsOnce(HttpTransport(connect_timeout=2.0, max_connections=1))
    supervisor = Supervisor(metrics.task_crashes)
    with caplog.at_level(logging.ERROR, logger="vllm_etcd_proxy.proxy.supervisor"):
        supervisor.start("load-watcher", LoadWatcher(pool, transport, 0.05, None).run)
        try:
            await eventually(lambda: state.load_at is not None, 10, "a scrape after the restart")
        finally:
            await supervisor.stop()
            transport.real.close()
    assert transport.calls >= 2
    assert metrics.task_crashes.labels("load-watcher")._value.get() == 1
    (failed,) = [r for r in caplog.records if "background task failed task=load-watcher" in r.getMessage()]
    assert failed.exc_info is not None
    assert "RuntimeError: a bug in the scrape" in logging.Formatter().formatException(failed.exc_info)


async def test_stopping_cancels_every_loop() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    supervisor = Supervisor(metrics.task_crashes)
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    supervisor.start("forever", forever)
    await started.wait()
    await supervisor.stop()
    assert metrics.task_crashes.labels("forever")._value.get() == 0
