"""NixlConnector semantics for kv_transfer_params (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py).

- Prefill leg (``do_remote_decode: true``): one token, finish_reason "length", and the response carries
  ``kv_transfer_params`` telling the decode node where to pull the KV blocks from.
- Decode leg (``do_remote_prefill: true`` with the prefill's coordinates): served normally, but the prompt's
  KV is "pulled", so the first token comes after one inter-token latency instead of the full ttft.
- A mixed node has no KV connector: like vLLM without --kv-transfer-config it ignores kv_transfer_params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.record import Record
from vllm_etcd_proxy.sim.settings import Role, SimSettings
from vllm_etcd_proxy.sim.wire import Wire

PULL_KEYS = ("remote_engine_id", "remote_host", "remote_port")
"""What a decode node needs to pull KV (NIXL also wants remote_block_ids, empty for a prompt under one block)."""


@dataclass(frozen=True, kw_only=True)
class Leg:
    prefill: bool = False
    """A prefill leg: generate one token and hand the KV over."""
    pulled_from: dict[str, Any] | None = None
    """On a decode leg: the prefill's remote_engine_id, remote_host and remote_port."""


def classify(settings: SimSettings, params: dict[str, Any] | None) -> Leg:
    if not params or settings.role is Role.MIXED:
        return Leg()
    if params.get("do_remote_decode"):
        return Leg(prefill=True)
    if params.get("do_remote_prefill") and all(params.get(k) is not None for k in PULL_KEYS):
        # NixlConnectorScheduler.update_state_after_alloc accepts these; anything less is logged and ignored.
        return Leg(pulled_from={k: params[k] for k in PULL_KEYS})
    return Leg()


def prefill_result(engine: Engine, record: Record, wire: Wire) -> dict[str, Any]:
    """NixlConnectorScheduler.request_finished for a length-capped prefill: where its KV can be read."""
    settings = engine.settings
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": engine.allocate_blocks(record.prompt_tokens),
        "remote_engine_id": settings.engine_id,
        "remote_request_id": wire.engine_request_id,
        "remote_host": settings.kv_host,
        "remote_port": settings.side_channel_port,
        "tp_size": 1,
    }
