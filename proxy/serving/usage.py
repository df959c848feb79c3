"""Token counts from the end of an answer, without parsing it: vLLM puts ``usage`` in a non-streamed answer's
body and, with ``stream_options.include_usage``, in a stream's last event before ``[DONE]``. Read once per
request from the last bytes relayed (never per chunk)."""

from __future__ import annotations

import re

_USAGE = re.compile(rb'"usage"\s*:\s*\{([^{}]*)')
_PROMPT = re.compile(rb'"(?:prompt_tokens|input_tokens)"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion_tokens|output_tokens)"\s*:\s*(\d+)')
TAIL_BYTES = 2048
"""How much of an answer's end is searched: usage sits in its last event (or last object member)."""


def usage_of(tail: bytes) -> tuple[int | None, int | None]:
    """(prompt tokens, completion tokens) from the last ``usage`` object in ``tail``; None for what it lacks."""
    at = tail.rfind(b'"usage"', max(0, len(tail) - TAIL_BYTES))
    found = _USAGE.match(tail, at) if at >= 0 else None
    if found is None:
        return None, None
    fields = found.group(1)
    prompt, completion = _PROMPT.search(fields), _COMPLETION.search(fields)
    return (int(prompt.group(1)) if prompt else None, int(completion.group(1)) if completion else None)
