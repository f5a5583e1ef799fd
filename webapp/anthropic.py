"""Anthropic's Messages API over the session server's chat turn: the translation, both ways.

``POST /sessions/{id}/v1/messages`` (Claude Code and the ``anthropic`` SDK speak it) is one chat
turn: :func:`chat_request` makes the OpenAI chat request an equivalent OpenAI client would send,
the core runs it as ``POST /v1/chat/completions`` (the same TITO accounting, the same record, so
miles' consumer, ``/samples`` and the viewer read it unchanged), and :func:`message_reply` /
:func:`message_events` answer the committed completion in Anthropic's shape, as one JSON
message or as Anthropic's server-sent events built from the whole completion (as the OpenAI
route's stream is). Sans-I/O: dicts in, dicts and bytes out; no session, no HTTP.

The rules follow miles' Anthropic route (radixark/miles, ``feat(session): serve Anthropic Messages
through SessionCore`` and the conversion PRs it builds on) and Anthropic's API reference:

- ``system`` (a string, or text blocks joined by newlines) -> a leading system message;
- ``messages``: ``user``/``assistant`` only. Text blocks -> text (one text block: a string
  content, as an OpenAI client writes it); ``image`` with a base64 source -> an ``image_url``
  part holding the data URL (``webapp.images`` checks and hashes it; a URL source becomes an
  ``image_url`` part too, which ``webapp.images`` refuses: nothing is fetched); ``tool_use``
  (assistant) -> ``tool_calls`` (``input`` as JSON text); ``tool_result`` (user) -> a ``tool``
  message, in place (the user's blocks before and after it stay in order); ``thinking``
  (assistant history) -> ``reasoning_content`` (not rendered: the chat route drops it too);
- ``tools`` with ``input_schema`` -> function tools; ``tool_choice`` auto/any/tool/none ->
  ``auto``/``required``/the function/``none``, ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``; ``max_tokens`` (required), ``stop_sequences`` -> ``stop``,
  ``temperature``, ``top_p``, ``top_k``; ``stream`` is the reply's form only; ``metadata``
  is accepted and not forwarded (it does not change the generation); ``cache_control`` is a
  caching hint, accepted on any block and dropped (the engine caches prefixes itself).
- Refused, 400 naming the field (:class:`~webapp.session_errors.UnmappableField`): ``thinking``
  (extended thinking), server tools (a tool without ``input_schema``: web search, bash, the
  computer tool...), ``redacted_thinking``, ``document``, ``search_result`` and every other block
  type, ``tool_result`` with ``is_error: true`` (an OpenAI tool message cannot say it), and
  top-level fields that cannot reach a chat turn (``output_config``, ``mcp_servers``,
  ``container``, ``context_management``, ``service_tier``); any other unknown field:
  :class:`~webapp.session_errors.UnknownField`, as on the chat route.

The reply: ``id`` ``msg_`` + the completion's id (names the record), text then ``tool_use`` blocks
(``input`` parsed from the arguments; a thinking block first when the engine separated
reasoning), ``stop_reason`` ``end_turn``/``max_tokens``/``stop_sequence`` (with the matched
``stop_sequence`` when the engine says which, SGLang's ``matched_stop``)/``tool_use`` (whenever a
tool was called)/``refusal`` (content filter), ``usage`` ``input_tokens``/``output_tokens``. An
aborted generation answers 529 ``overloaded_error`` (miles' rule: retry it).

Replayed tool calls keep the model's own JSON spelling: :func:`restore_tool_arguments` puts back
the arguments text of the stored call with the same id when it parses to the same value, so the
stored conversation compares equal and the prompt ids stay append-only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from webapp.routes import anthropic_error_body
from webapp.session_errors import GenerationAborted, InvalidField, UnknownField, UnmappableField

__all__ = ["ABORTED", "MESSAGE_FIELDS", "anthropic_error", "chat_request", "message_events", "message_reply",
           "restore_tool_arguments", "stored_tool_arguments"]

log = logging.getLogger(__name__)

# Top-level fields: forwarded (translated) or used for the reply.
MESSAGE_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream",
                            "temperature", "top_k", "top_p", "tools", "tool_choice"})
# Known to Anthropic's API, with no chat-turn equivalent: refused with the reason.
_REFUSED_FIELDS = {
    "thinking": "extended thinking is not supported by this endpoint (the engine's reasoning, if any, "
                "comes back as a thinking block without being asked)",
    "output_config": "not supported by this endpoint",
    "mcp_servers": "MCP servers are Anthropic's server-side tools; not supported by this endpoint",
    "container": "Anthropic's code-execution containers are not supported by this endpoint",
    "context_management": "Anthropic's context editing is not supported: the session's context is append-only",
    "service_tier": "not supported by this endpoint",
    "betas": "beta features are not supported by this endpoint",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
ABORTED = "abort"  # the finish reason of an aborted generation: 529 overloaded_error, retry
_BLOCK_KEYS = {  # the keys each accepted block may carry (``cache_control`` everywhere)
    "text": {"type", "text", "cache_control", "citations"},
    "image": {"type", "source", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}
_TOOL_KEYS = {"name", "description", "input_schema", "cache_control", "type"}


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise InvalidField(where, f"expected an object, got {type(value).__name__}")
    return value


def _string(value: Any, where: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise InvalidField(where, "expected a non-empty string" if not empty else "expected a string")
    return value


def _number(request: Mapping[str, Any], name: str) -> None:
    value = request.get(name)
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
        raise InvalidField(name, "expected a number")


def _check_keys(block: Mapping[str, Any], allowed: set[str], where: str) -> None:
    """A key outside ``allowed`` is refused, unless null: the SDK's models echo every optional
    field they know (``caller: null``, ``citations: null``), and null asks for nothing."""
    for key, value in block.items():
        if key not in allowed and value is not None:
            raise UnmappableField(f"{where}.{key}", f"not a field this endpoint can map onto a chat turn "
                                                    f"(accepted: {', '.join(sorted(allowed))})")


def _block_type(block: Any, where: str) -> str:
    block = _object(block, where)
    kind = block.get("type")
    if kind not in _BLOCK_KEYS:
        raise UnmappableField(f"{where}.type", f"block type {kind!r} cannot be mapped onto a chat turn "
                                               f"(accepted: {', '.join(_BLOCK_KEYS)})")
    _check_keys(block, _BLOCK_KEYS[kind], where)
    return str(kind)


def _text(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if block.get("citations"):  # a list of citations: Anthropic's document feature, nothing to map to
        raise UnmappableField(f"{where}.citations", "citations cannot be mapped onto a chat turn")
    return {"type": "text", "text": _string(block.get("text"), f"{where}.text")}


def _image(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    source = _object(block.get("source"), f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media = _string(source.get("media_type"), f"{where}.source.media_type", empty=False)
        data = _string(source.get("data"), f"{where}.source.data", empty=False)
        url = f"data:{media};base64,{data}"
    elif kind == "url":  # webapp.images refuses it by name (RemoteImageURL): nothing is fetched
        url = _string(source.get("url"), f"{where}.source.url", empty=False)
    else:
        raise UnmappableField(f"{where}.source.type", f"image source {kind!r} cannot be mapped (base64 only)")
    return {"type": "image_url", "image_url": {"url": url}}


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """One text part is a string content, as an OpenAI client writes it; else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return list(parts)


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    if block.get("is_error") is True:
        raise UnmappableField(f"{where}.is_error", "an OpenAI tool message cannot mark an error; "
                                                   "say it in the content")
    if block.get("is_error") not in (None, False):
        raise InvalidField(f"{where}.is_error", "expected a boolean")
    call_id = _string(block.get("tool_use_id"), f"{where}.tool_use_id", empty=False)
    raw = block.get("content")
    content: str | list[dict[str, Any]]
    if raw is None:
        content = ""
    elif isinstance(raw, str):
        content = raw
    elif isinstance(raw, list):
        parts = []
        for k, inner in enumerate(raw):
            at = f"{where}.content[{k}]"
            kind = _block_type(inner, at)
            if kind == "text":
                parts.append(_text(inner, at))
            elif kind == "image":
                parts.append(_image(inner, at))
            else:
                raise UnmappableField(f"{at}.type", f"a tool result holds text and image blocks, not {kind!r}")
        content = _content(parts) if parts else ""
    else:
        raise InvalidField(f"{where}.content", "expected a string or a list of blocks")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    arguments = _object(block.get("input", {}), f"{where}.input")
    return {"id": _string(block.get("id"), f"{where}.id", empty=False), "type": "function",
            "function": {"name": _string(block.get("name"), f"{where}.name", empty=False),
                         # the hermes parser's spelling; restore_tool_arguments puts the stored one back
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _user(content: list[Any], where: str, out: list[dict[str, Any]]) -> None:
    parts: list[dict[str, Any]] = []

    def flush() -> None:
        if parts:
            out.append({"role": "user", "content": _content(parts)})
            parts.clear()

    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "image":
            parts.append(_image(block, at))
        elif kind == "tool_result":
            flush()  # the blocks before a tool result stay before it
            out.append(_tool_result(block, at))
        else:
            raise UnmappableField(f"{at}.type", f"a user message cannot hold a {kind!r} block")
    flush()


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif kind == "thinking":
            reasoning.append(_string(block.get("thinking"), f"{at}.thinking"))
        else:
            raise UnmappableField(f"{at}.type", f"an assistant message cannot hold a {kind!r} block")
    message: dict[str, Any] = {"role": "assistant", "content": _content(parts) if parts else ""}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(request: Mapping[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = request.get("system")
    if isinstance(system, list):
        texts = []
        for k, block in enumerate(system):
            at = f"system[{k}]"
            if _block_type(block, at) != "text":
                raise UnmappableField(f"{at}.type", "system blocks are text blocks")
            texts.append(_text(block, at)["text"])
        system = "\n".join(texts)
    elif system is not None and not isinstance(system, str):
        raise InvalidField("system", "expected a string or a list of text blocks")
    if system:
        out.append({"role": "system", "content": system})
    raw = request.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidField("messages", "expected a non-empty list")
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        message = _object(message, where)
        _check_keys(message, {"role", "content"}, where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise InvalidField(f"{where}.role", f"expected 'user' or 'assistant', got {role!r} "
                                                "(the system prompt is the top-level 'system')")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise InvalidField(f"{where}.content", "expected a string or a list of blocks")
        elif role == "user":
            _user(content, where, out)
        else:
            out.append(_assistant(content, where))
    return out


def _tools(request: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    raw = request.get("tools")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidField("tools", "expected a list")
    tools = []
    for k, tool in enumerate(raw):
        where = f"tools[{k}]"
        tool = _object(tool, where)
        if "input_schema" not in tool or tool.get("type") not in (None, "custom"):
            raise UnmappableField(f"{where}.type", f"server tool {tool.get('type')!r} ({tool.get('name')!r}) "
                                                   "cannot be mapped: only custom tools with an input_schema")
        _check_keys(tool, _TOOL_KEYS, where)
        function: dict[str, Any] = {"name": _string(tool.get("name"), f"{where}.name", empty=False)}
        if tool.get("description") is not None:
            function["description"] = _string(tool["description"], f"{where}.description")
        function["parameters"] = _object(tool["input_schema"], f"{where}.input_schema")
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(request: Mapping[str, Any], tools: list[dict[str, Any]] | None, out: dict[str, Any]) -> None:
    raw = request.get("tool_choice")
    if raw is None:
        return
    choice = _object(raw, "tool_choice")
    kind = choice.get("type")
    _check_keys(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    names = [t["function"]["name"] for t in tools or ()]
    if kind in ("any", "tool") and not names:
        raise InvalidField("tool_choice", f"type {kind!r} needs tools")
    if kind == "auto" or kind == "none":
        out["tool_choice"] = kind
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "tool":
        name = _string(choice.get("name"), "tool_choice.name", empty=False)
        if name not in names:
            raise InvalidField("tool_choice.name", f"{name!r} is not one of the tools")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise InvalidField("tool_choice.type", f"expected auto, any, tool or none, got {kind!r}")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidField("tool_choice.disable_parallel_tool_use", "expected a boolean")
    if parallel:
        out["parallel_tool_calls"] = False


def chat_request(request: Any) -> dict[str, Any]:
    """An Anthropic Messages request (the decoded body) -> the OpenAI chat request of the same
    turn (never streaming: the reply's form is :func:`message_reply` or :func:`message_events`).
    Raises a 400 :class:`SessionError` naming the field for anything that cannot be mapped."""
    request = _object(request, "request")
    for name in request:
        if name in _REFUSED_FIELDS:
            raise UnmappableField(name, _REFUSED_FIELDS[name])
        if name not in MESSAGE_FIELDS:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise UnknownField(shown, "not a Messages API field this endpoint maps onto a chat turn")
    model = _string(request.get("model"), "model", empty=False)
    max_tokens = request.get("max_tokens")
    if max_tokens is None:
        raise InvalidField("max_tokens", "required by the Messages API")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidField("max_tokens", "expected a positive integer")
    if not isinstance(request.get("stream", False), bool):
        raise InvalidField("stream", "expected a boolean")
    if request.get("metadata") is not None:
        _object(request["metadata"], "metadata")
    out: dict[str, Any] = {"model": model, "messages": _messages(request), "max_tokens": max_tokens}
    for name in ("temperature", "top_p"):
        _number(request, name)
        if request.get(name) is not None:
            out[name] = request[name]
    top_k = request.get("top_k")
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise InvalidField("top_k", "expected a positive integer")
        out["top_k"] = top_k
    stops = request.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidField("stop_sequences", "expected a list of non-empty strings")
        if stops:
            out["stop"] = stops
    tools = _tools(request)
    if tools:
        out["tools"] = tools
    _tool_choice(request, tools, out)
    return out


def stored_tool_arguments(*conversations: Any) -> dict[str, str]:
    """Tool call id -> its arguments text, over stored conversations' assistant messages."""
    spelled: dict[str, str] = {}
    for messages in conversations:
        for message in messages or ():
            for call in message.get("tool_calls") or ():
                arguments = (call.get("function") or {}).get("arguments")
                if isinstance(call.get("id"), str) and isinstance(arguments, str):
                    spelled[call["id"]] = arguments
    return spelled


def restore_tool_arguments(messages: list[dict[str, Any]], spelled: Mapping[str, str]) -> None:
    """Give each replayed tool call the stored call's arguments text (same id, same value), so
    the conversation compares equal to the stored one whatever JSON spelling the model used."""
    for message in messages:
        for call in message.get("tool_calls") or ():
            stored = spelled.get(call["id"])
            if stored is None:
                continue
            try:
                same = json.loads(stored) == json.loads(call["function"]["arguments"])
            except ValueError:
                same = False
            if same:
                call["function"]["arguments"] = stored


def _tool_input(name: Any, arguments: Any) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        value = None
    if not isinstance(value, dict):  # Anthropic's input is an object; the record keeps the text as it was
        log.warning("tool call %r: arguments are not a JSON object (%.200r); answered as {}", name, arguments)
        return {}
    return value


def _stop(choice: Mapping[str, Any], stops: list[str], blocks: list[dict[str, Any]]) -> tuple[str, str | None]:
    finish = choice.get("finish_reason") or "stop"
    if any(block["type"] == "tool_use" for block in blocks):
        return "tool_use", None  # a call was made, whatever the engine called the finish
    if finish == "stop" and stops:
        info = (choice.get("meta_info") or {}).get("finish_reason")
        matched = choice.get("matched_stop", info.get("matched") if isinstance(info, dict) else None)
        if isinstance(matched, str) and matched in stops:
            return "stop_sequence", matched
    return _STOP_REASONS.get(str(finish), "end_turn"), None


def message_reply(completion: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """The committed OpenAI completion as Anthropic's message (``request``: the Messages request,
    for its stop sequences). Raises a 529 :class:`SessionError` for an aborted generation."""
    choices = completion.get("choices") or [{}]
    choice = choices[0]
    if choice.get("finish_reason") == ABORTED:
        raise GenerationAborted("the generation was aborted; retry the request")
    message = choice.get("message") or {}
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning})  # no signature: none to give
    content = message.get("content")
    if isinstance(content, str) and content:
        blocks.append({"type": "text", "text": content})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": str(call.get("id") or ""), "name": str(function.get("name") or ""),
                       "input": _tool_input(function.get("name"), function.get("arguments"))})
    if not blocks:
        blocks.append({"type": "text", "text": ""})  # Anthropic's content holds one block at least
    stop_reason, stop_sequence = _stop(choice, list(request.get("stop_sequences") or ()), blocks)
    usage = completion.get("usage") or {}
    return {"id": f"msg_{completion.get('id', '')}", "type": "message", "role": "assistant",
            "model": completion.get("model") or request.get("model", ""), "content": blocks,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": int(usage.get("prompt_tokens") or 0),
                      "output_tokens": int(usage.get("completion_tokens") or 0)}}


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: ".encode() + json.dumps({"type": name, **data}, ensure_ascii=False,
                                                          separators=(",", ":")).encode() + b"\n\n"


def message_events(message: Mapping[str, Any]) -> list[bytes]:
    """A whole message (:func:`message_reply`) as Anthropic's stream: ``message_start``, per block
    ``content_block_start``/``_delta``/``_stop`` (one delta holding the block), ``message_delta``
    (stop reason, output tokens), ``message_stop``."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}
    events = [_event("message_start", {"message": start})]
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            empty: dict[str, Any] = {"type": "text", "text": ""}
            delta: dict[str, Any] = {"type": "text_delta", "text": block["text"]}
        elif kind == "thinking":
            empty = {"type": "thinking", "thinking": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            empty = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        events.append(_event("content_block_start", {"index": index, "content_block": empty}))
        events.append(_event("content_block_delta", {"index": index, "delta": delta}))
        events.append(_event("content_block_stop", {"index": index}))
    events.append(_event("message_delta", {"delta": {"stop_reason": message["stop_reason"],
                                                     "stop_sequence": message["stop_sequence"]},
                                           "usage": {"output_tokens": usage["output_tokens"]}}))
    events.append(_event("message_stop", {}))
    return events


def anthropic_error(status: int, body: bytes) -> dict[str, Any]:
    """Another route's error reply (the chat turn's OpenAI ``{"error": {"message"...}}``, miles'
    ``{"error": "<text>"}``, or the engine's own body relayed) in Anthropic's shape."""
    message = None
    try:
        decoded = json.loads(body) if body else None
    except ValueError:
        decoded = None
        message = body[:500].decode("utf-8", "replace")
    if isinstance(decoded, dict):
        error = decoded.get("error", decoded)
        if isinstance(error, dict):
            message = error.get("message") if isinstance(error.get("message"), str) else None
        elif isinstance(error, str):
            message = error
    return anthropic_error_body(status, message or f"request failed with HTTP {status}")
