"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models of every routable node, each with its model card.

A card is what the nodes' own ``/v1/models`` says of the model (``root``, ``parent``, ``max_model_len``,
``permission``, ...), from the node records or from asking the node. Where nodes disagree, the card of the node
with the smallest node id is taken (so every replica shows the same), except ``max_model_len``, the smallest of all
(a prompt sized by it fits whichever node serves it), and ``created``, the earliest. A model no node gave a card
for gets the plain OpenAI entry. LoRA adapters registered in etcd whose base model is served are listed too.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.fleet.adapters import Adapter
from vllm_etcd_proxy.fleet.vllm import ModelCard
from vllm_etcd_proxy.proxy.discovery.adapters import AdapterRegistry
from vllm_etcd_proxy.proxy.discovery.pool import Pool
from vllm_etcd_proxy.proxy.errors import ModelNotFound
from vllm_etcd_proxy.proxy.serving.guard import ClientKeys


def merge_cards(model: str, cards: list[ModelCard], now: int) -> dict[str, Any]:
    """One card for ``model`` from its nodes' cards, ordered by node id (see the module docstring)."""
    if not cards:
        return {"id": model, "object": "model", "created": now, "owned_by": "vllm"}
    merged = dict(cards[0])
    for name in ("max_model_len", "created"):
        values = [c[name] for c in cards if isinstance(c.get(name), int) and not isinstance(c.get(name), bool)]
        if values:
            merged[name] = min(values)
    merged["id"] = model
    return merged


def adapter_card(adapter: Adapter, now: int) -> dict[str, Any]:
    """A registered LoRA adapter no node lists yet, as vLLM lists an adapter (``root`` its path)."""
    return {
        "id": adapter.name,
        "object": "model",
        "created": now,
        "owned_by": "vllm",
        "root": adapter.path,
        "parent": adapter.base,
        "max_model_len": None,
    }


class ModelRoutes:
    def __init__(self, pool: Pool, keys: ClientKeys, adapters: AdapterRegistry | None = None) -> None:
        self._pool = pool
        self._keys = keys
        self._adapters = adapters

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.one_model, methods=["GET"]),
        ]

    def cards(self) -> dict[str, dict[str, Any]]:
        """Every model a routable node serves, by name (sorted), with its merged card."""
        found: dict[str, list[tuple[str, ModelCard | None]]] = {}
        for state in self._pool.all():
            if state.routable:
                cards = state.cards
                for model in state.models:
                    found.setdefault(model, []).append((state.node.node_id, cards.get(model)))
        now = int(time.time())
        merged = {
            model: merge_cards(model, [c for _, c in sorted(found[model], key=lambda p: p[0]) if c is not None], now)
            for model in sorted(found)
        }
        # Registered adapters of a base model the fleet serves, loaded somewhere or not (issue 19).
        extra = [a for a in (self._adapters.all() if self._adapters else ()) if a.base in found and a.name not in found]
        if not extra:
            return merged
        merged.update((a.name, adapter_card(a, now)) for a in extra)
        return dict(sorted(merged.items()))

    async def list_models(self, request: Request) -> Response:
        self._keys.check(request.headers.get("authorization"))
        return JSONResponse({"object": "list", "data": list(self.cards().values())})

    async def one_model(self, request: Request) -> Response:
        self._keys.check(request.headers.get("authorization"))
        model = request.path_params["model"]
        cards = self.cards()
        if model not in cards:
            known = ", ".join(cards) or "none"
            raise ModelNotFound(f"The model `{model}` does not exist. Known models: {known}.", param="model")
        return JSONResponse(cards[model])
