"""The ``vllm`` dialect: token ids in, token ids and logprobs out, through vLLM's completions API.

Why ``POST /v1/completions`` and not ``/inference/v1/generate``: the completions API takes a
token-id ``prompt`` and, with ``return_token_ids: true``, answers the engine's own output ids
(``choices[0].token_ids``) and prompt ids (``choices[0].prompt_token_ids``) next to the
logprobs, on every vLLM server as started by default; the generate endpoint answers the same
but exists only with ``--enable-scale-out``. vLLM's chat API cannot be used: it ignores
``input_ids`` and re-renders the messages itself.

Request (:meth:`VllmDialect.build_request`): ``prompt`` = our prompt ids; ``max_tokens`` = the
client's ``max_completion_tokens`` / ``max_tokens`` (null when it set none: vLLM then allows up
to the model length, as a chat call does; its completions default, 16, is not used);
``logprobs`` = the client's ``top_logprobs`` when it asked for logprobs, else 0 (the sampled
token's logprob is always returned, for the records); ``return_token_ids``,
``return_tokens_as_token_ids`` (top-logprob alternatives keyed ``token_id:N``, so their ids are
exact); ``skip_special_tokens: false`` (tool-call markers stay in the text even where a
tokenizer marks them special; vLLM leaves the stop token's text out either way); and the
client's sampling fields of :data:`SAMPLING_FIELDS` as given. ``messages``, ``tools`` and
``model`` are not sent (the engine serves its one model; the prompt is already rendered).
Images are refused (400): the completions API takes no image with a token-id prompt (the
generate endpoint's ``features`` could carry them; not done). Routed experts come back when the
engine runs with ``--enable-return-routed-experts`` (no request field); indexer replay has no
vLLM equivalent and is refused at start-up.

Reply (:meth:`VllmDialect.parse_reply`, every field checked, a bad one is a
:class:`~webapp.session_errors.MalformedReplyField` naming it): output ids = ``token_ids``,
logprobs = ``logprobs.token_logprobs`` (one per id), ``prompt_token_ids`` must equal the prompt
sent, ``usage.completion_tokens`` must equal the output length, the assistant message is
``text`` through the tool-call parser (:mod:`webapp.engines.toolcalls`, ``hermes`` by default),
and ``finish_reason`` is the engine's, ``tool_calls`` when calls were parsed from a ``stop``.
``routed_experts`` (vLLM: base64 of ``.npy`` bytes, shape ``(tokens - 1, layers, top_k)``,
uint8/uint16/int32: vLLM's ``CompletionResponseChoice``, encoded by
``vllm/utils/serial_utils.py:numpy2base64``, ``np.save(allow_pickle=False)`` then base64) is
checked against that shape and re-encoded as miles' R3: base64 of little-endian int32, same shape.

Record (miles' shape, so miles' consumer reads it unchanged): ``request`` = the client's fields
plus ``input_ids`` and ``engine: {"kind": "vllm", "path": ..., "body": <the body sent, without
its "prompt", which is input_ids>}``; ``response`` = a chat completion whose
``choices[0].meta_info`` holds ``output_token_logprobs`` (``[[logprob, id], ...]``: the
engine's), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens`` and ``routed_experts``
(miles' R3), plus ``engine_reply``: the engine's reply as parsed, without
``choices[0].prompt_token_ids`` (equal to ``input_ids``: checked) and
``choices[0].routed_experts`` (in ``meta_info``, re-encoded), the two bulky fields held once.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from typing import Any

import numpy as np

from webapp.backend import BackendReply, replay_spans
from webapp.engines.base import (
    CLIENT_ONLY_FIELDS,
    Dialect,
    EngineConfigError,
    EngineRequest,
    EngineTurn,
    ReplayRequest,
    dumps,
    ids_array,
)
from webapp.engines.sglang import parse_assistant_message
from webapp.engines.toolcalls import TOOL_CALL_PARSERS, ToolCallParser
from webapp.images import RequestImages
from webapp.session_errors import InvalidField, MalformedReplyField

__all__ = ["COMPLETIONS_PATH", "SAMPLING_FIELDS", "VllmDialect", "decode_routed_experts"]

COMPLETIONS_PATH = "/v1/completions"
# Client chat fields vLLM's completions API takes under the same name and meaning.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens", "n")
_FORCED = {"stream": False, "return_token_ids": True, "return_tokens_as_token_ids": True,
           "skip_special_tokens": False}
_TOKEN_ID_PREFIX = "token_id:"


def _bad(field: str, problem: str) -> MalformedReplyField:
    return MalformedReplyField(field, f"backend reply {field}: {problem}")


def _int_list(value: Any, field: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise _bad(field, "missing or not a list of integer token ids (is return_token_ids "
                                         "honoured by this engine?)")
    return value


def decode_routed_experts(b64: bytes, rows: int, field: str = "choices[0].routed_experts") -> np.ndarray:
    """vLLM's ``routed_experts`` (base64 ``.npy``) as int32 ``(rows, layers, top_k)``; raises
    :class:`MalformedReplyField` for anything else (``allow_pickle`` stays off)."""
    try:
        loaded = np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)
    except (ValueError, OSError, EOFError, binascii.Error) as exc:
        raise _bad(field, f"not base64 .npy bytes: {exc}") from None
    if not isinstance(loaded, np.ndarray):  # an .npz archive
        raise _bad(field, "not base64 .npy bytes: an archive")
    array: np.ndarray = loaded
    if array.ndim != 3 or array.dtype.kind not in "iu" or array.shape[0] != rows:
        raise _bad(field, f"expected integer ids of shape ({rows}, layers, top_k), got {array.dtype} {array.shape}")
    return array.astype("<i4", copy=False)


class VllmDialect(Dialect):
    kind = "vllm"
    takes_images = False  # the completions API takes no image with a token-id prompt

    def __init__(self, replay: ReplayRequest, tool_call_parser: str = "hermes") -> None:
        super().__init__(replay)
        if replay.indexer_topk:
            raise EngineConfigError("indexer replay (--indexer-replay) has no vLLM equivalent: "
                                    "use --backend-kind sglang")
        self.parse_tool_calls: ToolCallParser = TOOL_CALL_PARSERS[tool_call_parser]

    def build_request(self, request: dict[str, Any], prompt_ids: list[int],
                      images: RequestImages, replay_from: int = 0, ids_text: bytes | None = None) -> EngineRequest:
        if images.images:
            raise InvalidField("messages", "images are not supported with --backend-kind vllm: vLLM's completions "
                                           "API takes no image with a token-id prompt")
        body: dict[str, Any] = {k: request[k] for k in SAMPLING_FIELDS if k in request}
        body["max_tokens"] = request.get("max_completion_tokens") or request.get("max_tokens")
        top = request.get("top_logprobs") if request.get("logprobs") else None
        body["logprobs"] = top if type(top) is int and top > 0 else 0
        body.update(_FORCED)
        ids = ids_array(prompt_ids, ids_text)  # the one serialization of the prompt, in both bodies
        encoded = dumps(body)
        sent = b'{"prompt":' + ids + b"," + encoded[1:]
        client = {k: v for k, v in request.items() if k not in CLIENT_ONLY_FIELDS}
        client["engine"] = {"kind": self.kind, "path": COMPLETIONS_PATH, "body": body}
        recorded = dumps(client)[:-1] + b',"input_ids":' + ids + b"}"
        return EngineRequest(COMPLETIONS_PATH, sent, recorded, prompt_ids, body["logprobs"])

    def parse_reply(self, reply: BackendReply, sent: EngineRequest) -> EngineTurn:
        parsed, prompt_ids = reply.parsed, sent.prompt_ids
        choices = parsed.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise _bad("choices", "must have exactly one choice")
        choice = choices[0]
        output_ids = _int_list(choice.get("token_ids"), "choices[0].token_ids")
        if _int_list(choice.get("prompt_token_ids"), "choices[0].prompt_token_ids") != prompt_ids:
            raise _bad("choices[0].prompt_token_ids", "differs from the prompt ids sent")
        lp = choice.get("logprobs")
        if not isinstance(lp, dict):
            raise _bad("choices[0].logprobs", "missing (the request asked for logprobs)")
        logprobs = lp.get("token_logprobs")
        if not isinstance(logprobs, list) or len(logprobs) != len(output_ids) \
                or not all(x is None or type(x) in (int, float) for x in logprobs):
            raise _bad("choices[0].logprobs.token_logprobs",
                                      f"expected one number per output token ({len(output_ids)})")
        text = choice.get("text")
        if not isinstance(text, str):
            raise _bad("choices[0].text", "missing or not a string")
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise _bad("choices[0].finish_reason", "not a string or null")
        usage = parsed.get("usage")
        if not isinstance(usage, dict) or type(usage.get("prompt_tokens")) is not int:
            raise _bad("usage", "missing or without integer prompt_tokens")
        if usage.get("completion_tokens") != len(output_ids):
            raise _bad("usage.completion_tokens", f"{usage.get('completion_tokens')!r} but "
                                                                 f"{len(output_ids)} token_ids")
        content, calls = self.parse_tool_calls(text)
        raw_message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            raw_message["tool_calls"] = calls
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        message = parse_assistant_message(raw_message, "choices[0].text")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        meta: dict[str, Any] = {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": len(output_ids),
                                "cached_tokens": cached if type(cached) is int else 0}
        # Asked for alternatives only when the client wants them (logprobs 0 answers the sampled one).
        tops = _top_logprobs(lp.get("top_logprobs"), len(output_ids)) if sent.top_logprobs else None
        routed = self._routed_experts(reply, choice, len(prompt_ids) + len(output_ids) - 1)
        head = {"id": parsed.get("id", ""), "object": "chat.completion",
                "created": parsed.get("created", int(time.time())), "model": parsed.get("model", "")}
        completion = {**head, "choices": [{"index": 0, "message": raw_message, "logprobs": None,
                                           "finish_reason": finish_reason}], "usage": usage}
        record_meta = {**meta, "output_token_logprobs": [[x, t] for x, t in zip(logprobs, output_ids)]}
        if routed is not None:
            record_meta["routed_experts"] = routed
        engine_choice = {k: v for k, v in choice.items() if k not in ("prompt_token_ids", "routed_experts")}
        record = {**head, "choices": [{"index": 0, "message": raw_message, "logprobs": None,
                                       "finish_reason": finish_reason, "meta_info": record_meta}],
                  "usage": usage, "engine_reply": {**parsed, "choices": [engine_choice]}}
        record_bytes = dumps(record)
        spans = list(replay_spans(record_bytes)) if routed is not None else []
        return EngineTurn(message, output_ids, logprobs, finish_reason, meta, record_bytes, spans, completion, tops)

    @staticmethod
    def _routed_experts(reply: BackendReply, choice: dict[str, Any], rows: int) -> str | None:
        value = choice.get("routed_experts")
        if value is None:
            return None
        span = next((s for s in reply.replay_spans if s[0] == "routed_experts"), None)
        if not isinstance(value, str) or span is None:
            raise _bad("choices[0].routed_experts", "not a base64 string or null")
        array = decode_routed_experts(reply.raw[span[1]:span[2]], rows)
        return base64.b64encode(array.tobytes()).decode("ascii")


def _top_logprobs(tops: Any, n: int) -> list[list[tuple[Any, int]]]:
    """vLLM's ``top_logprobs`` (per position ``{"token_id:N": logprob}``) as ``[(logprob, id)]``."""
    if not isinstance(tops, list):
        raise _bad("choices[0].logprobs.top_logprobs", "not a list")
    out: list[list[tuple[Any, int]]] = []
    for i in range(n):
        position = tops[i] if i < len(tops) else None
        alternatives = []
        for key, value in (position.items() if isinstance(position, dict) else ()):
            if not (isinstance(key, str) and key.startswith(_TOKEN_ID_PREFIX) and key[9:].isdigit()):
                raise _bad("choices[0].logprobs.top_logprobs",
                                          f"key {key!r} is not token_id:N (return_tokens_as_token_ids)")
            alternatives.append((value, int(key[len(_TOKEN_ID_PREFIX):])))
        out.append(alternatives)
    return out
