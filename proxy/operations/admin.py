"""The admin API of the elastic-proxy seed: /instances/add and /instances/remove.

Closed by default: with no admin key configured both answer 403. With etcd, a change is written to etcd
(a key without a lease, ``source: admin``) so every replica sees it; without etcd it edits this replica's
pool in memory. Messages are the seed's, so existing scripts keep working.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdError
from vllm_etcd_proxy.fleet.pb import node_record_pb2
from vllm_etcd_proxy.fleet.records import InvalidRecord, KeyLayout, Node, Role, Source, encode_record, split_host_port
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.discovery.prober import fetch_models
from vllm_etcd_proxy.proxy.errors import BadRequest, Forbidden, ServiceUnavailable, Unauthorized
from vllm_etcd_proxy.proxy.serving.guard import bearer_token
from vllm_etcd_proxy.proxy.serving.parsing import BodyLimits, parse_object, read_body
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AdminRequest:
    role: Role
    instance: str


def check_admin_key(request: Request, admin_key: str | None) -> None:
    """403 when the admin API is disabled, 401 when the key is missing or wrong (compared in constant time)."""
    if not admin_key:
        raise Forbidden("the admin API is disabled: set ADMIN_API_KEY (or --admin-key) to enable it")
    given = request.headers.get("x-api-key") or bearer_token(request.headers.get("authorization"))
    if given is None:
        raise Unauthorized("admin key required in X-Api-Key or Authorization: Bearer")
    if not hmac.compare_digest(given.encode(), admin_key.encode()):
        raise Unauthorized("admin key is not valid")


ADMIN_BODY = BodyLimits(max_bytes=64 * 1024, timeout=10.0)


async def parse_admin_body(request: Request) -> AdminRequest:
    length = request.headers.get("content-length", "")
    declared = int(length) if length.isdigit() else None
    body = parse_object(await read_body(request.receive, declared, ADMIN_BODY))
    kind, instance = body.get("type"), body.get("instance")
    if kind not in {r.value for r in Role}:
        raise BadRequest("Invalid instance type: 'type' must be prefill, decode or mixed.", param="type")
    if not isinstance(instance, str):
        raise BadRequest("'instance' must be a host:port string", param="instance")
    try:
        split_host_port(instance)
    except InvalidRecord as exc:
        raise BadRequest(f"Invalid instance: {exc}", param="instance") from None
    return AdminRequest(role=Role(kind), instance=instance)


async def check_allowed(instance: str, allowed: tuple[IPv4Network | IPv6Network, ...]) -> None:
    """403 unless every address ``instance`` resolves to lies in one of the ``allowed`` networks."""
    if not allowed:
        return
    host, port = split_host_port(instance)
    host = host.strip("[]")
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise BadRequest(f"Invalid instance: cannot resolve {host!r}", param="instance") from None
    addresses = {ip_address(info[4][0]) for info in infos}
    if not addresses or not all(any(a in net for net in allowed) for a in addresses):
        raise Forbidden(f"instance {instance} is outside the networks allowed by --admin-allow-cidr")


class AdminRoutes:
    def __init__(
        self,
        *,
        pool: Pool,
        client: httpx.AsyncClient,
        admin_key: str | None,
        etcd: EtcdClient | None,
        layout: KeyLayout,
        models: tuple[str, ...],
        metrics: ProxyMetrics,
        allowed: tuple[IPv4Network | IPv6Network, ...] = (),
        backend_auth: dict[str, str] | None = None,
    ) -> None:
        self._allowed = allowed
        self._backend_auth = backend_auth
        self._pool = pool
        self._client = client
        self._admin_key = admin_key
        self._etcd = etcd
        self._layout = layout
        self._models = models
        self._metrics = metrics

    def routes(self) -> list[Route]:
        return [
            Route("/instances/add", self.add, methods=["POST"]),
            Route("/instances/remove", self.remove, methods=["POST"]),
        ]

    def authorize(self, request: Request) -> None:
        try:
            check_admin_key(request, self._admin_key)
        except (Forbidden, Unauthorized) as exc:
            self._metrics.admin_denied.inc()
            client = request.client.host if request.client else "?"
            log.warning("admin request refused path=%s client=%s reason=%s", request.url.path, client, exc.code)
            raise

    async def add(self, request: Request) -> Response:
        self.authorize(request)
        req = await parse_admin_body(request)
        await check_allowed(req.instance, self._allowed)
        url = f"http://{req.instance}"
        try:
            served = tuple(card["id"] for card in await fetch_models(self._client, url, self._backend_auth))
            up = True
        except (httpx.HTTPError, ValueError):
            served, up = (), False
        if self._etcd is not None:
            record = node_record_pb2.NodeRecord(url=url, role=req.role.value, status="serving", source="admin")
            try:
                await self._etcd.put(self._layout.key(req.role, req.instance), encode_record(record))
            except EtcdError as exc:
                raise ServiceUnavailable(f"could not write to etcd: {exc}") from None
        else:
            node = Node(
                node_id=req.instance,
                role=req.role,
                url=url,
                models=self._models,
                source=Source.ADMIN,
                learn_models=not self._models,
            )
            if not self._pool.add(node):
                log.info("%s_instance %s already exists.", req.role.value, req.instance)
        self._metrics.admin_changes.labels("add").inc()
        if not up or (self._models and not set(self._models) & set(served)):
            log.info("Waiting for %s_instance %s to start.", req.role.value, req.instance)
            return JSONResponse({"message": f"Waiting for {req.role.value}_instance {req.instance} to start."})
        log.info("Added %s to %s_instances.", req.instance, req.role.value)
        return JSONResponse({"message": f"Added {req.instance} to {req.role.value}_instances."})

    async def remove(self, request: Request) -> Response:
        self.authorize(request)
        req = await parse_admin_body(request)
        removed = False
        if self._etcd is not None:
            keys = {s.node.key for s in self._pool.find(req.role, req.instance) if s.node.key is not None}
            keys.add(self._layout.key(req.role, req.instance))
            try:
                for key in keys:
                    removed = bool(await self._etcd.delete(key)) or removed
            except EtcdError as exc:
                raise ServiceUnavailable(f"could not write to etcd: {exc}") from None
        for state in self._pool.find(req.role, req.instance, memory_only=True):
            self._pool.remove(state)
            removed = True
        if not removed:
            return JSONResponse({"message": f"Instance {req.instance} is not in the {req.role.value}_instances."})
        self._metrics.admin_changes.labels("remove").inc()
        log.info("Removed %s from %s_instances.", req.instance, req.role.value)
        return JSONResponse({"message": f"Removed {req.instance} from {req.role.value}_instances."})
