"""Which node gets a request: ``balancer`` holds the policies (pure functions of the candidates' state),
``affinity`` the prompt-prefix key that keeps a conversation on the node whose cache holds it."""
