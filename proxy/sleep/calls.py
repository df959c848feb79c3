"""Calls to one node's own admin routes (vLLM's ``/sleep``, ``/wake_up``, ``/reset_prefix_cache``, ...) and the
load a drain waits on, through the control plane's HTTP client; answers as ``NodeAnswer``s, never exceptions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from vllm_etcd_proxy.fleet.vllm import read_node_load
from vllm_etcd_proxy.proxy.discovery.pool import NodeState

OPERATION_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
"""A wake reloads weights, a LoRA load may fetch from a hub, a sleep with mode=wait waits for the engine to drain."""
LOAD_TIMEOUT = httpx.Timeout(5.0, connect=5.0)
_MAX_BODY = 64 * 1024

Query = Sequence[tuple[str, str]]


@dataclass(frozen=True, kw_only=True)
class NodeAnswer:
    """What one node answered to an operation (``status`` None: it could not be reached; ``error`` says why)."""

    node_id: str
    role: str
    status: int | None
    body: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def view(self) -> dict[str, Any]:
        view: dict[str, Any] = {"node": self.node_id, "role": self.role, "status": self.status, "body": self.body}
        if self.error is not None:
            view["error"] = self.error
        return view


def refused(state: NodeState, error: str) -> NodeAnswer:
    """An operation the proxy did not send (or stopped) for ``error``."""
    return NodeAnswer(node_id=state.node.node_id, role=state.node.role.value, status=None, error=error)


class NodeCalls:
    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str] | None) -> None:
        self._client = client
        self._headers = headers or {}

    async def post(self, state: NodeState, path: str, query: Query = (), body: bytes = b"") -> NodeAnswer:
        """``POST {node}{path}?{query}`` with ``body`` (JSON when given)."""
        node = state.node
        headers = {**self._headers, **({"content-type": "application/json"} if body else {})}
        try:
            response = await self._client.post(
                f"{node.url}{path}", params=list(query), content=body, headers=headers, timeout=OPERATION_TIMEOUT
            )
        except httpx.HTTPError as exc:
            return refused(state, f"{type(exc).__name__}: {exc}"[:300])
        return NodeAnswer(node_id=node.node_id, role=node.role.value, status=response.status_code, body=_body(response))

    async def load(self, state: NodeState) -> int | None:
        """Running plus waiting requests by the node's own /metrics (every replica's); None when unknown."""
        try:
            response = await self._client.get(f"{state.node.url}/metrics", headers=self._headers, timeout=LOAD_TIMEOUT)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        load = read_node_load(response.content)
        return None if load is None else load[0] + load[1]


def _body(response: httpx.Response) -> Any:
    """The answer's JSON, else its text (bounded); None when empty."""
    content = response.content[:_MAX_BODY]
    if not content:
        return None
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode("utf-8", "replace")
