"""vllm-sim: a CPU-only simulated vLLM node speaking vLLM's OpenAI-compatible wire format, for tests and demos.

Modules, in the order a request meets them: ``cli`` (flags -> ``settings``), ``app`` (routes, ``middleware``),
``protocol`` (vLLM's request/response shapes), ``disagg`` (kv_transfer_params), ``engine`` (queue, timing,
records), ``metrics`` (Prometheus), ``errors`` (vLLM's error bodies).
"""
