"""The client side of the real-engine tier: sessions and turns through the session server, and
the engine's own answer to the same token-id request (its completions API), to compare with."""

from __future__ import annotations

from typing import Any

import requests

from tests.engine.engine import Engine

__all__ = ["HISTORY", "TOOLS", "assert_record_is_the_engines", "chat", "direct", "new_session", "output_ids",
           "records", "template_ids"]

TOOLS = [{"type": "function", "function": {
    "name": "computer", "description": "Act on the screen",
    "parameters": {"type": "object", "properties": {"action": {"type": "string"}, "x": {"type": "integer"},
                                                    "y": {"type": "integer"}}, "required": ["action"]}}}]
HISTORY = [  # a conversation the agent brings into its first turn: tool calls and their results
    {"role": "system", "content": "You operate a 1280x800 screen."},
    {"role": "user", "content": "Open the settings and turn on dark mode."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function",
         "function": {"name": "computer", "arguments": {"action": "click", "x": 12, "y": 790}}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "the start menu opened"},
]


def direct(engine: Engine, prompt: list[int], **sampling: Any) -> dict[str, Any]:
    """The engine's own answer to a token-id request (its completions API), choice 0."""
    body = {"model": engine.model, "prompt": prompt, "logprobs": 1, "return_token_ids": True, **sampling}
    resp = requests.post(engine.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def chat(base: str, sid: str, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    resp = requests.post(f"{base}/sessions/{sid}/v1/chat/completions", timeout=120,
                         json={"model": "m", "messages": messages, **fields})
    assert resp.status_code == 200, resp.text
    return resp.json()


def new_session(base: str) -> str:
    return requests.post(f"{base}/sessions", timeout=30).json()["session_id"]


def records(base: str, sid: str) -> dict[str, Any]:
    resp = requests.get(f"{base}/sessions/{sid}", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def template_ids(hf, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    out = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def assert_record_is_the_engines(engine: Engine, record: dict[str, Any], sampling: dict[str, Any]) -> dict:
    """The record against the engine's own answer to the same token-id request, field by field."""
    prompt = record["request"]["input_ids"]
    own = direct(engine, prompt, **sampling)
    choice = record["response"]["choices"][0]
    pairs = choice["meta_info"]["output_token_logprobs"]
    assert own["prompt_token_ids"] == prompt
    assert [t for _, t in pairs] == own["token_ids"]
    assert [x for x, _ in pairs] == own["logprobs"]["token_logprobs"]  # exact floats, as the engine sent them
    # A parsed tool call turns the engine's "stop" into OpenAI's "tool_calls"; nothing else changes it.
    expected = "tool_calls" if choice["message"].get("tool_calls") and own["finish_reason"] == "stop" \
        else own["finish_reason"]
    assert choice["finish_reason"] == expected
    assert choice["meta_info"]["completion_tokens"] == len(own["token_ids"])
    return own


def output_ids(record: dict[str, Any]) -> list[int]:
    return [t for _, t in record["response"]["choices"][0]["meta_info"]["output_token_logprobs"]]
