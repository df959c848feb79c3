"""vLLM's pooling-model routes, enough to prove what a router forwards: each body is recorded and answered in
vLLM's shape (vllm/entrypoints/pooling/*/protocol.py) with deterministic numbers derived from the text.

- ``POST /v1/embeddings`` (``input``): ``{"id": "embd-...", "object": "list", "created", "model", "data": [{"index",
  "object": "embedding", "embedding"}], "usage"}``; ``/pooling`` the same with ``"object": "pooling"`` and ``data``.
- ``POST /classify`` (``input``): data items ``{"index", "label", "probs", "num_classes", "object":
  "classification"}``.
- ``POST /score``, ``/v1/score`` (``text_1``, ``text_2``): data items ``{"index", "object": "score", "score"}``.
- ``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (``query``, ``documents``, ``top_n``): ``{"id": "rerank-...",
  "model", "usage": {"prompt_tokens", "total_tokens"}, "results": [{"index", "document": {"text"},
  "relevance_score"}]}``, best first.
- ``POST /v2/embed`` (Cohere's ``texts``): ``{"id", "embeddings": {"float": [...]}, "texts", "meta"}``.

They hold while the node sleeps, as generation does (vLLM's pooling routes need the weights too).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from hashlib import blake2b
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.sim import protocol, tokens
from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.recording import engine_of, json_body, new_record

DIMENSIONS = 8


def _unit(text: str, salt: str = "") -> float:
    """A number in [0, 1) that depends only on ``text``."""
    digest = blake2b(f"{salt}\0{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def _vector(text: str) -> list[float]:
    raw = [_unit(text, str(i)) - 0.5 for i in range(DIMENSIONS)]
    norm = sum(x * x for x in raw) ** 0.5 or 1.0
    return [round(x / norm, 6) for x in raw]


def _texts(value: Any, field: str) -> list[str]:
    """A text, a list of texts, token ids or a list of those, each as the text the vector is made from."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [tokens.decode(value)]
    if isinstance(value, list) and value and all(isinstance(t, str | list | dict) for t in value):
        return [
            t if isinstance(t, str) else str(t.get("text", "")) if isinstance(t, dict) else tokens.decode(t)
            for t in value
        ]
    raise bad_request(f"`{field}` must be a string, a list of strings or token ids.", field)


def _usage(texts: list[str]) -> dict[str, Any]:
    count = sum(len(tokens.encode(t)) for t in texts)
    return {"prompt_tokens": count, "total_tokens": count, "completion_tokens": 0, "prompt_tokens_details": None}


def _listing(prefix: str, model: str, data: list[dict[str, Any]], texts: list[str]) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": _usage(texts),
    }


def embeddings(body: dict[str, Any], model: str) -> dict[str, Any]:
    texts = _texts(body.get("input"), "input")
    data = [{"index": i, "object": "embedding", "embedding": _vector(t)} for i, t in enumerate(texts)]
    return _listing("embd", model, data, texts)


def pooling(body: dict[str, Any], model: str) -> dict[str, Any]:
    texts = _texts(body.get("input"), "input")
    data = [{"index": i, "object": "pooling", "data": _vector(t)} for i, t in enumerate(texts)]
    return _listing("pool", model, data, texts)


def classify(body: dict[str, Any], model: str) -> dict[str, Any]:
    texts = _texts(body.get("input"), "input")
    data = []
    for i, text in enumerate(texts):
        p = round(_unit(text), 6)
        data.append(
            {
                "index": i,
                "label": "LABEL_1" if p >= 0.5 else "LABEL_0",
                "probs": [round(1 - p, 6), p],
                "num_classes": 2,
                "object": "classification",
            }
        )
    return _listing("classify", model, data, texts)


def score(body: dict[str, Any], model: str) -> dict[str, Any]:
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise bad_request("text_1 and text_2 must have the same length, or text_1 one item.", "text_1")
    data = [
        {"index": i, "object": "score", "score": round(_unit(b, a), 6)}
        for i, (a, b) in enumerate(zip(first, second, strict=True))
    ]
    return _listing("score", model, data, first + second)


def rerank(body: dict[str, Any], model: str) -> dict[str, Any]:
    query = _texts(body.get("query"), "query")[0]
    documents = _texts(body.get("documents"), "documents")
    scored = sorted(((round(_unit(d, query), 6), i, d) for i, d in enumerate(documents)), key=lambda s: -s[0])
    results = [{"index": i, "document": {"text": d}, "relevance_score": s} for s, i, d in scored]
    top_n = body.get("top_n") or 0
    if isinstance(top_n, int) and top_n > 0:
        results = results[:top_n]
    count = _usage([query, *documents])["prompt_tokens"]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model,
        "usage": {"prompt_tokens": count, "total_tokens": count},
        "results": results,
    }


def cohere_embed(body: dict[str, Any], model: str) -> dict[str, Any]:
    texts = _texts(body.get("texts"), "texts")
    return {
        "id": uuid.uuid4().hex,
        "embeddings": {"float": [_vector(t) for t in texts]},
        "texts": texts,
        "meta": {"api_version": {"version": "2"}, "billed_units": {"input_tokens": _usage(texts)["prompt_tokens"]}},
        "response_type": "embeddings_by_type",
    }


Handler = Callable[[dict[str, Any], str], dict[str, Any]]


def _route(path: str, handler: Handler) -> Route:
    async def endpoint(request: Request) -> Response:
        engine: Engine = engine_of(request)
        record = new_record(request)
        try:
            body = await json_body(request, record)
            if not isinstance(body, dict):
                raise bad_request("The request body must be a JSON object.")
            model = body.get("model")
            record.model = model if isinstance(model, str) else None
            protocol.check_model(model, engine.served_names)
            answer = handler(body, engine.model_name(record.model))
            await engine.until_awake(record)
            if engine.should_fail():
                raise ApiError(engine.knobs.fail_status, "vllm-sim: injected failure")
        except ApiError as exc:
            engine.reject(record, exc.status)
            raise
        record.status, record.state = 200, "done"
        engine.log(record)
        return JSONResponse(answer)

    return Route(path, endpoint, methods=["POST"])


ROUTES = [
    _route("/v1/embeddings", embeddings),
    _route("/pooling", pooling),
    _route("/classify", classify),
    _route("/score", score),
    _route("/v1/score", score),
    _route("/rerank", rerank),
    _route("/v1/rerank", rerank),
    _route("/v2/rerank", rerank),
    _route("/v2/embed", cohere_embed),
]
