"""The model a request names, in a JSON body or outside one: a ``multipart/form-data`` field, a urlencoded
form, the query (``request_model``).

vLLM's audio routes take a multipart upload whose ``model`` is a form field. The proxy forwards the body as it
arrived; here it only finds that one field, by searching the body in place: the upload is never copied or
decoded, only the small headers of each part and the field's own value are.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from typing import Any

from vllm_etcd_proxy.proxy.errors import BadRequest, NoNodeAvailable
from vllm_etcd_proxy.proxy.serving.parsing import ClientRequest, check_fields, model_field, parse_object
from vllm_etcd_proxy.proxy.serving.routes import Kind

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
    separator = b"\r\n" + delimiter
    position = _first_part(body, delimiter)
    while not body.startswith(b"--", position):  # else the closing delimiter
        head_end = body.find(b"\r\n\r\n", position)
        if head_end < 0:
            raise BadRequest("multipart part without a header block")
        value_start = head_end + 4
        value_end = body.find(separator, value_start)
        if value_end < 0:
            raise BadRequest("multipart body is not closed by its boundary")
        if _part_name(body[position:head_end]) == wanted:
            return _field_text(body[value_start:value_end], name)
        position = value_end + len(separator)
    return None


def _first_part(body: bytes, delimiter: bytes) -> int:
    """Where the first part's headers start (after the first delimiter and any preamble before it)."""
    if body.startswith(delimiter):
        return len(delimiter)
    start = body.find(b"\r\n" + delimiter)
    if start < 0:
        raise BadRequest("multipart body is not framed by its boundary")
    return start + 2 + len(delimiter)


def _field_text(value: bytes, name: str) -> str:
    if len(value) > MAX_FIELD:
        raise BadRequest(f"form field {name!r} is too long", param=name)
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise BadRequest(f"form field {name!r} is not UTF-8", param=name) from None


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


def request_model(
    client: ClientRequest, raw: bytes, query: bytes, kind: Kind, path: str, served: Callable[[], list[str]]
) -> tuple[dict[str, Any] | None, str]:
    """The parsed JSON body (None for another kind of body) and the model the request is for; a request that
    names none goes to the fleet's first model (``served()``)."""
    body: dict[str, Any] | None = None
    model: str | None = None
    media = media_type(client.content_type)
    if media == b"multipart/form-data":
        model = multipart_field(raw, client.content_type or b"", "model")
    elif media == b"application/x-www-form-urlencoded":
        model = urlencoded_field(raw, "model")
    elif kind is not Kind.FORWARD or media == b"application/json" or raw.lstrip().startswith(b"{"):
        body = parse_object(raw)
        model = check_fields(body, path) if kind is Kind.GENERATE else model_field(body)
    if model is None and query:
        model = urlencoded_field(query, "model")
    if model is None:
        models = served()
        if not models:
            raise NoNodeAvailable("no node is available for any model right now; retry shortly")
        model = models[0]
    return body, model
