"""Tenants: client keys that name a tenant and its limits (keys.py), the fleet share of those limits
(replicas.py, limits.py), and fair queueing while a model's nodes are full (queue.py); admission.py is the one
narrow door the request path goes through."""
