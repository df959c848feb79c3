"""vLLM's disaggregated prefill -> decode exchange (NixlConnector and KV-pool connectors alike).

1. Prefill leg: the client's body with max_tokens=1, stream=false, no stream_options/min_tokens, and
   ``kv_transfer_params`` asking the prefill node to keep the KV cache for a remote decode.
2. Decode leg: the client's body plus the prefill answer's ``kv_transfer_params``, copied verbatim.
Both legs carry the same X-Request-Id. Each leg is retried on its own by the forwarder.

The legs go to prefill and decode nodes by their roles' policies; a request that routing/elastic.py split between
``both`` nodes (``request.plan``) goes to the nodes it ranked, the decode leg never to the node that prefilled.

Bodies are touched as little as possible: the decode leg is the client's own bytes with one field spliced in
before the closing brace; only the prefill leg is re-encoded (orjson: UTF-8 as it came, no ``\\u`` escapes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import orjson

from vllm_etcd_proxy.fleet.records import Role
from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.errors import UpstreamFailed, UpstreamTimeout
from vllm_etcd_proxy.proxy.serving.bodies import with_field
from vllm_etcd_proxy.proxy.serving.forwarder import ErrorAnswer, Forwarder, Leg, Upstream, Work
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest
from vllm_etcd_proxy.proxy.serving.usage import usage_of

log = logging.getLogger(__name__)

PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_DROPPED_FOR_PREFILL = frozenset(
    ["stream_options", "min_tokens", "min_completion_tokens", "max_tokens", "stream", "kv_transfer_params"]
)
_MAX_PREFILL_ANSWER = 16 * 1024 * 1024


def prefill_body(body: Mapping[str, Any]) -> bytes:
    """The prefill leg's body: generate one token, do not stream, keep the KV cache for a remote decode."""
    leg = {k: v for k, v in body.items() if k not in _DROPPED_FOR_PREFILL}
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg["kv_transfer_params"] = PREFILL_KV_TRANSFER_PARAMS
    return orjson.dumps(leg)


def decode_body(raw: bytes, body: Mapping[str, Any], kv_transfer_params: Any) -> bytes:
    """The decode leg's body: the client's, plus what the prefill node answered, verbatim."""
    if kv_transfer_params is None:
        if "kv_transfer_params" not in body:
            return raw
        return orjson.dumps({k: v for k, v in body.items() if k != "kv_transfer_params"})
    return with_field(raw, body, "kv_transfer_params", kv_transfer_params)


class DisaggregatedFlow:
    """Runs the two legs of one request and returns the decode node's open response."""

    __slots__ = ("mode", "_forwarder", "_first_byte", "_prefill")

    def __init__(
        self, forwarder: Forwarder, first_byte_timeout: float, prefill_timeout: float, mode: str = "disagg"
    ) -> None:
        self.mode = mode
        self._forwarder = forwarder
        self._first_byte = first_byte_timeout
        self._prefill = prefill_timeout

    async def open(self, request: ProxyRequest, avoid: tuple[NodeState, ...] = ()) -> Upstream | ErrorAnswer:
        body = request.body
        assert body is not None  # the generate routes' JSON
        prefilled = await self._prefill_leg(request, body)
        if isinstance(prefilled, (Upstream, ErrorAnswer)):
            return prefilled
        kv, node = prefilled
        plan = request.plan
        order = [s for s in plan.decode if s is not node] if plan is not None else None
        leg = Leg(
            roles=(Role.DECODE,),
            body=decode_body(request.raw, body, kv),
            timeout=self._first_byte,
            work=Work.DECODE,
            order=order,
        )
        return await self._forwarder.open(request, leg, avoid)

    async def _prefill_leg(
        self, request: ProxyRequest, body: Mapping[str, Any]
    ) -> tuple[Any, NodeState] | Upstream | ErrorAnswer:
        """Returns the prefill answer's kv_transfer_params and the node that gave it, or the node's answer to pass
        on (an error, or a 4xx the client is to see: prompt too long, a bad parameter)."""
        total, plan = self._prefill, request.plan
        leg = Leg(
            roles=(Role.PREFILL,),
            body=prefill_body(body),
            timeout=total,
            deadline=time.monotonic() + total,
            work=Work.PREFILL,
            order=plan.prefill if plan is not None else None,
        )
        try:
            answer = await self._forwarder.open(request, leg)
        except UpstreamTimeout:
            raise UpstreamTimeout(f"prefill leg did not finish within {total:g} s") from None
        if isinstance(answer, ErrorAnswer) or answer.status != 200:
            return answer
        outcome = "broken"
        try:
            raw = await answer.read_all(_MAX_PREFILL_ANSWER)
            outcome = "ok"
            answer.span.usage(usage_of(raw)[0], None)  # its one token is not the answer's
        finally:
            answer.close(outcome)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise UpstreamFailed("prefill node answered something that is not JSON") from None
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if kv is None:
            log.warning(
                "prefill answer has no kv_transfer_params node=%s; decode will recompute the prompt",
                answer.state.node.node_id,
            )
        return kv, answer.state
