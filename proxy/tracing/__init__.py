"""OpenTelemetry traces of the request path, off unless configured (``--otlp-traces-endpoint``): the interface
the request path calls (``spans``) and its one implementation on the OpenTelemetry SDK (``otel``, imported only
when tracing is on; it needs the ``otel`` extra)."""
