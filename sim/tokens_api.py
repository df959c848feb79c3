"""vLLM's token-level routes: ``POST /inference/v1/generate`` (tokens in, tokens out; vllm/entrypoints/serve/disagg)
and ``GET /tokenizer_info``.

``/inference/v1/generate`` takes ``token_ids`` and ``sampling_params`` (``max_tokens``, ``ignore_eos``, ...) and
answers ``{"id": "generate-tokens-<X-Request-Id or request_id>", "created", "model", "choices": [{"index": 0,
"logprobs": null, "finish_reason", "token_ids"}], "usage", "prompt_logprobs": null, "kv_transfer_params"}``; like
vLLM it does not stream (``stream`` is accepted and ignored).
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.sim import protocol, tokens, vocab
from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.record import Job
from vllm_etcd_proxy.sim.recording import engine_of, json_body, new_record
from vllm_etcd_proxy.sim.sse import answer_whole
from vllm_etcd_proxy.sim.wire import usage


def _sampling(body: dict[str, Any]) -> tuple[int | None, bool]:
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise bad_request("Field required: `sampling_params`.", "sampling_params")
    limit = params.get("max_tokens")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise bad_request("max_tokens must be at least 1, got {limit}.", "max_tokens")
    return limit, bool(params.get("ignore_eos", False))


async def generate(request: Request) -> Response:
    engine, record = engine_of(request), new_record(request)
    settings = engine.settings
    try:
        body = await json_body(request, record)
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        ids = protocol.prompt_ids(body.get("token_ids")) if isinstance(body.get("token_ids"), list) else None
        if not ids:
            raise bad_request("Field required: `token_ids` (a list of token ids).", "token_ids")
        max_tokens, ignore_eos = _sampling(body)
        model = body.get("model")
        record.model = model if isinstance(model, str) else None
        protocol.check_model(model, engine.served_names)
        if len(ids) + (max_tokens or 0) > settings.max_model_len or len(ids) >= settings.max_model_len:
            raise bad_request(
                f"The prompt and max_tokens exceed max_model_len {settings.max_model_len}.", "max_model_len"
            )
        if engine.should_fail():
            raise ApiError(engine.knobs.fail_status, "vllm-sim: injected failure")
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    base = record.request_id or record.body_request_id or uuid.uuid4().hex
    record.id, record.prompt_tokens, record.max_tokens = f"generate-tokens-{base}", len(ids), max_tokens
    answer = tokens.complete(ids, max_tokens=max_tokens, output_len=engine.knobs.output_len, ignore_eos=ignore_eos)
    job = Job(
        record=record,
        prompt=tuple(ids),
        tokens=answer.tokens,
        finish_reason=answer.finish_reason,
        kv_loaded=False,
        cache_salt=record.cache_salt,
    )

    async def collect() -> Response:
        async with aclosing(engine.generate(job)) as stream:
            out = [token async for token in stream]
        choice = {"index": 0, "logprobs": None, "finish_reason": job.finished_as, "token_ids": out}
        return JSONResponse(
            {
                "id": record.id,
                "created": int(time.time()),
                "model": engine.model_name(record.model),
                "choices": [choice],
                "usage": usage(len(ids), len(out)),
                "prompt_logprobs": None,
                "kv_transfer_params": None,
            }
        )

    return await answer_whole(engine, record, collect(), request.receive)


async def tokenizer_info(request: Request) -> Response:
    """vLLM's tokenizer configuration (served there with --enable-tokenizer-info-endpoint)."""
    settings = engine_of(request).settings
    hf = settings.tokenizer is not None  # --tokenizer: the Hugging Face directory's WordPiece
    return JSONResponse(
        {
            "tokenizer_class": "PreTrainedTokenizerFast" if hf else "VllmSimWordTokenizer",
            "model_max_length": settings.max_model_len,
            "vocab_size": len(vocab.vocabulary()) if hf else tokens.VOCAB_SIZE,
            "eos_token": "<|eos|>",
            "special_tokens": list(tokens.SPECIALS[:8]),
        }
    )


ROUTES = [
    Route("/inference/v1/generate", generate, methods=["POST"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
]
