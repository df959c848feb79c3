"""The tracer on OpenTelemetry's SDK, exporting OTLP over HTTP/protobuf (imported only when tracing is on).

Span names and attributes follow OpenTelemetry's GenAI conventions where they fit, and vLLM's own span
attributes for latency and the request id, so that a node's spans (vLLM continues the ``traceparent`` a leg
sends) and ours read alike. The SDK reads the standard ``OTEL_*`` variables itself: ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_*``, ``OTEL_TRACES_SAMPLER``...
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SYSTEM = "vllm"
_PROPAGATOR = TraceContextTextMapPropagator()


def _ns_since(started: float) -> int:
    """``time.time_ns()`` of the moment ``started`` (a ``time.monotonic()``)."""
    return time.time_ns() - int((time.monotonic() - started) * 1e9)


def _set_usage(span: Span, prompt_tokens: int | None, completion_tokens: int | None) -> None:
    if prompt_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
    if completion_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)


class OtelLeg:
    __slots__ = ("_span", "_trace", "_started", "headers")

    def __init__(self, span: Span, trace: OtelRequest) -> None:
        self._span = span
        self._trace = trace
        self._started = time.monotonic()
        context = span.get_span_context()
        lines = b"traceparent: 00-%032x-%016x-%02x\r\n" % (context.trace_id, context.span_id, context.trace_flags)
        state = context.trace_state.to_header() if context.trace_state else ""
        if state:
            lines += b"tracestate: " + state.encode("latin-1", "replace") + b"\r\n"
        self.headers = lines

    def first_byte(self) -> None:
        now = time.monotonic()
        self._span.set_attribute("gen_ai.latency.time_to_first_token", now - self._started)
        self._trace.first_byte(now)

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        _set_usage(self._span, prompt_tokens, completion_tokens)

    def end(self, outcome: str, status: int | None = None) -> None:
        span = self._span
        span.set_attribute("vllm_proxy.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if outcome not in ("ok", "refused"):
            span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


class OtelRequest:
    __slots__ = ("_span", "_tracer", "_started", "_resumes", "_first", "_request_id")

    def __init__(self, tracer: OtelTracer, span: Span, started: float, request_id: str) -> None:
        self._tracer = tracer
        self._span = span
        self._started = started
        self._resumes = 0
        self._first = False
        self._request_id = request_id

    def leg(self, *, role: str, node_id: str, url: str, model: str, attempt: int) -> OtelLeg:
        host, _, port = url.split("://", 1)[-1].rpartition(":")
        attributes: dict[str, str | int] = {
            "gen_ai.system": SYSTEM,
            "gen_ai.operation.name": role,
            "gen_ai.request.model": model,
            "gen_ai.request.id": self._request_id,
            "server.address": host.strip("[]"),
            "vllm_proxy.node": node_id,
            "vllm_proxy.role": role,
            "vllm_proxy.attempt": attempt,
            "vllm_proxy.resume": self._resumes,
        }
        if port.isdigit():
            attributes["server.port"] = int(port)
        span = self._tracer.tracer.start_span(
            f"{role} {model}".rstrip(), set_span_in_context(self._span), kind=SpanKind.CLIENT, attributes=attributes
        )
        return OtelLeg(span, self)

    def resumed(self) -> None:
        self._resumes += 1

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        _set_usage(self._span, prompt_tokens, completion_tokens)

    def first_byte(self, now: float) -> None:
        if not self._first:
            self._first = True
            self._span.set_attribute("gen_ai.latency.time_to_first_token", now - self._started)

    def end(self, status: int, model: str | None = None) -> None:
        span = self._span
        if model:
            span.set_attribute("gen_ai.request.model", model)
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("gen_ai.latency.e2e", time.monotonic() - self._started)
        if self._resumes:
            span.set_attribute("vllm_proxy.resumes", self._resumes)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()


class OtelTracer:
    def __init__(self, endpoint: str, service_name: str) -> None:
        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME over this default.
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
        self.tracer = self.provider.get_tracer("vllm_etcd_proxy.proxy")
        self.endpoint = endpoint

    def start(self) -> None:
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.endpoint)))

    def request(
        self, *, method: str, route: str, request_id: str, started: float, parent: Mapping[str, str]
    ) -> OtelRequest:
        context = _PROPAGATOR.extract(parent) if parent else None
        attributes = {
            "http.request.method": method,
            "http.route": route,
            "gen_ai.system": SYSTEM,
            "gen_ai.request.id": request_id,
        }
        span = self.tracer.start_span(
            f"{method} {route}", context, kind=SpanKind.SERVER, attributes=attributes, start_time=_ns_since(started)
        )
        return OtelRequest(self, span, started, request_id)

    def shutdown(self) -> None:
        self.provider.force_flush(timeout_millis=5000)
        self.provider.shutdown()
