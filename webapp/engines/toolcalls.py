"""Tool calls parsed from a model's text, for engines that answer text and ids but no
structured message (vLLM's completions API). One parser per chat-template format, by name.

``hermes`` (Qwen2/2.5/3, Hermes, and every template that writes
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, as vLLM's and SGLang's own
``hermes``/``qwen25`` parsers read it): the content is the text before the first
``<tool_call>``; each block whose body is a JSON object with a string ``name`` becomes one
OpenAI tool call (``arguments`` re-encoded as a JSON string). A block that is not valid JSON
leaves the whole text as content and no tool calls: the model's answer is recorded as it was,
and the client sees that it was not a valid call. ``none``: the text is the content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["TOOL_CALL_PARSERS", "ToolCallParser", "hermes", "no_tool_calls"]

# text -> (content, tool_calls): tool_calls in OpenAI's shape, [] when none
ToolCallParser = Callable[[str], tuple[str, list[dict[str, Any]]]]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def no_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    return text, []


def hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_BLOCK.findall(text, start):
        try:
            call = json.loads(body)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str)
                                   else json.dumps(arguments, ensure_ascii=False)}})
    if not calls:  # an opened block never closed (cut by max_tokens): no call was made
        return text, []
    return text[:start].rstrip("\n"), calls


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": hermes, "none": no_tool_calls}
