from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeRecord(_message.Message):
    __slots__ = ("url", "role", "models", "status", "labels", "version", "registered_at", "kv_connector", "source", "model_cards", "kv_events", "kv_events_replay", "sleep")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    URL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CARDS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_REPLAY_FIELD_NUMBER: _ClassVar[int]
    SLEEP_FIELD_NUMBER: _ClassVar[int]
    url: str
    role: str
    models: _containers.RepeatedScalarFieldContainer[str]
    status: str
    labels: _containers.ScalarMap[str, str]
    version: str
    registered_at: str
    kv_connector: str
    source: str
    model_cards: _containers.RepeatedCompositeFieldContainer[_struct_pb2.Struct]
    kv_events: str
    kv_events_replay: str
    sleep: str
    def __init__(self, url: _Optional[str] = ..., role: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., status: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., version: _Optional[str] = ..., registered_at: _Optional[str] = ..., kv_connector: _Optional[str] = ..., source: _Optional[str] = ..., model_cards: _Optional[_Iterable[_Union[_struct_pb2.Struct, _Mapping]]] = ..., kv_events: _Optional[str] = ..., kv_events_replay: _Optional[str] = ..., sleep: _Optional[str] = ...) -> None: ...
