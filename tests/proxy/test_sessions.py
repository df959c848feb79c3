"""WebSocket sessions take the request path of every HTTP request (serving/sessions.py): what the layers do for a
request they do for a session (real replicas, simulated nodes, the ``websockets`` client): a session to a model
whose nodes sleep wakes one, one to a node that fails is retried on another and the node ejected, and a session
is a trace with its node's leg as a child."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.support.otlp_receiver import OtlpReceiver
from tests.support.procs import DeadPort, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import DEV_MODE, SimNode

MODEL = "sim-model"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def ws_url(proxy: ProxyProc, query: str = f"?model={MODEL}") -> str:
    return proxy.url.replace("http://", "ws://") + "/v1/realtime" + query


async def first_event(ws: ClientConnection) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10.0))
    return event


async def test_a_session_to_a_model_whose_nodes_sleep_wakes_one(tmp_path: Path) -> None:
    with SimNode(tmp_path, "asleep", env=DEV_MODE, model=MODEL) as node:
        node.sleep(level=2)
        replica = ProxyProc(tmp_path, "--mixed", node.host_port, "--scrape-load", "0.1", "--wake-on-demand")
        try:
            await asyncio.to_thread(
                wait_until, lambda: any(w["asleep"] for w in replica.workers()), 10, "the node seen asleep"
            )
            async with connect(ws_url(replica)) as ws:
                assert (await first_event(ws))["type"] == "session.created"
            assert [r["status"] for r in node.requests() if r["path"] == "/wake_up"] == [200]
        finally:
            replica.stop()


async def test_a_session_to_a_node_that_fails_is_retried_on_another_and_the_node_ejected(tmp_path: Path) -> None:
    dead = DeadPort()
    dead_node = f"127.0.0.1:{dead.port}"
    with SimNode(tmp_path, "alive", model=MODEL) as node:
        flags = ("--mixed", dead_node, "--mixed", node.host_port, "--model", MODEL, "--eject-after", "2")
        replica = ProxyProc(tmp_path, *flags, "--policy", "round-robin")
        try:
            for _ in range(4):  # round robin: the dead node is tried first for half of them
                async with connect(ws_url(replica)) as ws:
                    assert (await first_event(ws))["type"] == "session.created"
            workers = {w["id"]: w for w in replica.workers()}
            assert workers[dead_node]["ejected"] is True, workers[dead_node]
            assert workers[node.host_port]["ejected"] is False
            retries = [line for line in replica.get("/metrics").text.splitlines() if "vllm_proxy_retries_total" in line]
            assert any(not line.startswith("#") and not line.endswith(" 0.0") for line in retries), retries
        finally:
            replica.stop()
            dead.close()


async def test_a_session_is_a_trace_with_its_nodes_leg_as_a_child(tmp_path: Path) -> None:
    with OtlpReceiver() as receiver, SimNode(tmp_path, "traced", model=MODEL) as node:
        flags = ("--mixed", node.host_port, "--otlp-traces-endpoint", receiver.endpoint)
        replica = ProxyProc(tmp_path, *flags, env=FAST_EXPORT)
        try:
            replica.wait_routable("mixed", node.host_port)
            headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "x-request-id": "traced-session"}
            async with connect(ws_url(replica), additional_headers=headers) as ws:
                assert (await first_event(ws))["type"] == "session.created"
            spans = await asyncio.to_thread(receiver.wait_for_spans, 2, **{"gen_ai.request.id": "traced-session"})
        finally:
            replica.stop()
        (seen,) = [r for r in node.requests() if r["request_id"] == "traced-session"]
    (session,) = [s for s in spans if s.parent_id == CLIENT_SPAN]
    assert session.name == "GET /v1/realtime" and session.trace_id == CLIENT_TRACE
    (leg,) = [s for s in spans if s.parent_id == session.span_id]
    assert leg.attributes["vllm_proxy.node"] == node.host_port and leg.attributes["vllm_proxy.outcome"] == "ok"
    assert seen["traceparent"] is not None and leg.span_id in seen["traceparent"], "the node's parent is its leg"


@pytest.mark.parametrize("limit", ["--max-concurrent-requests"])
async def test_a_replica_at_its_limit_refuses_a_session_as_it_refuses_a_request(tmp_path: Path, limit: str) -> None:
    with SimNode(tmp_path, "busy", model=MODEL) as node:
        replica = ProxyProc(tmp_path, "--mixed", node.host_port, limit, "1")
        try:
            replica.wait_routable("mixed", node.host_port)
            async with connect(ws_url(replica)) as ws:
                assert (await first_event(ws))["type"] == "session.created"
                answer = await asyncio.to_thread(
                    replica.post, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                )
                assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        finally:
            replica.stop()
