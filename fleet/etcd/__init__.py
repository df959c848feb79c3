"""The only code that talks to etcd: a small asyncio etcd v3 client on grpc.aio.

``settings`` (how to reach etcd), ``client`` (unary calls that fail over between members: KV, leases),
``streams`` (lease keep-alive, watch; both make etcd answer, so silence means a dead connection), ``values``
(keys, values, events as frozen dataclasses, so no other module imports the generated protobuf code),
``errors`` (the tree below; gRPC errors never leave the package)::

    EtcdError              etcd refused or failed a request (``.code`` is the gRPC status name, if any)
    +-- EtcdUnavailable    no endpoint answered in time, a stream broke or went silent: retry, resume
    +-- Compacted          a watch's start revision was compacted away: re-list
    +-- LeaseLost          a lease expired, was revoked, or could not be refreshed within its TTL
    +-- EtcdAuthError      bad user or password, or permission denied
"""

from vllm_etcd_proxy.fleet.etcd.client import EtcdClient
from vllm_etcd_proxy.fleet.etcd.errors import Compacted, EtcdAuthError, EtcdError, EtcdUnavailable, LeaseLost
from vllm_etcd_proxy.fleet.etcd.settings import (
    BURST_PAUSE,
    DEAD_AFTER,
    KEEPALIVE_TIME,
    KEEPALIVE_TIMEOUT,
    TIMEOUT,
    EtcdSettings,
    parse_endpoints,
)
from vllm_etcd_proxy.fleet.etcd.values import Event, EventType, KeyValue, WatchBatch

__all__ = [
    "BURST_PAUSE",
    "DEAD_AFTER",
    "KEEPALIVE_TIME",
    "KEEPALIVE_TIMEOUT",
    "TIMEOUT",
    "Compacted",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdSettings",
    "EtcdUnavailable",
    "Event",
    "EventType",
    "KeyValue",
    "LeaseLost",
    "WatchBatch",
    "parse_endpoints",
]
