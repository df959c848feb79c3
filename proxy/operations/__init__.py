"""What operators use: the admin API (``admin``), status routes (``info``), Prometheus ``metrics``, and the
supervisor of ``--workers`` processes (``workers``)."""
