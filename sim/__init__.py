"""vllm-sim: a CPU-only simulated vLLM node speaking vLLM's OpenAI-compatible wire format, for tests and demos.

Modules, in the order a request meets them: ``cli`` (flags -> ``settings``), ``app`` (routes, ``middleware``),
``protocol`` (vLLM's request shapes, prompts to token ids), ``tokens`` (the simulated model: tokenizer, chat
template, deterministic answers), ``disagg`` (kv_transfer_params), ``engine`` (queue, timing, runtime ``knobs``, sleep
mode), ``record`` and ``recording`` (what the node saw of each request), ``prefix_cache`` (vLLM's automatic prefix
caching), ``wire`` and ``sse`` (vLLM's response bodies, streamed as Server-Sent Events), ``metrics`` (Prometheus),
``errors`` (vLLM's error bodies). The other routes of vLLM's API, each in its own module: ``responses`` (with
``responses_wire`` and ``response_store``: the Responses API), ``audio`` (multipart speech-to-text), ``realtime``
(the WebSocket), ``pooling`` (embeddings, score, rerank, classify), ``tokens_api`` (/inference/v1/generate,
/tokenizer_info), ``anthropic`` (/v1/messages), ``admin`` (sleep mode, LoRA adapters, cache and profiler).
"""
