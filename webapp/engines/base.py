"""The dialect interface (see :mod:`webapp.engines` for how the core uses it).

A dialect is stateless after construction and safe to call from many greenlets/threads at
once: the core builds one per session core and calls it on every turn.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from webapp.backend import BackendReply, payload_bytes
from webapp.errors import WebappError
from webapp.images import RequestImages
from webapp.ipc import Buffer
from webapp.request_fields import Policy, fields_with
from webapp.session_errors import MalformedReplyField

__all__ = ["CLIENT_ONLY_FIELDS", "Dialect", "EngineConfigError", "EngineRequest", "EngineTurn", "ReplayRequest",
           "dumps", "ids_array"]

# Client fields that only concern the client-facing transport (the engine always answers whole):
# webapp.request_fields' table says which.
CLIENT_ONLY_FIELDS = fields_with(Policy.CLIENT)


def dumps(obj: Any) -> bytes:
    """The one JSON encoding of request and record bodies (compact, UTF-8 kept)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def ids_array(prompt_ids: list[int], ids_text: bytes | None) -> bytes:
    """``dumps(prompt_ids)``: ``ids_text`` (``webapp.records.ids_json(prompt_ids)``, the text the
    journal keeps per session and extends by a turn's new ids) in brackets when the caller has
    it, so a turn turns its prompt ids into text once."""
    if ids_text is None:
        return dumps(prompt_ids)
    return b"[" + ids_text + b"]"


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
    # The bytes sent: one bytes object, or its pieces in order (an image turn's: the data URLs
    # are views of the client's body, valid for the turn only; sent without joining them).
    sent: bytes | tuple[Buffer, ...]
    recorded: bytes  # the record's "request": a JSON object in miles' shape (``input_ids`` ...)
    prompt_ids: list[int]  # our prompt ids, as sent
    top_logprobs: int = 0  # top-logprob alternatives asked of the engine per output token

    @property
    def body(self) -> bytes:
        """The bytes sent, joined (a copy when they are pieces: for inspection, not the turn)."""
        return payload_bytes(self.sent)


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
    # Whether the engine can be asked for the routed-expert rows past the first N only
    # (``replay_from`` in :meth:`build_request`); the reply's payload then holds those rows.
    incremental_replay: bool = False
    routed_experts_field = "routed_experts"  # where the reply holds them (named in errors)
    # Whether a turn may carry image parts (the launcher's ready line says so, for clients such
    # as the demo that then send their observations as text only).
    takes_images = True

    def __init__(self, replay: ReplayRequest) -> None:
        self.replay = replay

    @abstractmethod
    def build_request(self, request: dict[str, Any], prompt_ids: list[int],
                      images: RequestImages, replay_from: int = 0, ids_text: bytes | None = None) -> EngineRequest:
        """The engine request for one turn: the client's parsed chat body, our prompt ids and
        the turn's images; ``replay_from`` (only with :attr:`incremental_replay`): ask for the
        routed-expert rows from that row on, the recorded request staying a full request's;
        ``ids_text``: ``ids_json(prompt_ids)`` when the caller has it (:func:`ids_array`; the
        bytes sent are the same either way). Raises a ``BadRequest`` for what this engine cannot
        take."""

    def replay_prefix(self, turn: EngineTurn, held: tuple[int, int], prompt_len: int) -> dict[str, int]:
        """After a request with ``replay_from=held[0]`` (``held``: rows, bytes per row): the
        bytes of routed experts the reply's payload leaves out (``webapp.records.RecordParts``):
        ``rows x bytes`` when it holds the rest, none when the engine sent every row anyway.
        Raises :class:`MalformedReplyField` for any other size."""
        span = next(((s, e) for k, s, e in turn.replay_spans if k == "routed_experts"), None)
        if span is None:
            return {}
        rows, row_bytes = held
        text = turn.record_response[span[0]:span[1]]
        packed = len(text) // 4 * 3 - text[-2:].count(b"=") if text else 0
        total = prompt_len + len(turn.output_ids) - 1
        if packed == (total - rows) * row_bytes:
            return {"routed_experts": rows * row_bytes}
        if packed == total * row_bytes:
            return {}
        raise MalformedReplyField(self.routed_experts_field, f"{packed} bytes of routed experts for rows "
                                  f"{rows}..{total} of {row_bytes} bytes each")

    @abstractmethod
    def parse_reply(self, reply: BackendReply, sent: EngineRequest) -> EngineTurn:
        """The engine's 200 reply to ``sent`` as our turn. Raises ``BackendMalformed`` naming
        what is wrong."""
