"""The request path: ``api`` (raw ASGI routes) reads the request with ``parsing`` and ``guard``, the
``forwarder`` picks nodes and sends through the ``transport``; ``disagg`` builds the prefill and decode legs,
``relay`` streams the answer back and, with ``resume``, continues a stream whose node died."""
