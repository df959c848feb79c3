"""An OTLP/HTTP trace receiver of the test's own: a tiny HTTP server on loopback that keeps every POST
/v1/traces body and decodes it with opentelemetry-proto's ``ExportTraceServiceRequest``.

    receiver = OtlpReceiver().start()      # receiver.endpoint: http://127.0.0.1:PORT/v1/traces
    spans = receiver.wait_for_spans(3)     # flat list of Span (name, trace_id, span_id, parent_id, attributes)
    receiver.close()
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.support.procs import HOST, wait_until


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    service: str
    error: bool


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._lock:
                    receiver.paths.append(self.path)
                    receiver.bodies.append(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self._server.server_address[1]}/v1/traces"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[Span]:
        with self._lock:
            bodies = list(self.bodies)
        found = []
        for body in bodies:
            request = ExportTraceServiceRequest.FromString(body)
            for resource in request.resource_spans:
                resource_attrs = {a.key: _value(a.value) for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        found.append(
                            Span(
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                service=str(resource_attrs.get("service.name")),
                                error=s.status.code == 2,
                            )
                        )
        return found

    def wait_for_spans(self, count: int, timeout: float = 10.0, **attributes: Any) -> list[Span]:
        """Until at least ``count`` spans with all of ``attributes`` arrived; returns them all."""

        def matching() -> list[Span]:
            return [s for s in self.spans() if all(s.attributes.get(k) == v for k, v in attributes.items())]

        wait_until(lambda: len(matching()) >= count, timeout, f"{count} spans with {attributes}")
        return matching()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
