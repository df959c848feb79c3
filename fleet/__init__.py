"""The fleet's contract, shared by vllm-proxy and vllm-registrar: the etcd client (``etcd``), the key layout and
node record (``records``, ``pb``), what a vLLM node says about itself (``vllm``: models, load) and the HTTP client
both use to ask it (``httpclient``); flags and environment (``flags``) and ``--version`` (``version``) for every
program."""
