"""Deterministic conversations on an in-process session core, for comparing journal formats.

Imports only ``webapp`` APIs that the first journal format's tree has too, so the same file
writes the version 1 fixture when run against that tree::

    git worktree add /tmp/v1tree c104c89   # the last tree that wrote format version 1
    PYTHONPATH=/tmp/v1tree python tests/webapp/journal_conversations.py tests/webapp/journal_v1

and plays the same conversations on this tree in test_journal_v2.py. The clock is a counter
(``time.time`` patched), the engine an in-process stand-in (the reference backend's replies
with R3 rows of its own, a prefix's rows unchanged as tokens follow, and tool calls on some
turns), so both trees write the same records: images, a rollback, tool calls and R3.
Output: ``DIR/data`` (the data directory) and ``DIR/expected/<sid>.json`` / ``<sid>.images.json``
(the records GETs, with and without ``?images=1``).
"""

from __future__ import annotations

import base64
import json
import os
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from webapp.backend import BackendReply, payload_bytes
from webapp.core import SessionCore, SessionRegistry
from webapp.journal import JournalStore
from webapp.reference_backend import reference_completion
from webapp.tokenizers import ByteChatTokenizer

TOK = ByteChatTokenizer()
LAYERS, TOPK = 3, 2
PNG_1x1 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
TOOLS = [{"type": "function", "function": {"name": "click", "description": "click at x, y", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}]


def r3_rows(ids: list[int], start: int, end: int) -> bytes:
    return b"".join(struct.pack(f"<{LAYERS * TOPK}i", *((ids[i] * 7 + i * 13 + j) % 64 for j in range(LAYERS * TOPK)))
                    for i in range(start, end))


class Engine:
    """``send`` as ``webapp.backend.BackendClient`` has it; a tool call every third turn."""

    def __init__(self) -> None:
        self.turns = 0
        self.sent: list[dict[str, Any]] = []

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        payload = payload_bytes(payload)  # an image turn sends pieces
        request = json.loads(payload)
        self.sent.append(request)
        self.turns += 1
        ids = request["input_ids"]
        reply = reference_completion(ids, TOK, max_tokens=request.get("max_tokens"))
        choice = reply["choices"][0]
        if self.turns % 3 == 0:
            choice["message"] = {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"call_{self.turns}", "type": "function",
                 "function": {"name": "click", "arguments": json.dumps({"x": self.turns, "y": 2})}}]}
            choice["finish_reason"] = "tool_calls"
        if request.get("return_routed_experts"):
            out = [tid for _lp, tid in choice["meta_info"]["output_token_logprobs"]]
            start = request.get("routed_experts_start_len", 0)
            choice["meta_info"]["routed_experts"] = base64.b64encode(
                r3_rows(ids + out, start, len(ids) + len(out) - 1)).decode()
        return BackendReply.from_raw(json.dumps(reply).encode())

    def close(self) -> None:
        pass


@contextmanager
def fixed_clock() -> Iterator[None]:
    ticks = iter(range(10**9))
    real = time.time
    time.time = lambda: 1.8e9 + next(ticks) * 0.25  # type: ignore[assignment]
    try:
        yield
    finally:
        time.time = real  # type: ignore[assignment]


def core_on(data_dir: str, engine: Engine | None = None) -> SessionCore:
    registry = SessionRegistry(JournalStore(data_dir))
    registry.restore(lambda sid: True)
    return SessionCore(TOK, engine or Engine(), registry=registry, turn_wait_timeout=10.0,
                       routing_replay_layers=LAYERS)


def _chat(core: SessionCore, sid: str, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    reply = core.chat(sid, json.dumps({"model": "m", "messages": messages, **extra}).encode())
    assert reply.status == 200, reply.read()[:500]
    message: dict[str, Any] = json.loads(reply.read())["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


def play(core: SessionCore, turns: int = 5) -> list[str]:
    """The conversations: plain text; an image; a rollback (a regenerated turn); tools with
    tool calls and tool results. Returns the session ids."""
    plain, image, rollback, tools = "plain", "image", "rollback", "tools"
    for sid in (plain, image, rollback, tools):
        assert core.create_session(sid).status == 200
    msgs: list[dict[str, Any]] = []
    for i in range(turns):
        msgs += [{"role": "user", "content": f"step {i}: open the settings panel"}]
        msgs.append(_chat(core, plain, msgs))
    url = f"data:image/png;base64,{PNG_1x1}"
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]}]
    for i in range(turns):
        msgs.append(_chat(core, image, msgs))
        msgs.append({"role": "user", "content": [{"type": "text", "text": f"and now {i}"},
                                                 {"type": "image_url", "image_url": {"url": url}}]})
    msgs = [{"role": "user", "content": "a"}]
    msgs.append(_chat(core, rollback, msgs))
    msgs.append({"role": "user", "content": "b"})
    _chat(core, rollback, msgs)
    msgs.append(_chat(core, rollback, msgs))  # the same messages again: replaces the last record
    msgs.append({"role": "user", "content": "c"})
    _chat(core, rollback, msgs)
    msgs = []
    for i in range(turns):
        msgs.append({"role": "user", "content": f"task {i}"})
        reply = _chat(core, tools, msgs, tools=TOOLS)
        msgs.append(reply)
        for call in reply.get("tool_calls") or ():
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "clicked"})
    return [plain, image, rollback, tools]


def gets(core: SessionCore, sids: list[str]) -> dict[str, bytes]:
    out = {}
    for sid in sids:
        out[f"{sid}.json"] = core.get_session(sid).read()
        out[f"{sid}.images.json"] = core.get_session(sid, include_images=True).read()
    return out


def main(out: str) -> None:
    os.makedirs(os.path.join(out, "expected"), exist_ok=True)
    with fixed_clock():
        core = core_on(os.path.join(out, "data"))
        sids = play(core)
        for name, body in gets(core, sids).items():
            with open(os.path.join(out, "expected", name), "wb") as f:
                f.write(body)
        core.close()


if __name__ == "__main__":
    main(sys.argv[1])
