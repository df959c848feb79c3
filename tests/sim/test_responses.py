"""vllm-sim as a real process: vLLM's Responses API with its per-node store, streaming, background mode."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.support.procs import wait_until
from tests.support.sim_node import SimNode

MODEL = "sim-model"
LONG_INPUT = " ".join(f"word{i}" for i in range(40))
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 4,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
"""A streamed answer of four tokens."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    with SimNode(tmp_path_factory.mktemp("sim-responses"), model=[MODEL], ttft=0.01, itl=0.002) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def events(text: str) -> list[dict[str, Any]]:
    """The events of a Responses API SSE body, checking that each ``event:`` line names its data's type."""
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


async def create(client: httpx.AsyncClient, node: SimNode, **body: Any) -> httpx.Response:
    return await client.post(f"{node.url}/v1/responses", json={"model": MODEL, "input": "hello", **body})


async def test_the_response_id_is_the_bodys_request_id_and_the_header_changes_nothing(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    named = await client.post(
        f"{node.url}/v1/responses",
        json={"input": "hi", "request_id": "resp_node1-abc"},
        headers={"x-request-id": "header-id"},
    )
    assert (named.status_code, named.json()["id"]) == (200, "resp_node1-abc")
    assert node.wait_for_request(id="resp_node1-abc")["body_request_id"] == "resp_node1-abc"
    unnamed = (await create(client, node)).json()["id"]
    assert re.fullmatch(r"resp_[0-9a-f]{32}", unnamed)


async def test_a_response_has_vllms_fields_and_its_text_and_usage(node: SimNode, client: httpx.AsyncClient) -> None:
    body = (await create(client, node, max_output_tokens=3, instructions="be brief", metadata={"k": "v"})).json()
    assert (body["object"], body["model"], body["status"], body["background"]) == (
        "response",
        MODEL,
        "incomplete",
        False,
    )
    assert (body["incomplete_details"], body["instructions"], body["metadata"]) == (
        {"reason": "max_output_tokens"},
        "be brief",
        {"k": "v"},
    )
    [item] = body["output"]
    assert (item["type"], item["role"], item["status"], item["id"][:4]) == ("message", "assistant", "completed", "msg_")
    [part] = item["content"]
    assert part["type"] == "output_text" and re.fullmatch(r"( tok\d+){3}", part["text"])
    usage = body["usage"]
    assert (usage["output_tokens"], usage["total_tokens"]) == (3, usage["input_tokens"] + 3)
    assert {"previous_response_id", "max_output_tokens", "tool_choice", "truncation", "usage"} <= set(body)


async def test_a_stored_response_is_served_by_id_and_an_unstored_one_is_not(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    kept = (await create(client, node, request_id="resp_kept")).json()
    assert (await client.get(f"{node.url}/v1/responses/resp_kept")).json() == kept
    await create(client, node, request_id="resp_unkept", store=False)
    missing = await client.get(f"{node.url}/v1/responses/resp_unkept")
    assert (missing.status_code, missing.json()["error"]) == (
        404,
        {
            "message": "Response with id 'resp_unkept' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        },
    )


async def test_an_unknown_previous_response_id_is_vllms_404(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await create(client, node, previous_response_id="resp_elsewhere")
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Response with id 'resp_elsewhere' not found."


async def test_a_streamed_response_sends_vllms_events_in_sequence(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await create(client, node, stream=True, max_output_tokens=4, request_id="resp_streamed")
    assert response.headers["content-type"].startswith("text/event-stream")
    sent = events(response.text)
    assert [e["type"] for e in sent] == STREAM_EVENTS
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert sent[0]["response"]["status"] == "in_progress" and sent[-1]["response"]["id"] == "resp_streamed"
    text = "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta")
    assert sent[-1]["response"]["output"][0]["content"][0]["text"] == text


async def test_a_stored_responses_events_replay_after_a_sequence_number(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    await create(client, node, stream=True, max_output_tokens=4, request_id="resp_replay")
    replay = await client.get(f"{node.url}/v1/responses/resp_replay", params={"stream": "true", "starting_after": 5})
    assert [e["sequence_number"] for e in events(replay.text)] == list(range(6, len(STREAM_EVENTS)))


async def test_each_turn_of_a_chain_extends_the_previous_prompt_so_the_prefix_cache_hits(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    previous = None
    for turn in range(3):
        body = await create(
            client, node, input=LONG_INPUT, request_id=f"resp_chain{turn}", previous_response_id=previous
        )
        assert body.status_code == 200, body.text
        previous = body.json()["id"]
    first, second, third = (node.wait_for_request(id=f"resp_chain{i}") for i in range(3))
    assert first["prompt_tokens"] + first["completion_tokens"] < second["prompt_tokens"] < third["prompt_tokens"]
    assert second["cached_tokens"] >= (first["prompt_tokens"] + first["completion_tokens"]) // 16 * 16 - 16 > 0
    assert third["cached_tokens"] > second["cached_tokens"]


async def test_a_background_response_is_queued_then_completes(node: SimNode, client: httpx.AsyncClient) -> None:
    queued = (await create(client, node, background=True, request_id="resp_bg")).json()
    assert (queued["status"], queued["output"], queued["background"]) == ("queued", [], True)

    def completed() -> bool:
        return bool(httpx.get(f"{node.url}/v1/responses/resp_bg").json()["status"] == "completed")

    await asyncio.to_thread(wait_until, completed, 5.0, "the background response to complete")
    final = (await client.get(f"{node.url}/v1/responses/resp_bg")).json()
    assert final["output"][0]["content"][0]["text"] and final["usage"]["output_tokens"] > 0


async def test_a_streamed_background_response_streams_its_events(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await create(client, node, background=True, stream=True, max_output_tokens=4)
    assert [e["type"] for e in events(response.text)] == STREAM_EVENTS


async def test_cancelling_a_background_response_aborts_its_generation(node: SimNode, client: httpx.AsyncClient) -> None:
    node.configure(hang=True)
    try:
        queued = await create(client, node, background=True, request_id="resp_cancel")
        assert queued.json()["status"] == "queued"
        cancelled = await client.post(f"{node.url}/v1/responses/resp_cancel/cancel")
    finally:
        node.configure(hang=False)
    assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
    assert (await client.get(f"{node.url}/v1/responses/resp_cancel")).json()["status"] == "cancelled"
    record = node.wait_for_request(id="resp_cancel")
    assert record["cancelled"] is True


async def test_a_finished_response_cannot_be_cancelled(node: SimNode, client: httpx.AsyncClient) -> None:
    await create(client, node, request_id="resp_sync")
    refused = await client.post(f"{node.url}/v1/responses/resp_sync/cancel")
    assert (refused.status_code, refused.json()["error"]["message"]) == (400, "Cannot cancel a synchronous response.")
    missing = await client.post(f"{node.url}/v1/responses/resp_nowhere/cancel")
    assert missing.status_code == 404


async def test_deleting_a_response_forgets_it(node: SimNode, client: httpx.AsyncClient) -> None:
    await create(client, node, request_id="resp_delete")
    deleted = await client.delete(f"{node.url}/v1/responses/resp_delete")
    assert deleted.json() == {"id": "resp_delete", "object": "response", "deleted": True}
    assert node.wait_for_request(path="/v1/responses/resp_delete", method="DELETE")["status"] == 200
    assert (await client.get(f"{node.url}/v1/responses/resp_delete")).status_code == 404
    assert (await client.delete(f"{node.url}/v1/responses/resp_delete")).status_code == 404


async def test_background_requires_store(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await create(client, node, background=True, store=False)
    assert (response.status_code, response.json()["error"]["param"]) == (400, "background")


async def test_the_openai_client_chains_responses(node: SimNode) -> None:
    async with openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key="none") as client:
        first = await client.responses.create(model=MODEL, input="hello")
        second = await client.responses.create(model=MODEL, input="and then?", previous_response_id=first.id)
        assert second.previous_response_id == first.id and second.output_text
        stream = await client.responses.create(model=MODEL, input="stream it", stream=True)
        kinds = [event.type async for event in stream]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


# ---- WebSocket mode ----


async def ws_turn(ws: ClientConnection, **event: Any) -> list[dict[str, Any]]:
    """Send a response.create and read its events up to response.completed or an error."""
    await ws.send(json.dumps({"type": "response.create", "model": MODEL, **event}))
    received: list[dict[str, Any]] = []
    while not received or received[-1]["type"] not in ("response.completed", "error"):
        received.append(json.loads(await asyncio.wait_for(ws.recv(), 5.0)))
    return received


async def test_websocket_mode_streams_each_response_and_chains_on_the_connection(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    async with connect(f"{node.ws_url}/v1/responses", additional_headers={"x-request-id": "ws-mode"}) as ws:
        first = await ws_turn(ws, input=LONG_INPUT, request_id="resp_ws1", max_output_tokens=4)
        assert [e["type"] for e in first] == STREAM_EVENTS
        second = await ws_turn(ws, input="more", request_id="resp_ws2", previous_response_id="resp_ws1")
        assert second[-1]["response"]["previous_response_id"] == "resp_ws1"
        stale = await ws_turn(ws, input="again", previous_response_id="resp_ws1")
        assert stale == [
            {
                "type": "error",
                "status": 404,
                "error": {
                    "code": "previous_response_not_found",
                    "message": "Response 'resp_ws1' not found in connection cache",
                },
            }
        ]
        warm = await ws_turn(ws, input="warm", generate=False)
        assert [e["type"] for e in warm] == ["response.created", "response.completed"]
    assert (await client.get(f"{node.url}/v1/responses/resp_ws2")).json()["status"] == "completed"
    one, two = (node.wait_for_request(id=f"resp_ws{i}") for i in (1, 2))
    assert two["prompt_tokens"] > one["prompt_tokens"] + one["completion_tokens"] and two["cached_tokens"] > 0
    session = await asyncio.to_thread(
        node.wait_for_request, request_id="ws-mode", state="closed", path="/v1/responses", id=""
    )
    assert session["detail"]["closed_by"] == "client" and session["detail"]["events"] == ["response.create"] * 4
