"""What each node's KV cache holds, from the nodes' own events, and what a request's prompt is in the same terms.

A node's events come in (``reader``: one thread reads every node's sockets; ``subscription``: one node's
sequence, gaps, replays and restarts; ``wire``: vLLM's frames; ``replay``: its replay socket; ``nodes``: a
subscription per publishing node of the pool) and change the ``index`` (block keys -> the nodes holding them,
packed in ``blocks``; each node's ``conversations``, from the shape of its stores). ``prompt`` turns a request
into token ids and block keys as the index names them. Below routing: the kv-aware policy (routing/kv_aware.py)
reads the index; nothing here decides where a request goes.
"""
