"""vllm-sim: a CPU-only simulated vLLM node speaking vLLM's OpenAI-compatible wire format, for tests and demos.

Modules, in the order a request meets them: ``cli`` (flags -> ``settings``), ``app`` (routes, ``middleware``),
``protocol`` (vLLM's request shapes, prompts to token ids), ``tokens`` (the simulated model: tokenizer, chat
template, deterministic answers), ``disagg`` (kv_transfer_params), ``engine`` (queue, timing, records, runtime
``knobs``), ``prefix_cache`` (vLLM's automatic prefix caching), ``wire`` and ``sse`` (vLLM's response bodies,
streamed as Server-Sent Events), ``metrics`` (Prometheus), ``errors`` (vLLM's error bodies).
"""
