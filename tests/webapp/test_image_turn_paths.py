"""Screenshot turns through the session core: a known image is never decoded again on any
path (line and tree sessions), and the known-image path stores and sends exactly what the
from-scratch path (every image decoded as if new) does."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from typing import Any

import pytest
from PIL import Image

import webapp.images as images_module
from webapp.backend import BackendReply, payload_bytes
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
        self.payloads: list[Any] = []  # as the core gave them

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        self.payloads.append(payload)
        payload = payload_bytes(payload)  # an image turn sends pieces
        self.bodies.append(payload)
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


def noisy(seed: int) -> bytes:
    """A JPEG whose data URL is long enough to be cut out of the body (webapp.limits)."""
    out = io.BytesIO()
    Image.effect_noise((160, 120), 40 + seed).convert("RGB").save(out, "JPEG")
    assert len(out.getvalue()) > 8192
    return out.getvalue()


def test_the_engine_gets_the_data_urls_from_the_client_body_itself() -> None:
    """An image turn's engine request is pieces: each data URL a view of the body the turn
    received (not a copy of it, not a re-encoded string), the whole the bytes it always was."""
    backend = ImageBackend()
    core = SessionCore(TOK, backend)  # type: ignore[arg-type]
    try:
        sid = json.loads(core.create_session().read())["session_id"]
        urls = ["data:image/jpeg;base64," + base64.b64encode(noisy(seed)).decode() for seed in (1, 2)]
        body = json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}} for url in urls]}], "max_tokens": 16}).encode()
        assert core.chat(sid, body).status == 200
    finally:
        core.close()
    (payload,) = backend.payloads
    views = [piece for piece in payload if isinstance(piece, memoryview)]
    assert [v.tobytes() for v in views] == [url.encode() for url in urls] and all(v.obj is body for v in views)
    sent = json.loads(backend.bodies[0])
    assert sent["image_data"] == urls
    assert backend.bodies[0] == json.dumps(sent, separators=(",", ":"), ensure_ascii=False).encode()
