"""vLLM's Responses API WebSocket mode, ``ws /v1/responses`` (vllm/entrypoints/openai/responses/websocket.py).

The client sends ``{"type": "response.create", ...}`` with the fields of a POST /v1/responses body; the server
answers with the same events as the SSE stream, each a JSON text frame (response.created ... response.completed).
``previous_response_id`` must name the last response of this connection (else an error
``previous_response_not_found``, status 404); events are handled one at a time; ``"generate": false`` warms up
(created + completed, no inference). Errors are ``{"type": "error", "status", "error": {"code", "message"}}``.
Stored responses also go into the node's store, so GET /v1/responses/{id} finds them.

Each connection is one record (method ``WEBSOCKET``, state open -> closed, ``detail`` with the event types and
who closed) and each response.create one more (path /v1/responses, method ``WEBSOCKET``).
"""

from __future__ import annotations

import json
import uuid
from contextlib import aclosing
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from vllm_etcd_proxy.sim import responses
from vllm_etcd_proxy.sim import responses_wire as wire
from vllm_etcd_proxy.sim.errors import ApiError
from vllm_etcd_proxy.sim.record import Record
from vllm_etcd_proxy.sim.recording import engine_of, new_record, note_fields
from vllm_etcd_proxy.sim.response_store import Stored


async def _error(websocket: WebSocket, code: str, message: str, status: int = 400) -> None:
    payload = {"type": "error", "status": status, "error": {"code": code, "message": message}}
    await websocket.send_text(json.dumps(payload))


async def _send(websocket: WebSocket, event: dict[str, Any]) -> None:
    await websocket.send_text(json.dumps(event, ensure_ascii=False, separators=(",", ":")))


async def _create(websocket: WebSocket, session: Record, last: dict[str, Stored], event: dict[str, Any]) -> None:
    """One response.create: generate and stream it, keep it as the connection's last response."""
    engine = engine_of(websocket)
    previous = event.get("previous_response_id")
    if previous is not None and previous not in last:
        await _error(
            websocket, "previous_response_not_found", f"Response '{previous}' not found in connection cache", 404
        )
        return
    body = {k: v for k, v in event.items() if k not in ("type", "generate", "background")}
    record = Record(
        id="",
        request_id=session.request_id,
        path="/v1/responses",
        authorization=session.authorization,
        method="WEBSOCKET",
        detail={"session": session.detail["session"]},
    )
    engine.receive(record)
    note_fields(record, body)
    try:
        run = responses.prepare(engine, last, record, {**body, "stream": True})
    except ApiError as exc:
        engine.reject(record, exc.status)
        await _error(websocket, exc.type, exc.message, exc.status)
        return
    stored = Stored(response=run.response("in_progress", [], None), messages=run.messages)
    if event.get("generate", True) is False:
        done = run.response("completed", [], None)
        events = wire.Events()
        for kind in ("response.created", "response.completed"):
            warm = events.make(kind, response=done)
            stored.add(warm)
            await _send(websocket, warm)
        record.status, record.state = 200, "done"
    else:
        async with aclosing(responses.run_events(engine, run)) as stream:
            async for produced in stream:
                stored.add(produced)
                await _send(websocket, produced)
        record.status = 200 if stored.events[-1]["type"] == "response.completed" else 500
    responses.take_final(stored, stored.events[-1])
    stored.finish()
    last.clear()
    if stored.events[-1]["type"] == "response.completed":
        last[run.turn.id] = stored
        if run.turn.store:
            websocket.app.state.responses[run.turn.id] = stored
    engine.log(record)


async def responses_socket(websocket: WebSocket) -> None:
    engine = engine_of(websocket)
    session = new_record(websocket, method="WEBSOCKET")
    session.state, session.status = "open", 101
    session.detail = {"session": f"ws-{uuid.uuid4().hex}", "events": [], "closed_by": None, "close_code": None}
    last: dict[str, Stored] = {}
    await websocket.accept()
    try:
        while True:
            text = await websocket.receive_text()
            try:
                event = json.loads(text)
            except ValueError:
                await _error(websocket, "invalid_json", "Invalid JSON")
                continue
            kind = event.get("type") if isinstance(event, dict) else None
            session.detail["events"].append(kind)
            if kind != "response.create" or not isinstance(event, dict):
                await _error(websocket, "unknown_event_type", f"Unknown event type: {kind}")
                continue
            await _create(websocket, session, last, event)
    except WebSocketDisconnect as exc:
        session.detail["closed_by"], session.detail["close_code"] = "client", exc.code
    finally:
        session.state = "closed"
        engine.log(session)


ROUTES = [WebSocketRoute("/v1/responses", responses_socket)]
