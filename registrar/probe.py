"""What the registrar asks the vLLM node over HTTP: health, served models, version, load.

Every httpx error becomes a ``ProbeError`` here (``NodeUnreachable`` when nothing listens), so the runner
deals in answers, not transports.
"""

from __future__ import annotations

import json
import ssl
from types import TracebackType
from typing import Any

import httpx

from vllm_etcd_proxy.fleet.httpclient import stateless_client
from vllm_etcd_proxy.fleet.tls import TLS_HINT, is_tls_failure
from vllm_etcd_proxy.fleet.vllm import RUNNING, WAITING, ModelCard, parse_model_cards, read_node_load
from vllm_etcd_proxy.registrar.errors import NodeUnreachable, ProbeError

LOAD_METRICS = (RUNNING, WAITING)
"""Gauges whose sum is the node's load; drained means this sum is 0."""


def parse_load(text: str) -> int:
    """running + waiting requests from Prometheus text, summed over label sets (engines, models)."""
    load = read_node_load(text.encode())
    if load is None:
        raise ProbeError(f"/metrics has none of {', '.join(LOAD_METRICS)}")
    return load[0] + load[1]


class NodeProbe:
    """HTTP client for one node; use as an async context manager."""

    def __init__(self, base_url: str, *, timeout: float, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: the client context for an ``https://`` node (fleet/tls.py); None: the system's CAs."""
        self.cards: tuple[ModelCard, ...] = ()
        """The entries of the last GET /v1/models, as the node gave them."""
        self._base_url = base_url
        # trust_env=False: the node sits next to us; an HTTP(S)_PROXY meant for the outside must not apply.
        self._http = stateless_client(base_url=base_url, timeout=timeout, verify=tls or True)

    async def __aenter__(self) -> NodeProbe:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get(self, path: str) -> httpx.Response:
        try:
            response = await self._http.get(path)
        except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
            hint = f" ({TLS_HINT})" if is_tls_failure(exc) else ""
            raise NodeUnreachable(f"{self._base_url}{path}: {exc or type(exc).__name__}{hint}") from None
        except httpx.HTTPError as exc:
            raise ProbeError(f"{self._base_url}{path}: {type(exc).__name__} {exc}".rstrip()) from None
        if response.status_code != 200:
            raise ProbeError(f"{self._base_url}{path}: HTTP {response.status_code}")
        return response

    async def _get_json(self, path: str) -> Any:
        response = await self._get(path)
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ProbeError(f"{self._base_url}{path}: body is not JSON") from None

    async def check_health(self) -> None:
        """Return if GET /health answers 200; raise ``ProbeError`` otherwise."""
        await self._get("/health")

    async def models(self) -> tuple[str, ...]:
        """Served model ids (base models and loaded LoRA adapters) from GET /v1/models; their entries as the node
        gave them are kept in ``cards``."""
        try:
            self.cards = parse_model_cards(await self._get_json("/v1/models"))
        except ValueError as exc:
            raise ProbeError(str(exc)) from None
        return tuple(card["id"] for card in self.cards)

    async def version(self) -> str:
        """The server's version from GET /version (vLLM has it), or "" when it does not tell."""
        try:
            body = await self._get_json("/version")
        except ProbeError:
            return ""
        version = body.get("version") if isinstance(body, dict) else None
        return version if isinstance(version, str) else ""

    async def load(self) -> int:
        """running + waiting requests from GET /metrics."""
        return parse_load((await self._get("/metrics")).text)
