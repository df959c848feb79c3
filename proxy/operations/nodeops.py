"""Node operations from any replica (admin key): vLLM's node-admin routes sent to one node or to every node of a
model, the ones load balancing never sends.

``POST /admin/nodes/{node_id}/{op}`` and ``POST /admin/models/{model}/{op}`` (a model name may hold slashes), with
``op`` one of ``OPS``. The query string and the body go to each node as given (vLLM's ``level`` and ``mode`` of
``/sleep``, ``tags`` of ``/wake_up``, the JSON of ``/v1/load_lora_adapter``). ``sleep`` drains the node first and
``wake_up`` clears its sleep mark (sleep/). The answer lists each node's status and body: 200 when every node
answered 2xx, else 502 (the list says which failed). Every call is logged: the client, the operation, the nodes,
each status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from vllm_etcd_proxy.proxy.discovery.pool import NodeState, Pool
from vllm_etcd_proxy.proxy.errors import ModelNotFound, NotFound
from vllm_etcd_proxy.proxy.serving.parsing import BodyLimits, read_body
from vllm_etcd_proxy.proxy.sleep.calls import NodeAnswer, NodeCalls, Query
from vllm_etcd_proxy.proxy.sleep.sleeper import Sleeper
from vllm_etcd_proxy.proxy.sleep.waker import Waker

log = logging.getLogger(__name__)

OPS = (
    "sleep",
    "wake_up",
    "reset_prefix_cache",
    "start_profile",
    "stop_profile",
    "load_lora_adapter",
    "unload_lora_adapter",
)
_PATHS = {"load_lora_adapter": "/v1/load_lora_adapter", "unload_lora_adapter": "/v1/unload_lora_adapter"}
OPERATION_BODY = BodyLimits(max_bytes=64 * 1024, timeout=10.0)


class NodeOpsRoutes:
    def __init__(
        self,
        pool: Pool,
        calls: NodeCalls,
        sleeper: Sleeper,
        waker: Waker,
        authorize: Callable[[Request], None],
    ) -> None:
        self._pool, self._calls, self._sleeper, self._waker = pool, calls, sleeper, waker
        self._authorize = authorize

    def routes(self) -> list[Route]:
        return [
            Route("/admin/nodes/{node_id}/{op}", self.by_node, methods=["POST"]),
            Route("/admin/models/{model:path}/{op}", self.by_model, methods=["POST"]),
        ]

    async def by_node(self, request: Request) -> Response:
        self._authorize(request)
        op, node_id = _op(request), request.path_params["node_id"]
        nodes = [s for s in self._pool.all() if node_id in (s.node.node_id, s.node.host_port)]
        if not nodes:
            raise NotFound(f"no node {node_id!r} is known to this replica (GET /list_workers lists them)")
        return await self._run(request, op, f"node {node_id}", nodes)

    async def by_model(self, request: Request) -> Response:
        self._authorize(request)
        op, model = _op(request), request.path_params["model"]
        nodes = [s for s in self._pool.all() if model in s.models]
        if not nodes:
            known = ", ".join(sorted({m for s in self._pool.all() for m in s.models})) or "none"
            raise ModelNotFound(f"no node serves model {model!r}. Known models: {known}.", param="model")
        return await self._run(request, op, f"model {model}", nodes)

    async def _run(self, request: Request, op: str, target: str, nodes: list[NodeState]) -> Response:
        length = request.headers.get("content-length", "")
        body = await read_body(request.receive, int(length) if length.isdigit() else None, OPERATION_BODY)
        query = list(request.query_params.multi_items())
        answers = await asyncio.gather(*(self._one(op, state, query, body) for state in nodes))
        ok = all(a.ok for a in answers)
        log.info(
            "node operation op=%s target=%s client=%s nodes=%d results=%s outcome=%s",
            op,
            target,
            request.client.host if request.client else "?",
            len(answers),
            ",".join(f"{a.node_id}:{a.status}" for a in answers),
            "ok" if ok else "failed",
        )
        view = {"op": op, "target": target, "nodes": [a.view() for a in answers]}
        return Response(orjson.dumps(view), status_code=200 if ok else 502, media_type="application/json")

    async def _one(self, op: str, state: NodeState, query: Query, body: bytes) -> NodeAnswer:
        if op == "sleep":
            return await self._sleeper.sleep(state, query, reason="admin")
        if op == "wake_up":
            return await self._waker.wake(state, query, reason="admin")
        answer = await self._calls.post(state, _PATHS.get(op, f"/{op}"), query, body)
        if answer.ok and op in _PATHS:
            self._adapter_changed(state, op, body)
        return answer

    def _adapter_changed(self, state: NodeState, op: str, body: bytes) -> None:
        """A LoRA adapter loaded or unloaded by hand: routed to (or away from) the node from now on."""
        try:
            name = orjson.loads(body).get("lora_name")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if isinstance(name, str) and name:
            self._pool.set_adapter_loaded(state, name, op == "load_lora_adapter")


def _op(request: Request) -> str:
    op: str = request.path_params["op"]
    if op not in OPS:
        raise NotFound(f"no node operation {op!r}: one of {', '.join(OPS)}")
    return op
