"""The HTTP client to the nodes: one-method ``Transport`` (transport.py) over pooled keep-alive connections
(connections.py, connection.py). Used by serving/ (the request path) and discovery/ (the load scrape) alike, so
it sits below both and imports neither."""
