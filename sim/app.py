"""The simulated node's HTTP API: vLLM's OpenAI-compatible routes plus /sim/* controls for tests.

Routes: GET /health, /ping, /load, /metrics, /version, /v1/models; POST /v1/completions, /v1/chat/completions,
/tokenize, /detokenize; those of ``responses`` and ``responses_ws`` (the Responses API), ``audio``, ``realtime``,
``pooling``, ``tokens_api``, ``anthropic`` and ``admin`` (node-admin); GET|POST /sim/config; GET|DELETE
/sim/requests. Any other request is recorded, then 404 as FastAPI answers (vLLM has no GET /v1/models/{id}).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Scope

from vllm_etcd_proxy.sim import (
    admin,
    anthropic,
    audio,
    disagg,
    pooling,
    protocol,
    realtime,
    responses,
    responses_ws,
    tokens,
    tokens_api,
)
from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.metrics import make_registry
from vllm_etcd_proxy.sim.middleware import ApiKey, NodeHeader, Scaling
from vllm_etcd_proxy.sim.protocol import GenRequest, Kind
from vllm_etcd_proxy.sim.record import Job
from vllm_etcd_proxy.sim.recording import engine_of, json_body, new_record, raw_body
from vllm_etcd_proxy.sim.settings import SimSettings
from vllm_etcd_proxy.sim.sse import SSEResponse, answer_whole
from vllm_etcd_proxy.sim.wire import DONE_EVENT, Wire, model_list, usage


async def _generate(request: Request, kind: Kind) -> Response:
    engine = engine_of(request)
    settings = engine.settings
    record = new_record(request)
    try:
        req = protocol.parse(kind, await json_body(request, record), engine.encode)
        record.model, record.stream, record.prompt_tokens = req.model, req.stream, req.prompt_tokens
        record.max_tokens, record.kv_transfer_params = req.max_tokens, req.kv_transfer_params
        protocol.check_model(req.model, engine.served_names)
        protocol.check_context(req, settings.max_model_len)
        wire = Wire(req, record.request_id or req.body_request_id, engine.model_name(req.model))
        record.id = wire.id
        if engine.should_fail():
            raise ApiError(engine.knobs.fail_status, "vllm-sim: injected failure")
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    leg = disagg.classify(settings, req.kv_transfer_params)
    # A prefill leg computes the prompt and one token (the decode leg's first token too, the answer being a
    # function of the context).
    answer = tokens.complete(
        req.prompt_ids,
        max_tokens=1 if leg.prefill else req.max_tokens,
        output_len=engine.knobs.output_len,
        ignore_eos=req.ignore_eos,
    )
    job = Job(
        record=record,
        prompt=req.prompt_ids,
        tokens=answer.tokens,
        finish_reason=answer.finish_reason,
        kv_loaded=leg.pulled_from is not None,
        cache_salt=record.cache_salt,
        adapter=req.model if req.model in engine.loras else None,
    )
    record.prefill = leg.pulled_from
    headers = {"x-sim-prefill-engine": leg.pulled_from["remote_engine_id"]} if leg.pulled_from else {}
    if engine.knobs.set_cookie:
        headers["set-cookie"] = engine.knobs.set_cookie
    if req.stream:
        return SSEResponse(lambda start: _events(engine, job, req, wire, start), engine, record, headers)

    async def collect() -> Response:
        generated: list[int] = []
        async with aclosing(engine.generate(job)) as stream:
            async for token in stream:
                generated.append(token)
        kv = disagg.prefill_result(engine, record, wire) if leg.prefill else None
        body = wire.full(generated, job.finished_as, usage(req.prompt_tokens, len(generated)), kv)
        return JSONResponse(body, headers=headers)

    return await answer_whole(engine, record, collect(), request.receive)


async def _events(
    engine: Engine, job: Job, req: GenRequest, wire: Wire, start: Callable[[], Awaitable[None]]
) -> AsyncGenerator[str, None]:
    """The SSE body: [role chunk] token chunks (finish_reason on the last) [usage chunk] [DONE].

    An answer that ends at once (its context already at EOS), or that an aborting sleep cuts short, ends with an
    empty chunk carrying finish_reason ("abort" for the latter)."""
    role = wire.role_event(usage(req.prompt_tokens, 0) if req.continuous_usage else None)
    last = len(job.tokens) - 1
    sent = 0
    try:
        async with aclosing(engine.generate(job, on_accept=start)) as stream:
            async for token in stream:
                if sent == 0 and role is not None:
                    yield role
                sent += 1
                use = usage(req.prompt_tokens, sent) if req.continuous_usage else None
                yield wire.token_event([token], job.finish_reason if sent - 1 == last else None, use, sent == 1)
        if not job.tokens or job.finished_as == "abort":
            if sent == 0 and role is not None:
                yield role
            use = usage(req.prompt_tokens, sent) if req.continuous_usage else None
            yield wire.token_event([], job.finished_as, use, sent == 0)
    except ApiError as exc:
        yield wire.error_event(exc)
        yield DONE_EVENT
        return
    if req.include_usage:
        yield wire.usage_event(usage(req.prompt_tokens, job.record.completion_tokens))
    yield DONE_EVENT


async def completions(request: Request) -> Response:
    return await _generate(request, Kind.COMPLETION)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, Kind.CHAT)


async def health(request: Request) -> Response:
    engine = engine_of(request)
    settings = engine.settings
    starting = time.monotonic() - engine.started_at < settings.startup_delay
    flipped = settings.unhealthy_file is not None and settings.unhealthy_file.exists()
    return Response(status_code=503 if starting or flipped else 200)


async def load(request: Request) -> Response:
    """vLLM's GET /load (--enable-server-load-tracking): requests in flight."""
    engine = engine_of(request)
    return JSONResponse({"server_load": engine.running + engine.waiting})


async def models(request: Request) -> Response:
    engine = engine_of(request)
    settings = engine.settings
    return JSONResponse(
        model_list(settings.models, settings.max_model_len, settings.root, engine.loras, engine.adapters.parents)
    )


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)


async def version(request: Request) -> Response:
    return JSONResponse({"version": "0.11.0+sim"})


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a ``prompt`` text, or ``messages`` rendered by the chat template."""
    engine, record = engine_of(request), new_record(request)
    try:
        body = await json_body(request, record)
        ids = protocol.tokenize_ids(body, engine.encode)
        protocol.check_model(body.get("model"), engine.served_names)
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    record.status, record.state, record.prompt_tokens = 200, "done", len(ids)
    engine.log(record)
    strs = [tokens.token_text(t) for t in ids] if body.get("return_token_strs") is True else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": engine.settings.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: Request) -> Response:
    """vLLM's /detokenize: the text of token ids (each token's word after a space)."""
    engine, record = engine_of(request), new_record(request)
    try:
        body = await json_body(request, record)
        ids = protocol.detokenize_ids(body)
        protocol.check_model(body.get("model"), engine.served_names)
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    record.status, record.state = 200, "done"
    engine.log(record)
    return JSONResponse({"prompt": tokens.decode(ids)})


async def unknown_route(request: Request) -> Response:
    """Recorded so proxy tests can see what was forwarded; 404 in FastAPI's shape, as vLLM answers."""
    engine, record = engine_of(request), new_record(request)
    await raw_body(request, record)
    engine.reject(record, 404)
    return JSONResponse({"detail": "Not Found"}, status_code=404)


async def sim_config(request: Request) -> Response:
    """GET: identity and knobs. POST: change knobs, e.g. ``{"ttft": 1.0, "hang": true}``."""
    engine = engine_of(request)
    if request.method == "POST":
        try:
            changes = json.loads(await request.body())
            if not isinstance(changes, dict):
                raise ValueError("expected a JSON object of knobs")
            engine.apply_knobs(changes)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
    settings = engine.settings
    return JSONResponse(
        {
            "node_id": settings.name,
            "role": str(settings.role),
            "engine_id": settings.engine_id,
            "models": list(settings.models),
            **vars(engine.knobs),
        }
    )


async def sim_requests(request: Request) -> Response:
    """GET: counters and recent requests. DELETE: forget the recent requests (counters stay)."""
    engine = engine_of(request)
    if request.method == "DELETE":
        engine.records.clear()
    return JSONResponse(engine.snapshot())


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(settings: SimSettings) -> Starlette:
    """A new node: its own engine and metrics registry, nothing shared with other apps in the process."""
    engine = Engine(settings)

    def refused(scope: Scope) -> None:
        engine.reject(new_record(HTTPConnection(scope)), 503)

    middleware = [
        Middleware(NodeHeader, node_id=settings.name),
        Middleware(Scaling, is_scaling=lambda: engine.knobs.scaling, refused=refused),
    ]
    if settings.api_key:
        middleware.append(Middleware(ApiKey, key=settings.api_key))
    routes = [
        Route("/health", health),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/load", load),
        Route("/metrics", metrics),
        Route("/version", version),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/sim/config", sim_config, methods=["GET", "POST"]),
        Route("/sim/requests", sim_requests, methods=["GET", "DELETE"]),
        *responses.ROUTES,
        *audio.ROUTES,
        *realtime.ROUTES,
        *responses_ws.ROUTES,
        *pooling.ROUTES,
        *tokens_api.ROUTES,
        *anthropic.ROUTES,
        *admin.ROUTES,
        *(admin.DEV_ROUTES if settings.dev_mode else ()),
        *(admin.LORA_ROUTES if settings.runtime_lora_updating else ()),
        Route("/{path:path}", unknown_route, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        publisher = engine.kv_events
        replay = asyncio.create_task(publisher.serve_replay()) if publisher is not None else None
        try:
            yield
        finally:
            if replay is not None:
                replay.cancel()
                await asyncio.gather(replay, return_exceptions=True)
            if publisher is not None:
                publisher.close()
            engine.gpu.release()

    app = Starlette(routes=routes, middleware=middleware, exception_handlers={ApiError: api_error}, lifespan=lifespan)
    app.state.engine = engine
    app.state.responses = {}
    app.state.realtime = {}
    app.state.registry = make_registry(engine)
    return app
