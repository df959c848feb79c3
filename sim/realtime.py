"""vLLM's realtime transcription WebSocket, ``/v1/realtime`` (vllm/entrypoints/openai/realtime/).

Events, as JSON text frames. The server opens with ``{"type": "session.created", "id": "sess-<hex>", "created"}``.
Client -> server: ``session.update`` (``model``, ``language``, ``temperature``), ``input_audio_buffer.append``
(``audio``: base64 PCM16), ``input_audio_buffer.commit`` (transcribe what was appended since the last commit).
Server -> client: ``transcription.delta`` (``delta``) per token, then ``transcription.done`` (``text``, ``usage``);
``error`` (``error``, ``code``: invalid_json, invalid_audio, unknown_event, processing_error).

Each session is one record (method ``WEBSOCKET``, state open -> closed; ``detail`` has the client's event types,
the audio's bytes and SHA-256, who closed and the close code) and each commit one more record (id ``rt-...``), so a
test sees what reached the node and that a client's close did. ``POST /sim/realtime/close`` closes every open
session from the server side.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import time
import uuid
from contextlib import aclosing, suppress
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from vllm_etcd_proxy.sim import tokens
from vllm_etcd_proxy.sim.engine import Engine
from vllm_etcd_proxy.sim.errors import ApiError
from vllm_etcd_proxy.sim.record import Job, Record
from vllm_etcd_proxy.sim.recording import engine_of, new_record


def _sessions(connection: Request | WebSocket) -> dict[str, Session]:
    sessions: dict[str, Session] = connection.app.state.realtime
    return sessions


class Session:
    """One connection's state: its record, the audio appended since the last commit, the running transcription."""

    def __init__(self, websocket: WebSocket, engine: Engine, record: Record):
        self.websocket, self.engine, self.record = websocket, engine, record
        self.id = f"sess-{uuid.uuid4().hex}"
        self.model = websocket.query_params.get("model")
        self.buffer = bytearray()
        self.digest = hashlib.sha256()
        self.task: asyncio.Task[None] | None = None
        record.model, record.state, record.status = self.model, "open", 101
        record.detail = {
            "session": self.id,
            "events": [],
            "audio_bytes": 0,
            "audio_sha256": None,
            "closed_by": None,
            "close_code": None,
        }

    async def send(self, event: dict[str, Any]) -> None:
        await self.websocket.send_text(json.dumps(event, separators=(",", ":")))

    async def error(self, message: str, code: str) -> None:
        await self.send({"type": "error", "error": message, "code": code})

    async def handle(self, text: str) -> None:
        try:
            event = json.loads(text)
        except ValueError:
            await self.error("Invalid JSON", "invalid_json")
            return
        kind = event.get("type") if isinstance(event, dict) else None
        self.record.detail["events"].append(kind)
        if kind == "session.update":
            model = event.get("model")
            self.model = self.record.model = model if isinstance(model, str) else self.model
        elif kind == "input_audio_buffer.append":
            try:
                audio = base64.b64decode(event.get("audio", ""), validate=True)
            except (binascii.Error, TypeError, ValueError):
                await self.error("Invalid audio data", "invalid_audio")
                return
            self.buffer += audio
            self.digest.update(audio)
            self.record.detail["audio_bytes"] += len(audio)
            self.record.detail["audio_sha256"] = self.digest.hexdigest()
        elif kind == "input_audio_buffer.commit":
            if self.task is None or self.task.done():
                audio, self.buffer = bytes(self.buffer), bytearray()
                self.task = asyncio.get_running_loop().create_task(self.transcribe(audio))
        else:
            await self.error(f"Unknown event type: {kind}", "unknown_event")

    async def transcribe(self, audio: bytes) -> None:
        """One utterance: a generation of its own, recorded, its tokens sent as deltas."""
        engine = self.engine
        record = Record(
            id=f"rt-ws-{self.id}-{uuid.uuid4().hex}",
            request_id=self.record.request_id,
            path=self.record.path,
            authorization=None,
            method="WEBSOCKET",
            model=self.model,
            stream=True,
            detail={"session": self.id, "audio_bytes": len(audio)},
        )
        engine.receive(record)
        prompt = tokens.encode(f"realtime {hashlib.sha256(audio).hexdigest()}")
        answer = tokens.complete(prompt, max_tokens=None, output_len=engine.knobs.output_len)
        record.prompt_tokens = len(prompt)
        job = Job(
            record=record,
            prompt=tuple(prompt),
            tokens=answer.tokens,
            finish_reason=answer.finish_reason,
            kv_loaded=False,
        )
        text = ""
        try:
            async with aclosing(engine.generate(job)) as stream:
                async for token in stream:
                    piece = tokens.token_text(token)
                    text += piece
                    await self.send({"type": "transcription.delta", "delta": piece})
            done = record.completion_tokens
            usage = {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + done,
                "completion_tokens": done,
                "prompt_tokens_details": None,
            }
            await self.send({"type": "transcription.done", "text": text, "usage": usage})
            record.status = 200
        except ApiError as exc:
            await self.error(exc.message, "processing_error")
            record.status = exc.status
        finally:
            engine.log(record)

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with suppress(asyncio.CancelledError):
                await self.task


async def realtime(websocket: WebSocket) -> None:
    engine = engine_of(websocket)
    session = Session(websocket, engine, new_record(websocket, method="WEBSOCKET"))
    detail = session.record.detail
    await websocket.accept()
    _sessions(websocket)[session.id] = session
    try:
        await session.send({"type": "session.created", "id": session.id, "created": int(time.time())})
        while True:
            await session.handle(await websocket.receive_text())
    except WebSocketDisconnect as exc:
        detail["closed_by"] = detail["closed_by"] or "client"
        detail["close_code"] = exc.code
    finally:
        _sessions(websocket).pop(session.id, None)
        await session.close()
        session.record.state = "closed"
        engine.log(session.record)


async def close_sessions(request: Request) -> Response:
    """Close every open realtime session from the server side (``{"code": 1000}`` by default)."""
    body = json.loads(await request.body() or b"{}")
    code = body.get("code", 1000) if isinstance(body, dict) else 1000
    closed = []
    for session_id, session in list(_sessions(request).items()):
        session.record.detail["closed_by"] = "server"
        with suppress(RuntimeError):
            await session.websocket.close(code=code)
        closed.append(session_id)
    return JSONResponse({"closed": closed})


ROUTES = [WebSocketRoute("/v1/realtime", realtime), Route("/sim/realtime/close", close_sessions, methods=["POST"])]
