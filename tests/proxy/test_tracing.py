"""Traces through every leg (issue 21): a real OTLP/HTTP receiver of the test's own, real simulated nodes that
record the ``traceparent`` they got, a real replica with ``--otlp-traces-endpoint``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.otlp_receiver import OtlpReceiver
from tests.support.procs import DeadPort
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.proxy.telemetry.spans import traces_endpoint

MODEL = "sim-model"
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}  # milliseconds between the SDK's batch exports
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "tell me about the sea"}],
    "max_tokens": 12,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def stream(url: str, body: dict[str, object], request_id: str, traceparent: str | None = CLIENT_TRACEPARENT) -> str:
    headers = {"x-request-id": request_id}
    if traceparent:
        headers["traceparent"] = traceparent
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.text.endswith("data: [DONE]\n\n")
    return response.text


def parent_named(traceparent: str | None) -> tuple[str, str]:
    """(trace id, parent span id) of a ``traceparent`` header (its flags are the sampler's)."""
    assert traceparent is not None and traceparent.startswith("00-")
    _, trace_id, span_id, _ = traceparent.split("-")
    return trace_id, span_id


def test_a_disaggregated_stream_is_one_trace_with_a_prefill_and_a_decode_child_each_the_nodes_parent(
    logs_dir: Path, receiver: OtlpReceiver
) -> None:
    with SimNode(logs_dir, "prefill", role="prefill") as prefill, SimNode(logs_dir, "decode", role="decode") as decode:
        proxy = ProxyProc(
            logs_dir,
            "--prefill",
            prefill.host_port,
            "--decode",
            decode.host_port,
            "--otlp-traces-endpoint",
            receiver.endpoint,
            env=FAST_EXPORT,
        )
        try:
            proxy.wait_routable("decode", decode.host_port)
            proxy.wait_routable("prefill", prefill.host_port)
            stream(proxy.url, CHAT, "trace-pd")
            spans = receiver.wait_for_spans(3, **{"gen_ai.request.id": "trace-pd"})
        finally:
            proxy.stop()
        assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
        (request,) = [s for s in spans if s.parent_id == CLIENT_SPAN]
        assert request.name == "POST /v1/chat/completions" and request.service == "vllm-proxy"
        assert {s.trace_id for s in spans} == {CLIENT_TRACE}, "the client's trace is continued"
        legs = {s.attributes["vllm_proxy.role"]: s for s in spans if s.parent_id == request.span_id}
        assert sorted(legs) == ["decode", "prefill"] and len(spans) == 3
        for role, node in (("prefill", prefill), ("decode", decode)):
            leg = legs[role]
            assert leg.name == f"{role} {MODEL}"
            assert leg.attributes["gen_ai.system"] == "vllm"
            assert leg.attributes["gen_ai.request.model"] == MODEL
            assert leg.attributes["vllm_proxy.node"] == node.host_port
            assert leg.attributes["server.address"] == "127.0.0.1" and leg.attributes["server.port"] == node.port
            assert leg.attributes["vllm_proxy.outcome"] == "ok" and not leg.error
            (seen,) = [r for r in node.requests() if r["request_id"] == "trace-pd"]
            assert parent_named(seen["traceparent"]) == (CLIENT_TRACE, leg.span_id), f"{role}: its leg is the parent"
        assert legs["prefill"].attributes["gen_ai.usage.input_tokens"] > 0
        assert "gen_ai.latency.time_to_first_token" in legs["decode"].attributes
        assert request.attributes["gen_ai.request.model"] == MODEL
        assert request.attributes["http.response.status_code"] == 200
        assert request.attributes["gen_ai.usage.output_tokens"] == 12
        assert request.attributes["gen_ai.latency.time_to_first_token"] <= request.attributes["gen_ai.latency.e2e"]


def test_a_resumed_stream_shows_the_broken_leg_and_the_resume(logs_dir: Path, receiver: OtlpReceiver) -> None:
    nodes = [SimNode(logs_dir, f"mixed-{i}", role="mixed", output_len=40) for i in range(2)]
    for node in nodes:
        node.start()
    nodes[0].configure(fail_after_tokens=4)
    proxy = ProxyProc(
        logs_dir,
        "--mixed",
        *(n.host_port for n in nodes),
        "--policy",
        "round-robin",
        "--eject-after",
        "0",
        "--otlp-traces-endpoint",
        receiver.endpoint,
        env=FAST_EXPORT,
    )
    try:
        for node in nodes:
            proxy.wait_routable("mixed", node.host_port)
        for i in range(2):  # round-robin: one of the two starts on the failing node
            stream(proxy.url, {**CHAT, "max_tokens": 20}, f"resume-{i}", traceparent=None)
        spans = receiver.wait_for_spans(1, **{"vllm_proxy.resume": 1})
        request_id = spans[0].attributes["gen_ai.request.id"]
        trace = receiver.wait_for_spans(3, **{"gen_ai.request.id": request_id})
        (continued,) = [r for r in nodes[1].requests() if r["request_id"] == request_id]
    finally:
        proxy.stop()
        for node in nodes:
            node.stop()
    (request,) = [s for s in trace if s.parent_id == ""]
    assert request.attributes["vllm_proxy.resumes"] == 1
    legs = sorted((s for s in trace if s.parent_id == request.span_id), key=lambda s: s.attributes["vllm_proxy.resume"])
    assert [(s.attributes["vllm_proxy.node"], s.attributes["vllm_proxy.outcome"]) for s in legs] == [
        (nodes[0].host_port, "broken"),
        (nodes[1].host_port, "ok"),
    ]
    assert legs[0].error and not legs[1].error
    assert parent_named(continued["traceparent"]) == (request.trace_id, legs[1].span_id)


def test_with_tracing_off_no_span_is_made_and_the_clients_traceparent_passes(
    logs_dir: Path, receiver: OtlpReceiver
) -> None:
    with SimNode(logs_dir, "plain", role="mixed") as node:
        proxy = ProxyProc(logs_dir, "--mixed", node.host_port, env=FAST_EXPORT)
        try:
            proxy.wait_routable("mixed", node.host_port)
            stream(proxy.url, CHAT, "untraced")
        finally:
            proxy.stop()  # a tracer would flush its spans here
        (seen,) = [r for r in node.requests() if r["request_id"] == "untraced"]
    assert seen["traceparent"] == CLIENT_TRACEPARENT
    assert receiver.bodies == []


def test_tracing_without_the_otel_extra_is_refused_at_start_with_what_to_install(tmp_path: Path) -> None:
    blocked = tmp_path / "no-otel" / "opentelemetry"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('blocked by the test', name='opentelemetry')\n")
    dead = DeadPort()
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "vllm_etcd_proxy.proxy",
                "--mixed",
                f"127.0.0.1:{dead.port}",
                "--otlp-traces-endpoint",
                "http://127.0.0.1:4318",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(blocked.parent)},
        )
    finally:
        dead.close()
    assert done.returncode == 2
    assert "pip install 'vllm-etcd-proxy[otel]'" in done.stderr


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        (None, {}, None),
        ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
        ("collector:4318/", {}, "http://collector:4318/v1/traces"),
        ("https://collector/otlp/v1/traces", {}, "https://collector/otlp/v1/traces"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "http://c:4318/v1/traces"),
        ("http://flag:4318", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4318"}, "http://flag:4318/v1/traces"),
        ("http://collector:4318", {"OTEL_SDK_DISABLED": "true"}, None),
    ],
)
def test_where_traces_go(flag: str | None, environ: dict[str, str], expected: str | None) -> None:
    assert traces_endpoint(flag, environ) == expected
