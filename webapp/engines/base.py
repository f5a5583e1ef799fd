"""The dialect interface (see :mod:`webapp.engines` for how the core uses it).

A dialect is stateless after construction and safe to call from many greenlets/threads at
once: the core builds one per session core and calls it on every turn.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from webapp.backend import BackendReply
from webapp.errors import WebappError
from webapp.images import RequestImages
from webapp.request_fields import Policy, fields_with

__all__ = ["CLIENT_ONLY_FIELDS", "Dialect", "EngineConfigError", "EngineRequest", "EngineTurn", "ReplayRequest",
           "dumps"]

# Client fields that only concern the client-facing transport (the engine always answers whole):
# webapp.request_fields' table says which.
CLIENT_ONLY_FIELDS = fields_with(Policy.CLIENT)


def dumps(obj: Any) -> bytes:
    """The one JSON encoding of request and record bodies (compact, UTF-8 kept)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class EngineConfigError(WebappError):
    """The configured engine kind cannot serve what the settings ask (e.g. indexer replay on
    vLLM), or is unknown. A start-up error: the launcher prints it as one line."""


@dataclass(frozen=True)
class ReplayRequest:
    """What the training path wants replayed: routed experts (R3, ``--routing-replay-layers``)
    and the indexer top-k (``--indexer-replay``)."""

    routed_experts: bool = False
    indexer_topk: bool = False


@dataclass(frozen=True)
class EngineRequest:
    path: str  # the engine endpoint (POST)
    body: bytes  # the bytes sent
    recorded: bytes  # the record's "request": a JSON object in miles' shape (``input_ids`` ...)
    prompt_ids: list[int]  # our prompt ids, as sent
    top_logprobs: int = 0  # top-logprob alternatives asked of the engine per output token


@dataclass
class EngineTurn:
    """What one engine reply yields for the record, the session state and the client."""

    assistant_message: dict[str, Any]  # normalized (webapp.tito.normalize_message)
    output_ids: list[int]  # the engine's own
    logprobs: list[Any]  # the engine's own, one per output id (float or None)
    finish_reason: Any
    meta: dict[str, Any]  # the small fields samples read (webapp.samples.SAMPLE_META_KEYS)
    record_response: bytes  # the record's "response" (miles' SGLang shape)
    replay_spans: list[tuple[str, int, int]]  # replay payload spans in record_response
    completion: dict[str, Any]  # the OpenAI chat.completion for the client
    top_logprobs: list[list[tuple[Any, int]]] | None = None  # per output token, when the engine gave them


class Dialect(ABC):
    """One engine's wire. ``kind`` is its ``--backend-kind`` name."""

    kind: str

    def __init__(self, replay: ReplayRequest) -> None:
        self.replay = replay

    @abstractmethod
    def build_request(self, request: dict[str, Any], prompt_ids: list[int],
                      images: RequestImages) -> EngineRequest:
        """The engine request for one turn: the client's parsed chat body, our prompt ids and
        the turn's images. Raises a ``BadRequest`` for what this engine cannot take."""

    @abstractmethod
    def parse_reply(self, reply: BackendReply, sent: EngineRequest) -> EngineTurn:
        """The engine's 200 reply to ``sent`` as our turn. Raises ``BackendMalformed`` naming
        what is wrong."""
