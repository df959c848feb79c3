"""etcd for the scale benchmark: the server's command line, the nodes' keys and values, and the burst of puts.

Every node is ``127.0.0.1:PORT`` on a port where nothing listens, so each contact a replica makes is refused at
once: the benchmark measures what the replicas do with the registrations, never a node's answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.procs import HOST
from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdSettings
from vllm_etcd_proxy.fleet.records import KeyLayout, Role

ROLES = (Role.MIXED, Role.MIXED, Role.PREFILL, Role.DECODE)
"""Half the nodes mixed, a quarter each prefill and decode."""
LOW_PORT, HIGH_PORT = 1025, 32767
"""Below Linux's ephemeral range, where the kernel picks no port of its own for an outgoing connection."""


def etcd_command(data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://{HOST}:{client_port}", f"http://{HOST}:{peer_port}"
    return [
        "etcd",
        "--name",
        "bench",
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"bench={peer}",
        "--log-level",
        "warn",
    ]


def listening_ports() -> set[int]:
    """Loopback and wildcard TCP ports in LISTEN state now (from /proc/net/tcp and tcp6)."""
    ports = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def idle_ports(count: int) -> list[int]:
    """``count`` loopback ports where nothing listens now."""
    busy = listening_ports()
    ports = [p for p in range(LOW_PORT, HIGH_PORT + 1) if p not in busy][:count]
    if len(ports) < count:
        raise ValueError(f"only {len(ports)} idle ports between {LOW_PORT} and {HIGH_PORT}")
    return ports


@dataclass(frozen=True, kw_only=True)
class Registrations:
    """The keys and values of one burst."""

    items: Sequence[tuple[str, bytes]]

    @classmethod
    def make(cls, layout: KeyLayout, ports: Sequence[int], models: int, bare_every: int) -> Registrations:
        """One key per port: roles cycle through ``ROLES``, models through ``models`` names; every
        ``bare_every``-th key is bare (empty value: the replica asks the node for its models)."""
        items = []
        for i, port in enumerate(ports):
            role, node_id = ROLES[i % len(ROLES)], f"{HOST}:{port}"
            if bare_every and i % bare_every == bare_every - 1:
                items.append((layout.key(role, node_id), b""))
                continue
            record = {
                "url": f"http://{node_id}",
                "role": role.value,
                "models": [f"model-{i % models}"],
                "status": "serving",
                "source": "registrar",
                "version": "bench",
            }
            items.append((layout.key(role, node_id), json.dumps(record).encode()))
        return cls(items=items)


@dataclass(frozen=True, kw_only=True)
class Burst:
    seconds: float
    """From the first put sent to the last one answered."""
    last_revision: int
    failed: int


async def _put_all(endpoint: str, registrations: Registrations, parallel: int) -> Burst:
    async with EtcdClient(EtcdSettings(endpoints=(endpoint,))) as client:
        lease = await client.grant(3600)
        items = iter(registrations.items)
        last, failed = 0, 0

        async def worker() -> None:
            nonlocal last, failed
            for key, value in items:
                try:
                    last = max(last, await client.put(key, value, lease=lease))
                except Exception:  # noqa: BLE001 - counted and reported, the burst goes on
                    failed += 1

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(parallel)))
        return Burst(seconds=time.monotonic() - started, last_revision=last, failed=failed)


def put_all(endpoint: str, registrations: Registrations, parallel: int) -> Burst:
    """Put every key under one lease, ``parallel`` puts in flight (as many registrars starting at once)."""
    return asyncio.run(_put_all(endpoint, registrations, parallel))
