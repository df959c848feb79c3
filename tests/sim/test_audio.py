"""vllm-sim as a real process: vLLM's multipart speech-to-text routes, streamed and not."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.sim_node import SimNode

MODEL = "whisper-sim"
AUDIO = os.urandom(3 * 32000 + 5)
"""Three seconds and a bit of 16 kHz 16-bit audio: random bytes, every value of a byte among them."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    with SimNode(tmp_path_factory.mktemp("sim-audio"), model=[MODEL], ttft=0.01, itl=0.002) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def post(client: httpx.AsyncClient, node: SimNode, path: str, rid: str, **fields: str) -> httpx.Response:
    return await client.post(
        f"{node.url}/v1/audio/{path}",
        files={"file": ("speech.wav", AUDIO, "audio/wav")},
        data={"model": MODEL, **fields},
        headers={"x-request-id": rid},
    )


def chunks(text: str) -> list[Any]:
    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


async def test_a_transcription_upload_arrives_intact_and_is_recorded(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await post(client, node, "transcriptions", "t1", language="en")
    assert response.status_code == 200, response.text
    body = response.json()
    assert re.fullmatch(r"( tok\d+)+", body["text"]) and body["usage"] == {"type": "duration", "seconds": 4}
    record = node.wait_for_request(request_id="t1")
    assert (record["upload_sha256"], record["upload_size"], record["upload_filename"]) == (
        hashlib.sha256(AUDIO).hexdigest(),
        len(AUDIO),
        "speech.wav",
    )
    assert (record["model"], record["detail"]["form"]["language"], record["id"]) == (MODEL, "en", "transcribe-t1")
    assert record["content_type"].startswith("multipart/form-data; boundary=")


async def test_the_same_audio_gives_the_same_transcript(node: SimNode, client: httpx.AsyncClient) -> None:
    first = (await post(client, node, "transcriptions", "same1")).json()["text"]
    assert (await post(client, node, "transcriptions", "same2")).json()["text"] == first


async def test_a_translation_is_text_only(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await post(client, node, "translations", "tr1")
    assert list(response.json()) == ["text"]
    assert node.wait_for_request(request_id="tr1")["path"] == "/v1/audio/translations"


async def test_a_streamed_transcription_sends_vllms_chunks_then_done(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await post(client, node, "transcriptions", "s1", stream="true", stream_include_usage="true")
    assert response.headers["content-type"].startswith("text/event-stream")
    sent = chunks(response.text)
    assert sent[-1] == "[DONE]"
    *deltas, usage = sent[:-1]
    assert all(c["id"] == "transcribe-s1" and c["object"] == "transcription.chunk" for c in sent[:-1])
    assert all(set(c["choices"][0]) == {"delta"} for c in deltas[:-1])
    assert deltas[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(deltas)
    plain = (await post(client, node, "transcriptions", "s2")).json()["text"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in deltas) == plain


async def test_text_response_format_is_plain_text(node: SimNode, client: httpx.AsyncClient) -> None:
    response = await post(client, node, "transcriptions", "f1", response_format="text")
    assert response.headers["content-type"].startswith("text/plain") and response.text.startswith(" tok")


async def test_audio_routes_refuse_what_vllm_refuses(node: SimNode, client: httpx.AsyncClient) -> None:
    unknown = await client.post(
        f"{node.url}/v1/audio/transcriptions", files={"file": ("a.wav", AUDIO)}, data={"model": "nope"}
    )
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (404, "model")
    as_json = await client.post(f"{node.url}/v1/audio/transcriptions", json={"model": MODEL})
    assert as_json.status_code == 400
    srt = await post(client, node, "transcriptions", "bad", response_format="srt")
    assert srt.status_code == 400


async def test_the_openai_client_transcribes(node: SimNode) -> None:
    async with openai.AsyncOpenAI(base_url=f"{node.url}/v1", api_key="none") as client:
        result = await client.audio.transcriptions.create(model=MODEL, file=("a.wav", AUDIO, "audio/wav"))
        assert result.text.startswith(" tok")
