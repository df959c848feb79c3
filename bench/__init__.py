"""Benchmarks that start real processes on loopback (``python -m bench.proxy_overhead``); see bench/README.md."""
