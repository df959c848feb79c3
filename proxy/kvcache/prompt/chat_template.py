"""A chat request's prompt text, rendered with the model's Jinja2 chat template as vLLM renders it.

vLLM (entrypoints/chat_utils.py) first turns the request's messages into a conversation: with a template that
reads ``content`` as a string, the text parts of a message are joined with newlines (``None`` content is "");
with one that loops over ``message['content']`` (the "openai" format) they stay ``{"type": "text", "text": ...}``
parts; ``tool_calls``, ``reasoning``, ``tool_call_id`` and ``name`` are kept, and tool-call arguments given as a
JSON string become objects. Then transformers' ``apply_chat_template(tokenize=False)`` renders it in a sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` that does
not escape HTML, ``raise_exception`` and ``strftime_now``, given ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's special tokens and the request's ``chat_template_kwargs``; with
``continue_final_message`` the text is cut after the last message's content. Media parts have placeholders only
the model's processor knows: such a conversation is not rendered here (``Unsupported``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
"""Content part types vLLM reads as text, and the key holding it."""


class Unsupported(ValueError):
    """A request whose prompt cannot be known here (media parts, a request-supplied template, both prompt flags)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One model's compiled template and the content format vLLM detects for it."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        self.openai_content = _loops_over_content(env.parse(source))
        """True: content stays a list of parts (vLLM's "openai" format); False: one string ("string")."""
        self._special = dict(special_tokens)

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text of a chat completions body; ``Unsupported`` or ``ValueError``/``TemplateError`` when
        vLLM would not render it either."""
        if body.get("chat_template") is not None:
            raise Unsupported("a chat template in the request")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict) or {"chat_template", "tokenize"} & extra.keys():
            raise Unsupported("chat_template_kwargs must be an object without chat_template or tokenize")
        # vLLM starts from the request's fields and lets chat_template_kwargs override them.
        context: dict[str, Any] = {
            **self._special,
            "tools": _tools(body),
            "documents": body.get("documents"),
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
        }
        context.update((k, v) for k, v in extra.items() if k in self.variables or k in context)
        add, final = context.pop("add_generation_prompt"), context.pop("continue_final_message")
        if not isinstance(add, bool) or not isinstance(final, bool) or (add and final):
            raise Unsupported("add_generation_prompt and continue_final_message must be booleans, not both true")
        context.pop("messages", None)
        conversation = list(self._conversation(body.get("messages")))
        text = self._template.render(messages=conversation, add_generation_prompt=add, **context)
        return _cut_after_final(text, conversation[-1]) if final else text

    def _conversation(self, messages: Any) -> Iterator[dict[str, Any]]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError("each message must be an object with a role")
            yield self._message(message)

    def _message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        role, content = message["role"], message.get("content")
        parts = [] if content is None else [content] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ValueError("content must be a string or a list of parts")
        texts = [t for t in map(_part_text, parts) if t is not None]
        out: dict[str, Any] = {"role": role}
        out["content"] = [{"type": "text", "text": t} for t in texts] if self.openai_content else "\n".join(texts)
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if role == "assistant":
            if message.get("tool_calls") is not None:
                out["tool_calls"] = [_tool_call(call) for call in message["tool_calls"]]
            if reasoning is not None:
                out["reasoning"] = out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        return out


def _part_text(part: Any) -> str | None:
    """A text part's text; None for one vLLM skips (text None); ``Unsupported`` for media."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or "uuid" in part:
        raise Unsupported("a content part that is not text")
    text = part.get(_TEXT_PARTS[part["type"]])
    if text is not None and not isinstance(text, str):
        raise ValueError("a text part's text must be a string")
    return text


def _tool_call(call: Any) -> Any:
    """vLLM parses a tool call's JSON string arguments into an object (empty ones into ``{}``)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if not arguments:
        arguments = {}
    elif not isinstance(arguments, dict | list):
        arguments = json.loads(arguments)
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools as vLLM hands them over (``model_dump`` of its tool model), or None when there are none."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools
    ):
        raise ValueError("tools must be a list of function tools")
    return [
        {
            "type": t.get("type", "function"),
            "function": {
                "name": t["function"].get("name"),
                "description": t["function"].get("description"),
                "parameters": t["function"].get("parameters"),
            },
        }
        for t in tools
    ]


def _cut_after_final(text: str, final: Mapping[str, Any]) -> str:
    """transformers' continue_final_message: keep the text up to the end of the last message's content."""
    content = final["content"]
    if isinstance(content, list):
        found = [p["text"] for p in content if isinstance(p, dict) and "text" in p]
        if not found:
            raise ValueError("continue_final_message with no text in the final message")
        content = found[-1]
    stripped = content.strip()
    if stripped not in text:
        raise ValueError("the final message does not appear in the rendered chat")
    at = text.rindex(stripped)
    keep = len(content.lstrip()) if text[at : at + len(content.lstrip())] == content else len(stripped)
    return text[: at + keep]


def _loops_over_content(root: jinja2.nodes.Template) -> bool:
    """vLLM's content-format detection: some ``for`` loop iterates over a message's ``content``, where a message
    is a variable bound by a loop over ``messages`` (or assigned from ``messages[i]``)."""
    names = set(_message_names(root))
    for loop in root.find_all(jinja2.nodes.For):
        if _is_field(loop.iter, names, "content"):
            return True
    return False


def _message_names(root: jinja2.nodes.Template) -> Iterator[str]:
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and _is_var(loop.iter, "messages"):
            yield loop.target.name
    for assign in root.find_all(jinja2.nodes.Assign):
        if (
            isinstance(assign.target, jinja2.nodes.Name)
            and isinstance(assign.node, jinja2.nodes.Getitem)
            and _is_var(assign.node.node, "messages")
        ):
            yield assign.target.name


def _is_var(node: jinja2.nodes.Node, name: str) -> bool:
    """``name``, or ``name`` through a filter or a slice (``messages | reverse``, ``messages[1:]``)."""
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        return _is_var(node.node, name)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var(node.node, name)
    return isinstance(node, jinja2.nodes.Name) and node.name == name


def _is_field(node: jinja2.nodes.Node, names: set[str], field: str) -> bool:
    """``name['field']`` or ``name.field`` for one of ``names``, possibly through a filter or a slice."""
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        return _is_field(node.node, names, field)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_field(node.node, names, field)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        key = node.arg.value
    elif isinstance(node, jinja2.nodes.Getattr):
        key = node.attr
    else:
        return False
    return key == field and isinstance(node.node, jinja2.nodes.Name) and node.node.name in names
