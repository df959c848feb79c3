"""Fault injection with counted requests (issue 3): real etcd, real processes, a steady mixed load through two
proxy replicas, and an assertion on the outcome of every request. Each scenario prints one ``scenario N [...]:``
line of counts; ``pytest tests/faults -rA`` (or ``-s``) shows them."""
