"""Screenshot turns through the session core: a known image is never decoded again on any
path (line and tree sessions), and the known-image path stores and sends exactly what the
from-scratch path (every image decoded as if new) does."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest

import webapp.images as images_module
from webapp.backend import BackendReply
from webapp.core import SessionCore
from webapp.reference_backend import reference_completion
from webapp.tokenizers import ByteChatTokenizer

from .test_images import png

TOK = ByteChatTokenizer()
SHOTS = [png(320, 200, seed, "JPEG") for seed in range(1, 5)]
VOLATILE = ("timestamp", "request_timestamp", "created", "created_at", "committed_at", "id")


class ImageBackend:
    """The reference backend's reply, in process; keeps every request body it was sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        self.bodies.append(bytes(payload))
        request = json.loads(payload)
        images = [base64.b64decode(url.split(",", 1)[1]) for url in request.get("image_data", [])]
        reply = reference_completion(request["input_ids"], TOK, images=images)
        reply["id"], reply["created"] = "fixed", 0
        return BackendReply.from_raw(json.dumps(reply).encode())

    def close(self) -> None:
        pass


def conversation(core: SessionCore, forget_urls: bool) -> tuple[list[bytes], Any]:
    """Four turns, each adding a screenshot and resending the history; ``forget_urls``: the
    session forgets the data URLs it learned before each turn (every image decoded again)."""
    sid = json.loads(core.create_session().read())["session_id"]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You operate a desktop."}]
    replies = []
    for k, shot in enumerate(SHOTS):
        if forget_urls:
            core.registry.get(sid).image_urls.clear()
        url = "data:image/jpeg;base64," + base64.b64encode(shot).decode()
        messages.append({"role": "user", "content": [{"type": "text", "text": f"turn {k}"},
                                                     {"type": "image_url", "image_url": {"url": url}}]})
        reply = core.chat(sid, json.dumps({"messages": messages, "max_tokens": 16}).encode())
        assert reply.status == 200, reply.read()
        replies.append(reply.read())
        messages.append(json.loads(replies[-1])["choices"][0]["message"])
    got = json.loads(core.get_session(sid, include_images=True).read())
    return replies, scrub(got)


def scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: scrub(v) for k, v in value.items() if k not in VOLATILE and k != "session_id"}
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


@pytest.mark.parametrize("mode", ["v1", "v2"])
def test_known_images_are_not_decoded_again_and_store_what_decoding_them_would(mode: str, monkeypatch) -> None:
    decoded: list[int] = []
    real = images_module._decode
    monkeypatch.setattr(images_module, "_decode", lambda data, *a: decoded.append(len(data)) or real(data, *a))
    known_backend, scratch_backend = ImageBackend(), ImageBackend()
    known = SessionCore(TOK, known_backend, session_mode=mode)  # type: ignore[arg-type]
    scratch = SessionCore(TOK, scratch_backend, session_mode=mode)  # type: ignore[arg-type]
    try:
        known_replies, known_get = conversation(known, forget_urls=False)
        assert decoded == [len(shot) for shot in SHOTS]  # each screenshot decoded once, when new
        scratch_replies, scratch_get = conversation(scratch, forget_urls=True)
    finally:
        known.close()
        scratch.close()
    assert known_backend.bodies == scratch_backend.bodies  # the engine got the same bytes
    assert [scrub(json.loads(r)) for r in known_replies] == [scrub(json.loads(r)) for r in scratch_replies]
    assert known_get == scratch_get  # records and images, as GET returns them
    assert len(known_get["records"]) == len(SHOTS)
    assert sorted(known_get["images"]) == sorted(hashlib.sha256(shot).hexdigest() for shot in SHOTS)
