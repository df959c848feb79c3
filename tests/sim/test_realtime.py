"""vllm-sim as a real process: vLLM's realtime transcription WebSocket."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.support.sim_node import SimNode

MODEL = "realtime-sim"
AUDIO = os.urandom(6400)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    with SimNode(tmp_path_factory.mktemp("sim-realtime"), model=[MODEL], ttft=0.01, itl=0.002) as started:
        yield started


@pytest.fixture
async def session(node: SimNode) -> AsyncIterator[ClientConnection]:
    url = f"{node.ws_url}/v1/realtime?model={MODEL}"
    async with connect(url, additional_headers={"x-request-id": "rt-client"}) as ws:
        yield ws


async def receive(ws: ClientConnection) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 5.0))
    return event


async def send(ws: ClientConnection, **event: Any) -> None:
    await ws.send(json.dumps(event))


async def utterance(ws: ClientConnection, audio: bytes) -> tuple[list[str], dict[str, Any]]:
    """Append ``audio`` in two pieces, commit, and read the deltas up to transcription.done."""
    half = len(audio) // 2
    for piece in (audio[:half], audio[half:]):
        await send(ws, type="input_audio_buffer.append", audio=base64.b64encode(piece).decode())
    await send(ws, type="input_audio_buffer.commit")
    deltas = []
    while (event := await receive(ws))["type"] == "transcription.delta":
        deltas.append(event["delta"])
    return deltas, event


async def test_a_session_opens_with_session_created(session: ClientConnection) -> None:
    created = await receive(session)
    assert created["type"] == "session.created" and created["id"].startswith("sess-") and created["created"] > 0


async def test_committed_audio_is_transcribed_as_deltas_then_done(session: ClientConnection) -> None:
    await receive(session)
    await send(session, type="session.update", model=MODEL, language="en")
    deltas, done = await utterance(session, AUDIO)
    assert deltas and done["type"] == "transcription.done" and done["text"] == "".join(deltas)
    assert done["usage"]["completion_tokens"] == len(deltas)
    again, _ = await utterance(session, AUDIO)
    assert again == deltas


async def test_bad_events_get_vllms_error_events(session: ClientConnection) -> None:
    await receive(session)
    await session.send("not json")
    assert await receive(session) == {"type": "error", "error": "Invalid JSON", "code": "invalid_json"}
    await send(session, type="response.create")
    assert (await receive(session))["code"] == "unknown_event"
    await send(session, type="input_audio_buffer.append", audio="***")
    assert (await receive(session))["code"] == "invalid_audio"


async def test_a_client_close_reaches_the_node_and_is_recorded(node: SimNode) -> None:
    node.clear_requests()
    url = f"{node.ws_url}/v1/realtime"
    async with connect(url, additional_headers={"x-request-id": "rt-close"}) as ws:
        session_id = (await receive(ws))["id"]
        await send(ws, type="session.update", model=MODEL)
        await utterance(ws, AUDIO)
        await ws.close(code=1000)
    record = await asyncio.to_thread(node.wait_for_request, request_id="rt-close", state="closed", method="WEBSOCKET")
    detail = record["detail"]
    assert (record["model"], detail["session"], detail["closed_by"], detail["close_code"]) == (
        MODEL,
        session_id,
        "client",
        1000,
    )
    assert detail["events"] == [
        "session.update",
        "input_audio_buffer.append",
        "input_audio_buffer.append",
        "input_audio_buffer.commit",
    ]
    assert (detail["audio_bytes"], detail["audio_sha256"]) == (len(AUDIO), hashlib.sha256(AUDIO).hexdigest())


async def test_the_server_can_close_its_sessions(node: SimNode, session: ClientConnection) -> None:
    await receive(session)
    assert len(node.close_websockets(code=1001)) == 1
    with pytest.raises(ConnectionClosed) as caught:
        await asyncio.wait_for(session.recv(), 5.0)
    assert caught.value.rcvd is not None and caught.value.rcvd.code == 1001
    record = await asyncio.to_thread(node.wait_for_request, request_id="rt-client", state="closed")
    assert record["detail"]["closed_by"] == "server"


async def test_an_api_key_guards_the_websocket_and_the_v2_and_inference_routes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with SimNode(tmp_path_factory.mktemp("sim-key"), model=[MODEL], api_key="k") as guarded:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"{guarded.ws_url}/v1/realtime"):
                pass
        assert refused.value.response.status_code == 401
        async with connect(f"{guarded.ws_url}/v1/realtime", additional_headers={"authorization": "Bearer k"}) as ws:
            assert (await receive(ws))["type"] == "session.created"
        async with httpx.AsyncClient() as client:
            for path in ("/v2/rerank", "/inference/v1/generate"):
                assert (await client.post(f"{guarded.url}{path}", json={})).status_code == 401
            assert (await client.post(f"{guarded.url}/tokenize", json={"prompt": "x"})).status_code == 200
