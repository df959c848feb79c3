"""vllm-registrar: keeps one vLLM node registered in etcd under a lease while it is healthy; drains it on SIGTERM."""
