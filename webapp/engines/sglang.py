"""The ``sglang`` dialect: miles' wire to SGLang, also spoken by the embedded reference backend.

Request: ``POST /v1/chat/completions`` with the client's body (minus ``stream`` /
``stream_options``), ``input_ids`` (our prompt ids: the engine does not re-render), the fields
miles forces (:data:`FORCED_FIELDS`), ``return_routed_experts`` / ``return_indexer_topk`` when
replay is on, and with images ``image_data`` (the data URLs in order of appearance) plus
messages whose image parts carry the ``sha256:<hex>`` reference. The record's ``request`` is
the same body with each ``image_data`` entry replaced by that reference (the one place a record
is not the bytes sent).

Reply: ``choices[0].meta_info.output_token_logprobs`` (``[[logprob, id], ...]``) gives the
output ids and logprobs, ``choices[0].message`` the assistant message; the reply is the
record's ``response`` verbatim, R3 included (never decoded on the turn path:
:func:`webapp.backend.replay_spans`), and the client gets it without the replay payloads.
"""

from __future__ import annotations

from typing import Any

from webapp.backend import REPLAY_KEYS, BackendReply
from webapp.engines.base import (
    CLIENT_ONLY_FIELDS,
    Dialect,
    EngineRequest,
    EngineTurn,
    ReplayRequest,
    dumps,
    ids_array,
)
from webapp.images import RequestImages, wire_messages
from webapp.ipc import Buffer
from webapp.samples import SAMPLE_META_KEYS
from webapp.session_errors import BackendMalformed, InvalidField, MalformedReplyField
from webapp.tito import normalize_message

__all__ = ["FORCED_FIELDS", "SglangDialect", "parse_assistant_message"]

CHAT_PATH = "/v1/chat/completions"
# Fields set on every request, whatever the client sent (as miles forces them: token accounting
# needs the logprobs and meta_info; ``no_stop_trim: false`` keeps the stop text out of the
# assistant content, which miles' own rollout would otherwise turn on).
FORCED_FIELDS: dict[str, Any] = {"stream": False, "logprobs": True, "return_meta_info": True, "no_stop_trim": False}
# Not serialized with the rest: input_ids and image_data are written after it (clients' are refused).
_NOT_DUMPED = frozenset((*CLIENT_ONLY_FIELDS, "input_ids", "image_data"))


def parse_assistant_message(raw_message: Any, where: str) -> dict[str, Any]:
    """The engine's assistant message, normalized; ``BackendMalformed`` if it is not one."""
    try:
        message = normalize_message(raw_message, where)
    except InvalidField as exc:
        raise BackendMalformed(f"backend reply: {exc}") from exc
    if message["role"] != "assistant":
        raise BackendMalformed("backend reply message role is not 'assistant'")
    return message


class SglangDialect(Dialect):
    kind = "sglang"
    incremental_replay = True  # miles' ``routed_experts_start_len`` (its additional-R3 mode)
    routed_experts_field = "choices[0].meta_info.routed_experts"

    def __init__(self, replay: ReplayRequest) -> None:
        super().__init__(replay)
        self.forced_fields = dict(FORCED_FIELDS)
        if replay.routed_experts:
            self.forced_fields["return_routed_experts"] = True
        if replay.indexer_topk:
            self.forced_fields["return_indexer_topk"] = True

    def build_request(self, request: dict[str, Any], prompt_ids: list[int],
                      images: RequestImages, replay_from: int = 0, ids_text: bytes | None = None) -> EngineRequest:
        """The client's fields and ours serialized once, then the server-set fields written after
        them as text: ``input_ids`` (``ids_text`` when given: :func:`ids_array`), ``image_data``
        (the data URLs as sent, the references in the record) and ``routed_experts_start_len``
        (``replay_from``: sent, not recorded). The same bytes as ``dumps`` of the whole payload
        (``input_ids`` and ``image_data`` are refused from clients, so ours come last)."""
        payload = {k: v for k, v in request.items() if k not in _NOT_DUMPED}
        payload.update(self.forced_fields)
        if images.images:
            payload["messages"] = wire_messages(images.messages)
        head = dumps(payload)[:-1] + b',"input_ids":' + ids_array(prompt_ids, ids_text)
        end = b',"routed_experts_start_len":%d}' % replay_from if replay_from and self.replay.routed_experts else b"}"
        if not images.images:
            return EngineRequest(CHAT_PATH, head + end, head + b"}", prompt_ids)
        # Checked: a data URL's text and a reference are ASCII with nothing JSON escapes. The
        # bytes sent stay pieces, the URLs as the turn holds them (~3.6 MB at 20 screenshots,
        # never joined: the backend client sends them gathered).
        sent: list[Buffer] = [head + b',"image_data":["']
        recorded = [head, b',"image_data":[']
        for image, url in images.images:
            sent += (url, b'","')
            recorded += (b'"', image.ref.encode("ascii"), b'",')
        sent[-1] = b'"]' + end
        recorded[-1] = b'"]'
        return EngineRequest(CHAT_PATH, tuple(sent), b"".join([*recorded, b"}"]), prompt_ids)

    def parse_reply(self, reply: BackendReply, sent: EngineRequest) -> EngineTurn:
        parsed = reply.parsed
        choices = parsed.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise MalformedReplyField("choices", "backend reply must have exactly one choice")
        choice = choices[0]
        meta = choice.get("meta_info")
        if not isinstance(meta, dict):
            raise MalformedReplyField("choices[0].meta_info", "backend choice has no meta_info object")
        pairs = meta.get("output_token_logprobs")
        if not isinstance(pairs, list):
            raise MalformedReplyField("choices[0].meta_info.output_token_logprobs",
                                      "meta_info.output_token_logprobs must be a list")
        try:
            output_ids = [p[1] for p in pairs]
            logprobs = [p[0] for p in pairs]
        except (TypeError, IndexError, KeyError) as exc:
            raise MalformedReplyField("choices[0].meta_info.output_token_logprobs",
                                      "output_token_logprobs entries must be [logprob, token_id]") from exc
        if not all(type(t) is int for t in output_ids):
            raise MalformedReplyField("choices[0].meta_info.output_token_logprobs", "output token ids must be integers")
        if not all(lp is None or type(lp) in (int, float) for lp in logprobs):
            raise MalformedReplyField("choices[0].meta_info.output_token_logprobs", "output logprobs must be numbers")
        completion_tokens = meta.get("completion_tokens")
        if completion_tokens is not None and completion_tokens != len(output_ids):
            raise MalformedReplyField("choices[0].meta_info.completion_tokens",
                                      f"completion_tokens={completion_tokens!r} but {len(output_ids)} "
                                      "output_token_logprobs")
        raw_message = choice.get("message")
        if isinstance(raw_message, dict) and raw_message.get("content", "") is None:
            # miles refuses it too: a tool-call parser failure must come back as "" content.
            raise MalformedReplyField(
                "choices[0].message.content",
                "assistant message content is None, when tool call parser failed SGLang should still return "
                "an empty content rather than None")
        message = parse_assistant_message(raw_message, "choices[0].message")
        tops = _top_logprobs(meta.get("output_top_logprobs"), len(output_ids))
        # The client's copy: the parsed reply, whose replay payloads parsed as "" (dropped here).
        for holder in [choice.get("meta_info"), parsed.get("meta_info")]:
            if isinstance(holder, dict):
                for key in REPLAY_KEYS:
                    holder.pop(key, None)
        return EngineTurn(message, output_ids, logprobs, choice.get("finish_reason"),
                          {k: meta[k] for k in SAMPLE_META_KEYS if k in meta}, reply.raw, reply.replay_spans,
                          parsed, tops)


def _top_logprobs(tops: Any, n: int) -> list[list[tuple[Any, int]]] | None:
    """``meta_info.output_top_logprobs`` (per position ``[[logprob, id, ...], ...]``, when asked for)."""
    if not isinstance(tops, list):
        return None
    out: list[list[tuple[Any, int]]] = []
    for i in range(n):
        alternatives = tops[i] if i < len(tops) and isinstance(tops[i], list) else []
        out.append([(alt[0], alt[1]) for alt in alternatives if isinstance(alt, list) and len(alt) >= 2])
    return out
