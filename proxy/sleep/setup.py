"""Builds the sleep-mode parts of one replica from its settings (app.py calls ``build_sleep`` once)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from vllm_etcd_proxy.fleet.etcd import EtcdClient
from vllm_etcd_proxy.proxy.discovery.claims import Claims
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.settings import ProxySettings
from vllm_etcd_proxy.proxy.sleep.calls import NodeCalls
from vllm_etcd_proxy.proxy.sleep.idle import IdleSleeper
from vllm_etcd_proxy.proxy.sleep.marks import SleepMarks
from vllm_etcd_proxy.proxy.sleep.metrics import SleepMetrics
from vllm_etcd_proxy.proxy.sleep.ondemand import WakeOnDemand
from vllm_etcd_proxy.proxy.sleep.sleeper import Sleeper
from vllm_etcd_proxy.proxy.sleep.waker import Waker

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SleepParts:
    calls: NodeCalls
    sleeper: Sleeper
    waker: Waker
    on_demand: WakeOnDemand | None
    """None without --wake-on-demand: the request path has no such layer."""
    tasks: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    """Background work for the lifespan: the idle sleeper, with --sleep-after-idle."""


def build_sleep(
    settings: ProxySettings,
    pool: Pool,
    client: httpx.AsyncClient,
    etcd: EtcdClient | None,
    claims: Claims,
    registry: CollectorRegistry,
    *,
    headers: dict[str, str] | None,
    base_of: Callable[[str], str],
    me: str,
) -> SleepParts:
    metrics = SleepMetrics(registry)
    calls = NodeCalls(client, headers)
    marks = SleepMarks(pool, etcd)
    sleeper = Sleeper(pool, calls, marks, metrics, drain_timeout=settings.sleep_drain_timeout)
    waker = Waker(pool, calls, marks, metrics)
    parts = SleepParts(calls=calls, sleeper=sleeper, waker=waker, on_demand=None)
    if settings.wake_on_demand:
        parts.on_demand = WakeOnDemand(
            pool, waker, claims, metrics, timeout=settings.wake_timeout, base_of=base_of, me=me
        )
    if settings.sleep_after_idle:
        if not settings.min_awake and not settings.wake_on_demand:
            log.warning("--min-awake 0 without --wake-on-demand: a model whose nodes all sleep stays unavailable")
        idle = IdleSleeper(
            pool,
            sleeper,
            claims,
            after=dict(settings.sleep_after_idle),
            min_awake=settings.min_awake,
            level=settings.sleep_level,
        )
        parts.tasks.append(idle.run)
    return parts
