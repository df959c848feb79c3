"""vllm-sim serves LoRA adapters as vLLM does: --lora-modules, runtime loading behind its switch, the slot limit of
--max-loras, the vllm:lora_requests_info gauge (latest series wins) and knobs that make a load slow or fail."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.aio import eventually
from tests.support.sim_node import RUNTIME_LORA, SimNode

MODEL = "sim-model"
MODULES = ["sql=/loras/sql", json.dumps({"name": "chat", "path": "/loras/chat", "base_model_name": "base-b"})]
INFO = re.compile(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", re.M)


def lora_info(page: str) -> dict[str, str]:
    """The labels of the newest vllm:lora_requests_info series (the one with the greatest timestamp)."""
    series = [(float(value), dict(re.findall(r'(\w+)="([^"]*)"', labels))) for labels, value in INFO.findall(page)]
    return max(series, key=lambda s: s[0])[1]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimNode]:
    logs = tmp_path_factory.mktemp("sim-lora")
    with SimNode(
        logs,
        env=RUNTIME_LORA,
        model=[MODEL, "base-b"],
        enable_lora=True,
        max_loras=1,
        lora_modules=MODULES,
        ttft=0.01,
        itl=0.01,
    ) as started:
        yield started


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def chat(model: str, tokens: int = 2) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "ignore_eos": True}


async def test_lora_modules_in_both_forms_are_listed_as_vllm_lists_adapters(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    cards = {c["id"]: c for c in (await client.get(f"{node.url}/v1/models")).json()["data"]}
    assert [(cards[n]["root"], cards[n]["parent"]) for n in ("sql", "chat")] == [
        ("/loras/sql", MODEL),
        ("/loras/chat", "base-b"),
    ]


async def test_an_adapter_beyond_max_loras_waits_until_the_active_one_has_no_request(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    before = node.snapshot()["counters"]["lora_swaps"]
    first = asyncio.create_task(client.post(f"{node.url}/v1/chat/completions", json=chat("sql", 60)))
    await eventually(lambda: lora_info(node.metrics())["running_lora_adapters"] == "sql", 5.0, "sql running")
    second = asyncio.create_task(client.post(f"{node.url}/v1/chat/completions", json=chat("chat")))
    await eventually(lambda: lora_info(node.metrics())["waiting_lora_adapters"] == "chat", 5.0, "chat waiting")
    assert lora_info(node.metrics())["max_lora"] == "1"
    assert not second.done()
    answers = await asyncio.gather(first, second)
    assert [(a.status_code, a.json()["model"]) for a in answers] == [(200, "sql"), (200, "chat")]
    assert node.snapshot()["counters"]["lora_swaps"] - before == 2
    page = node.metrics()
    assert len(INFO.findall(page)) > 1  # old series stay, as in vLLM: the newest says the node is idle
    assert (lora_info(page)["running_lora_adapters"], lora_info(page)["waiting_lora_adapters"]) == ("", "")


async def test_requests_of_the_active_adapter_share_its_slot_without_a_swap(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    await client.post(f"{node.url}/v1/chat/completions", json=chat("sql"))
    before = node.snapshot()["counters"]["lora_swaps"]
    answers = await asyncio.gather(
        *(client.post(f"{node.url}/v1/chat/completions", json=chat("sql")) for _ in range(4))
    )
    assert {a.status_code for a in answers} == {200}
    assert node.snapshot()["counters"]["lora_swaps"] == before


async def test_a_runtime_load_is_counted_and_a_failing_load_answers_vllms_error(
    node: SimNode, client: httpx.AsyncClient
) -> None:
    loads = node.snapshot()["counters"].get("lora_loads", 0)
    ok = await client.post(f"{node.url}/v1/load_lora_adapter", json={"lora_name": "new", "lora_path": "/l/new"})
    assert ok.status_code == 200 and node.snapshot()["counters"]["lora_loads"] == loads + 1
    assert (await client.post(f"{node.url}/v1/chat/completions", json=chat("new"))).json()["model"] == "new"
    node.configure(lora_load_fail=404)
    try:
        bad = await client.post(f"{node.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    finally:
        node.configure(lora_load_fail=0)
    assert (bad.status_code, bad.json()["error"]["type"]) == (404, "NotFoundError")
    assert "No adapter found for /nowhere" in bad.json()["error"]["message"]


def test_without_the_runtime_switch_the_load_routes_do_not_exist(tmp_path: Path) -> None:
    with SimNode(tmp_path, enable_lora=True) as plain:
        load = httpx.post(f"{plain.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
        assert (load.status_code, load.json()) == (404, {"detail": "Not Found"})
        assert 'max_lora="1"' in plain.metrics()


def test_lora_modules_need_enable_lora_and_a_name_and_path() -> None:
    from vllm_etcd_proxy.sim.cli import parse_settings

    argv = ["--enable-lora", "--max-loras", "4", "--lora-modules", "a=/a", '{"name":"b","path":"/b"}']
    settings = parse_settings(argv, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert (settings.loras, settings.max_loras, settings.runtime_lora_updating) == ((("a", "/a"), ("b", "/b")), 4, True)
    for argv in (["--lora-modules", "a=/a"], ["--enable-lora", "--lora-modules", "nopath"]):
        with pytest.raises(SystemExit):
            parse_settings(argv, {})
