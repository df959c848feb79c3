"""What operators use: the admin API (``admin``), status routes (``info``), Prometheus ``metrics`` (and the
nodes' own, ``nodemetrics``), the ``dashboard`` page, and the supervisor of ``--workers`` processes
(``workers``)."""
