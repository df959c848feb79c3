"""What the request path records: Prometheus counters and histograms (``metrics``), and OpenTelemetry traces, off
unless configured (``--otlp-traces-endpoint``): the interface the request path calls (``spans``) and its one
implementation on the OpenTelemetry SDK (``otel``, imported only when tracing is on; it needs the ``otel`` extra).
This room sits below the request path; ``operations/`` serves the /metrics page that reads it."""
