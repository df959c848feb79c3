"""vllm-proxy: an OpenAI-compatible front door for a vLLM fleet discovered through etcd.

Data flows etcd.py -> discovery.py -> pool.py -> balancer.py -> forwarder.py/disagg.py -> app.py.
records.py holds the etcd key layout and node record shared with the registrar.
"""
