"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models of every routable node, each with its model card.

A card is what the nodes' own ``/v1/models`` says of the model (``root``, ``parent``, ``max_model_len``,
``permission``, ...), from the node records or from asking the node. Where nodes disagree, the card of the node
with the smallest node id is taken (so every replica shows the same), except ``max_model_len``, the smallest of all
(a prompt sized by it fits whichever node serves it), and ``created``, the earliest. A model no node gave a card
for gets the plain OpenAI entry.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.fleet.vllm import ModelCard
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


class ModelRoutes:
    def __init__(self, pool: Pool, keys: ClientKeys) -> None:
        self._pool = pool
        self._keys = keys

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
        return {model: merge_cards(model, [c for _, c in sorted(found[model], key=lambda p: p[0]) if c is not None],
                                   now) for model in sorted(found)}  # fmt: skip

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
