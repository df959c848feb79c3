"""vllm-proxy: an OpenAI-compatible front door for a vLLM fleet discovered through etcd.

A request's path, folder by folder: ``discovery`` (etcd watch -> events -> pool; the nodes' models, load and
health) -> ``routing`` (a policy picks a node, by prefix affinity or load) -> ``serving`` (the OpenAI routes,
the forwarder and its transport to the node, the prefill -> decode exchange, the relay back to the client).
``operations`` holds what operators use (admin API, status routes, metrics, worker processes); ``app.py`` wires
it all in the lifespan, ``cli.py`` turns flags into ``settings.py``, ``errors.py`` is the one error tree.
"""
