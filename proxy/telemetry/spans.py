"""What the request path asks of tracing, and nothing more: a span per client request, a child per leg.

With tracing off there is no tracer at all (``make_tracer`` returns None) and no tracing layer: a request's trace is
``NO_TRACE``, whose legs' spans do nothing, so the request path never asks whether tracing is on. The implementation
(``otel.py``) is imported only when tracing is configured, so a replica without the ``otel`` extra runs exactly as
before."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Protocol

TRACE_HEADERS = frozenset([b"traceparent", b"tracestate"])
"""W3C trace-context headers: with tracing on, each leg sends its own instead of the client's."""
OTEL_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


class TracingUnavailable(ValueError):
    """Tracing was configured but OpenTelemetry is not installed."""


class LegSpan(Protocol):
    """One attempt of one leg at one node."""

    @property
    def headers(self) -> bytes:
        """Header lines for the node (``traceparent``, and the client's ``tracestate``), each ending in CRLF."""
        ...

    def first_byte(self) -> None:
        """The first body byte of the node's answer reached the client."""

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None: ...

    def end(self, outcome: str, status: int | None = None) -> None:
        """The attempt ended: ``outcome`` as in ``vllm_proxy_upstream_requests`` (ok, broken, timeout...)."""


class RequestTrace(Protocol):
    """One client request's span."""

    def leg(self, *, role: str, node_id: str, url: str, model: str, attempt: int) -> LegSpan:
        """A child span for one attempt of a leg, started now."""
        ...

    def resumed(self) -> None:
        """The stream goes on from another node: the legs after this are resumes."""

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None: ...

    def end(self, status: int, model: str | None = None) -> None: ...


class Tracer(Protocol):
    def request(
        self, *, method: str, route: str, request_id: str, started: float, parent: Mapping[str, str]
    ) -> RequestTrace:
        """The span of a client request that arrived at ``started`` (``time.monotonic()``), a child of the
        client's trace when ``parent`` holds its ``traceparent``."""
        ...

    def start(self) -> None:
        """Begin exporting (a thread of the SDK's); until then spans go nowhere."""

    def shutdown(self) -> None:
        """Send what is buffered and stop (blocks; call off the event loop)."""


class _NoLeg:
    """The span of a leg when tracing is off: no headers, nothing recorded."""

    __slots__ = ()
    headers = b""

    def first_byte(self) -> None:
        pass

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        pass

    def end(self, outcome: str, status: int | None = None) -> None:
        pass


class _NoTrace:
    """A request's trace when tracing is off."""

    __slots__ = ()

    def leg(self, *, role: str, node_id: str, url: str, model: str, attempt: int) -> LegSpan:
        return NO_LEG

    def resumed(self) -> None:
        pass

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        pass

    def end(self, status: int, model: str | None = None) -> None:
        pass


NO_LEG: LegSpan = _NoLeg()
NO_TRACE: RequestTrace = _NoTrace()


def traces_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where traces go: ``--otlp-traces-endpoint`` (as in vLLM), else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``;
    None (tracing off) without either, or with ``OTEL_SDK_DISABLED=true``."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = flag or environ.get(OTEL_ENDPOINT_ENV) or None
    if endpoint is None:
        return None
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    scheme, rest = endpoint.split("://", 1)
    if "/" not in rest.rstrip("/"):  # a bare collector address, as vLLM's flag is often given: OTLP/HTTP's path
        endpoint = f"{scheme}://{rest.rstrip('/')}/v1/traces"
    return endpoint


def make_tracer(endpoint: str | None, service_name: str = "vllm-proxy") -> Tracer | None:
    """The tracer for ``endpoint`` (None: tracing off); raises ``TracingUnavailable`` without the extra."""
    if endpoint is None:
        return None
    try:
        from vllm_etcd_proxy.proxy.telemetry.otel import OtelTracer
    except ImportError as exc:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs OpenTelemetry ({exc.name} is missing): pip install 'vllm-etcd-proxy[otel]'"
        ) from None
    return OtelTracer(endpoint, service_name)


def split_trace_headers(headers: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], dict[str, str]]:
    """The client's headers without its trace context, and that context (``traceparent``, ``tracestate``)."""
    kept: list[tuple[bytes, bytes]] = []
    context: dict[str, str] = {}
    for name, value in headers:
        if name in TRACE_HEADERS:
            context[name.decode("latin-1")] = value.decode("latin-1")
        else:
            kept.append((name, value))
    return kept, context
