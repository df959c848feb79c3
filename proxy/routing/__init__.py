"""Which node gets a request: ``balancer`` holds the policies (pure functions of the candidates' state),
``affinity`` the prompt-prefix key that keeps a conversation on the node whose cache holds it, ``kv_aware`` the
policy that reads what the nodes' caches hold (kvcache/)."""
