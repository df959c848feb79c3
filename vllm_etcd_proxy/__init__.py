"""vllm-etcd-proxy, as installed: one top-level name, so nothing else's ``proxy`` or ``sim`` is shadowed.

The subpackages are the repository's top-level folders, linked here (``fleet``: what both programs share;
``proxy``: vllm-proxy; ``registrar``: vllm-registrar; ``sim``: vllm-sim, the simulated node). Import them by
their full names (``vllm_etcd_proxy.proxy.app``); tests/test_layout.py checks that nothing imports the short ones.
"""
