"""Adding one field to a client's JSON body without re-encoding the rest (the client's bytes stay as they came)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson


def with_field(raw: bytes, body: Mapping[str, Any], name: str, value: Any) -> bytes:
    """``raw`` (whose parsed form is ``body``) with ``name`` set to ``value``.

    When ``name`` is new, its bytes go in before the closing brace and nothing else changes; otherwise (or when
    ``raw`` does not end in a brace) the body is re-encoded.
    """
    end = raw.rstrip()
    if name not in body and end.endswith(b"}"):
        inner = end[:-1]
        comma = b"" if inner.rstrip().endswith(b"{") else b","
        return b'%s%s"%s":%s}' % (inner, comma, name.encode(), orjson.dumps(value))
    changed = dict(body)
    changed[name] = value
    return orjson.dumps(changed)
