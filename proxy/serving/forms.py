"""The model a request names outside a JSON body: a ``multipart/form-data`` field, a urlencoded form, the query.

vLLM's audio routes take a multipart upload whose ``model`` is a form field. The proxy forwards the body as it
arrived; here it only finds that one field, by searching the body in place: the upload is never copied or
decoded, only the small headers of each part and the field's own value are.
"""

from __future__ import annotations

import re
import urllib.parse

from vllm_etcd_proxy.proxy.errors import BadRequest

_BOUNDARY = re.compile(rb'boundary=(?:"([^"]{1,200})"|([^\s;,]{1,200}))', re.IGNORECASE)
_FIELD_NAME = re.compile(rb'(?:^|;)\s*name="([^"]*)"', re.IGNORECASE)
MAX_FIELD = 4096
"""Largest form value read as text (model names are far shorter)."""


def media_type(content_type: bytes | None) -> bytes:
    """``multipart/form-data`` of ``multipart/form-data; boundary=x``, lowercased; empty when absent."""
    return (content_type or b"").split(b";", 1)[0].strip().lower()


def multipart_field(body: bytes, content_type: bytes, name: str) -> str | None:
    """The value of the form field ``name`` (not a file) in a multipart body, or None when it has none.

    Raises ``BadRequest`` when the content type has no boundary or the body is not framed by it.
    """
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise BadRequest("multipart/form-data request without a boundary")
    delimiter = b"--" + (match.group(1) or match.group(2))
    wanted = name.encode()
    if not body.startswith(delimiter):
        start = body.find(b"\r\n" + delimiter)
        if start < 0:
            raise BadRequest("multipart body is not framed by its boundary")
        position = start + 2 + len(delimiter)
    else:
        position = len(delimiter)
    separator = b"\r\n" + delimiter
    while True:
        if body.startswith(b"--", position):
            return None  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", position)
        if head_end < 0:
            raise BadRequest("multipart part without a header block")
        value_start = head_end + 4
        value_end = body.find(separator, value_start)
        if value_end < 0:
            raise BadRequest("multipart body is not closed by its boundary")
        if _part_name(body[position:head_end]) == wanted:
            if value_end - value_start > MAX_FIELD:
                raise BadRequest(f"form field {name!r} is too long", param=name)
            try:
                return body[value_start:value_end].decode()
            except UnicodeDecodeError:
                raise BadRequest(f"form field {name!r} is not UTF-8", param=name) from None
        position = value_end + len(separator)


def _part_name(headers: bytes) -> bytes | None:
    """The ``name`` of a part that is a plain field; None for a file or a part without a name."""
    for line in headers.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-disposition":
            if b"filename" in value.lower():
                return None
            found = _FIELD_NAME.search(value)
            return found.group(1) if found else None
    return None


def urlencoded_field(text: bytes, name: str) -> str | None:
    """The first value of ``name`` in a query string or an ``application/x-www-form-urlencoded`` body."""
    try:
        values = urllib.parse.parse_qs(text.decode("ascii"), keep_blank_values=False).get(name)
    except UnicodeDecodeError:
        raise BadRequest("form or query string is not ASCII") from None
    return values[0] if values else None
