"""Which nodes exist and how they are: the etcd watch (``watch``) turns keys into ``events``, the ``pool`` applies
them and is the one writer of each node's state; ``prober`` learns models, ``loadwatch`` scrapes load,
``ejection`` takes failing nodes out and probes them back."""
