"""vLLM's Responses API routes, with the per-node in-memory store that ``previous_response_id`` needs.

As vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``: ``store`` (default true) keeps a response, its input messages
and its events in this node's memory only, so another node answers 404 for its id and a follow-up turn must come
back here. Routes:

- ``POST /v1/responses``: JSON, or SSE with ``stream``; ``background`` answers at once with status ``queued``
  (streamed: the events as they come) while the generation runs on; ``previous_response_id`` unknown here -> 404.
- ``GET /v1/responses/{id}``: the stored response; ``?stream=true&starting_after=N`` replays its events after
  sequence number N, then follows a running one to its end.
- ``POST /v1/responses/{id}/cancel``: a queued or in-progress background response becomes ``cancelled`` and its
  generation is aborted; any other -> 400 ``Cannot cancel a synchronous response.``
- ``DELETE /v1/responses/{id}``: not in vLLM; answered as OpenAI does, ``{"id", "object": "response", "deleted":
  true}``, aborting a running generation.

vLLM keeps events only for background streams; the simulator keeps them for every stored response, so a test can
replay any of them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vllm_etcd_proxy.sim import protocol, tokens
from vllm_etcd_proxy.sim import responses_wire as wire
from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import ApiError, bad_request
from vllm_etcd_proxy.sim.middleware import ClientGone, until_disconnect
from vllm_etcd_proxy.sim.record import Job, Record
from vllm_etcd_proxy.sim.recording import engine_of, json_body, new_record
from vllm_etcd_proxy.sim.response_store import Event, Stored
from vllm_etcd_proxy.sim.sse import CLIENT_CLOSED, SSEResponse


def _store(request: Request) -> dict[str, Stored]:
    store: dict[str, Stored] = request.app.state.responses
    return store


@dataclass(frozen=True, kw_only=True)
class Run:
    """A validated turn, ready to generate (POST /v1/responses, or a response.create on the WebSocket)."""

    turn: wire.Turn
    job: Job
    messages: wire.Messages
    model: str
    max_tokens: int
    created: int = field(default_factory=wire.now)

    def response(self, status: str, output: list[Event], use: dict[str, Any] | None) -> dict[str, Any]:
        return wire.response_object(
            self.turn,
            model=self.model,
            created=self.created,
            status=status,
            max_tokens=self.max_tokens,
            output=output,
            use=use,
        )


def prepare(engine: Engine, store: dict[str, Stored], record: Record, body: Any) -> Run:
    settings = engine.settings
    turn = wire.parse_turn(body)
    record.id, record.model, record.stream = turn.id, turn.model, turn.stream
    protocol.check_model(turn.model, engine.served_names)
    previous = None
    if turn.previous_response_id is not None:
        previous = store.get(turn.previous_response_id)
        if previous is None:
            raise wire.not_found(turn.previous_response_id)
    messages = wire.conversation(
        turn, previous.messages if previous else None, wire.output_text(previous.response) if previous else None
    )
    prompt = tokens.render_chat(
        messages, add_generation_prompt=True, continue_final_message=False, encoder=engine.encode
    )
    if len(prompt) >= settings.max_model_len:
        raise bad_request(
            f"The engine prompt length {len(prompt)} exceeds the max_model_len "
            f"{settings.max_model_len}. Please reduce prompt.",
            "input",
        )
    room = settings.max_model_len - len(prompt)
    max_tokens = min(turn.max_output_tokens, room) if turn.max_output_tokens else room
    record.prompt_tokens, record.max_tokens = len(prompt), max_tokens
    if engine.should_fail():
        raise ApiError(engine.knobs.fail_status, "vllm-sim: injected failure")
    answer = tokens.complete(prompt, max_tokens=max_tokens, output_len=engine.knobs.output_len)
    job = Job(
        record=record,
        prompt=tuple(prompt),
        tokens=answer.tokens,
        finish_reason=answer.finish_reason,
        kv_loaded=False,
        cache_salt=record.cache_salt,
    )
    return Run(turn=turn, job=job, messages=messages, model=engine.model_name(turn.model), max_tokens=max_tokens)


async def run_events(
    engine: Engine, run: Run, on_accept: Callable[[], Awaitable[None]] | None = None
) -> AsyncGenerator[Event, None]:
    """The response's events, generating as they go; the last is response.completed or an error."""
    events, record = wire.Events(), run.job.record
    opening = run.response("in_progress", [], None)
    yield events.make("response.created", response=opening)
    yield events.make("response.in_progress", response=opening)
    item_id, text = f"msg_{uuid.uuid4().hex}", ""
    try:
        async with aclosing(engine.generate(run.job, on_accept=on_accept)) as stream:
            async for token in stream:
                if not text:
                    for event in events.opening(item_id):
                        yield event
                piece = tokens.token_text(token)
                text += piece
                yield events.text_delta(item_id, piece)
    except ApiError as exc:
        yield events.error(exc)
        return
    output = []
    if text:
        for event in events.closing(item_id, text):
            yield event
        output = [wire.message_item(item_id, text)]
    # vLLM: "length" -> incomplete; an aborted generation is cancelled (its harmony path's mapping).
    status = {"length": "incomplete", "abort": "cancelled"}.get(run.job.finished_as, "completed")
    use = wire.usage(record.prompt_tokens, record.completion_tokens, record.cached_tokens)
    yield events.make("response.completed", response=run.response(status, output, use))


def take_final(stored: Stored, event: Event) -> None:
    """Take a response's last event into its stored object (a cancelled one stays cancelled)."""
    if stored.response["status"] == "cancelled":
        return
    if event["type"] == "response.completed":
        stored.response = event["response"]
    elif event["type"] == "error":
        stored.response = {**stored.response, "status": "failed"}


async def create(request: Request) -> Response:
    engine, record, store = engine_of(request), new_record(request), _store(request)
    try:
        run = prepare(engine, store, record, await json_body(request, record))
    except ApiError as exc:
        engine.reject(record, exc.status)
        raise
    if run.turn.background:
        return _background(engine, store, run)
    stored = Stored(response=run.response("in_progress", [], None), messages=run.messages)
    if run.turn.stream:
        return _streamed(engine, store, run, stored, record)
    try:
        response = await until_disconnect(_collected(engine, store, run, stored), request.receive)
    except ClientGone:
        response = Response(status_code=CLIENT_CLOSED)
    record.status = response.status_code
    engine.log(record)
    return response


def _streamed(engine: Engine, store: dict[str, Stored], run: Run, stored: Stored, record: Record) -> Response:
    """The response's events as they come (SSE); the last one ends ``stored``."""

    async def events(start: Callable[[], Awaitable[None]]) -> AsyncGenerator[str, None]:
        await start()  # vLLM sends response.created before the engine has the request
        async for event in run_events(engine, run):
            stored.add(event)
            if event["type"] in ("response.completed", "error"):
                _keep(store, run, stored, event)
            yield wire.sse(event)

    return SSEResponse(events, engine, record, {})


async def _collected(engine: Engine, store: dict[str, Stored], run: Run, stored: Stored) -> Response:
    """The whole response once it is generated (JSON); a failed one answers its error."""
    async with aclosing(run_events(engine, run)) as stream:
        async for event in stream:
            stored.add(event)
    last = stored.events[-1]
    if last["type"] == "error":
        return JSONResponse(ApiError(int(last["code"]), last["message"]).body(), status_code=int(last["code"]))
    _keep(store, run, stored, last)
    return JSONResponse(stored.response)


def _keep(store: dict[str, Stored], run: Run, stored: Stored, last: Event) -> None:
    """End ``stored`` with the response's ``last`` event, and keep it under its id when the turn asks (``store``)."""
    take_final(stored, last)
    stored.finish()
    if run.turn.store:
        store[run.turn.id] = stored


def _background(engine: Engine, store: dict[str, Stored], run: Run) -> Response:
    """Store the response as queued and generate it in a task of its own; the client may leave at once."""
    turn, record = run.turn, run.job.record
    stored = store[turn.id] = Stored(response=run.response("queued", [], None), messages=run.messages)

    async def accepted() -> None:
        if stored.response["status"] == "queued":
            stored.response = {**stored.response, "status": "in_progress"}

    async def generate() -> None:
        try:
            async with aclosing(run_events(engine, run, accepted)) as stream:
                async for event in stream:
                    stored.add(event)
                    take_final(stored, event)
        finally:
            stored.finish()
            engine.log(record)

    stored.task = asyncio.get_running_loop().create_task(generate(), name=f"background {turn.id}")
    record.status = 200
    if not turn.stream:
        return JSONResponse(stored.response)

    async def follow(start: Callable[[], Awaitable[None]]) -> AsyncGenerator[str, None]:
        await start()
        async for event in stored.tail(-1):
            yield wire.sse(event)

    return SSEResponse(follow, engine, record, {})


def _lookup(request: Request) -> tuple[Engine, Record, Stored | None, str]:
    engine, record = engine_of(request), new_record(request)
    response_id = request.path_params["response_id"]  # in the record's path; its id names created responses only
    return engine, record, _store(request).get(response_id), response_id


async def retrieve(request: Request) -> Response:
    engine, record, stored, response_id = _lookup(request)
    if stored is None:
        engine.reject(record, 404)
        raise wire.not_found(response_id)
    if request.query_params.get("stream", "false").lower() not in ("true", "1"):
        record.status, record.state = 200, "done"
        engine.log(record)
        return JSONResponse(stored.response)
    try:
        after = int(request.query_params.get("starting_after", "-1"))
    except ValueError:
        engine.reject(record, 400)
        raise bad_request("`starting_after` must be an integer.", "starting_after") from None
    record.stream, found = True, stored

    async def replay(start: Callable[[], Awaitable[None]]) -> AsyncGenerator[str, None]:
        await start()
        async for event in found.tail(after):
            yield wire.sse(event)
        record.state = "done"

    return SSEResponse(replay, engine, record, {})


async def _abort(stored: Stored) -> None:
    task = stored.task
    if task is not None and not task.done():
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task


async def cancel(request: Request) -> Response:
    engine, record, stored, response_id = _lookup(request)
    if stored is None:
        engine.reject(record, 404)
        raise wire.not_found(response_id)
    if stored.response["status"] not in ("queued", "in_progress"):
        engine.reject(record, 400)
        raise ApiError(400, "Cannot cancel a synchronous response.", type="invalid_request_error", param="response_id")
    stored.response = {**stored.response, "status": "cancelled"}
    await _abort(stored)
    record.status, record.state = 200, "done"
    engine.log(record)
    return JSONResponse(stored.response)


async def delete(request: Request) -> Response:
    engine, record, stored, response_id = _lookup(request)
    if stored is None:
        engine.reject(record, 404)
        raise wire.not_found(response_id)
    del _store(request)[response_id]
    await _abort(stored)
    record.status, record.state = 200, "done"
    engine.log(record)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


ROUTES = [
    Route("/v1/responses", create, methods=["POST"]),
    Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
    Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
]
