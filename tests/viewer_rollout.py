"""Real sessions for the viewer's tests and bench: a computer-use-like rollout through a running
session server and its reference backend — screenshots (PNG data URLs), a tool call and its
result, a one-step rollback, and a message with markup in it."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

import requests
from PIL import Image

HOSTILE_TEXT = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">&amp;'
TOOLS = [{"type": "function", "function": {"name": "click", "description": "click at x, y",
                                           "parameters": {"type": "object", "properties": {
                                               "x": {"type": "integer"}, "y": {"type": "integer"}}}}}]


def screenshot_png(i: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """A distinct solid-colour screen per turn (its pixel colour tells turns apart)."""
    colour = screen_colour(i)
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def screen_colour(i: int) -> tuple[int, int, int]:
    return ((37 * i + 200) % 256, (91 * i + 30) % 256, (53 * i + 120) % 256)


def image_part(data: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


@dataclass
class Rollout:
    session_id: str
    turns: int = 0  # committed records on the current branch
    rollbacks: int = 0
    images: list[bytes] = field(default_factory=list)  # each screenshot sent, in order


def drive(url: str, turns: int, *, key: str | None = None, image_size: tuple[int, int] = (64, 48),
          rollback_at: int | None = 2, hostile: bool = True, http: requests.Session | None = None) -> Rollout:
    """``turns`` committed turns (a rollback replaces one more, when ``rollback_at`` is set)."""
    http = http or requests.Session()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = http.post(f"{url}/sessions", headers=headers, timeout=30)
    response.raise_for_status()
    rollout = Rollout(response.json()["session_id"])
    chat = f"{url}/sessions/{rollout.session_id}/v1/chat/completions"
    # A tool call and its result, written by the client in the first request (few-shot style).
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You operate a desktop. Answer with one action."},
        {"role": "user", "content": "Open the menu."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "click", "arguments": '{"x": 10, "y": 20}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "clicked at 10,20"},
    ]
    previous: list[dict[str, Any]] = []
    i = 0
    while rollout.turns < turns:
        text = f"turn {i}: the screen now" + (f" {HOSTILE_TEXT}" if hostile and i == 1 else "")
        shot = screenshot_png(i, image_size)
        user = {"role": "user", "content": [{"type": "text", "text": text}, image_part(shot)]}
        is_rollback = rollback_at is not None and i == rollback_at + 1 and rollout.rollbacks == 0
        base = previous if is_rollback else messages
        request = {"messages": [*base, user], "tools": TOOLS, "max_tokens": 64}
        reply = http.post(chat, json=request, headers=headers, timeout=60)
        reply.raise_for_status()
        assistant = reply.json()["choices"][0]["message"]
        rollout.images.append(shot)
        if is_rollback:
            rollout.rollbacks += 1
        else:
            rollout.turns += 1
            previous = messages
        messages = [*base, user, {"role": "assistant", "content": assistant.get("content") or ""}]
        i += 1
    return rollout
