"""Engine dialects: how the session core talks to one kind of inference engine.

Interface (stable; :mod:`webapp.engines.base` declares it, each engine is one module)::

    dialect = dialect_for(kind, replay=ReplayRequest(routed_experts=..., indexer_topk=...))
    # kind: "sglang" (miles' wire, also the embedded reference backend's) or "vllm"
    req = dialect.build_request(client_request, prompt_ids, images)   # -> EngineRequest
    #   req.path      the engine endpoint to POST to ("/v1/chat/completions", "/v1/completions")
    #   req.body      the bytes sent
    #   req.recorded  the record's "request" (JSON object bytes; miles' shape: ``input_ids``...)
    reply = backend.send(req.path, req.body, deadline=...)               # webapp.backend.BackendReply
    #   req.prompt_ids, req.top_logprobs  what was asked (parse_reply checks the reply against it)
    turn = dialect.parse_reply(reply, req)                              # -> EngineTurn
    #   turn.output_ids / logprobs / finish_reason / assistant_message / meta (SAMPLE_META_KEYS)
    #   turn.top_logprobs       per output token [(logprob, id), ...] alternatives, or None
    #   turn.record_response    the record's "response" bytes (miles' SGLang shape, whichever engine)
    #   turn.replay_spans       (key, start, end) of each R3 / indexer base64 payload in record_response
    #   turn.completion         the OpenAI chat.completion for the client (no replay payloads;
    #                           choices[0].logprobs: the engine's OpenAI logprobs, or None)

Every malformed reply raises :class:`webapp.session_errors.BackendMalformed` (a
:class:`webapp.session_errors.MalformedReplyField` names the field). The engine's kind is found
or checked at start-up by :mod:`webapp.engines.probe`. A package, not a module: each dialect
is one module with one job, and a new engine is one more module plus one row in :data:`DIALECTS`.
"""

from __future__ import annotations

from webapp.engines.base import Dialect, EngineConfigError, EngineRequest, EngineTurn, ReplayRequest
from webapp.engines.sglang import SglangDialect
from webapp.engines.vllm import VllmDialect
from webapp.settings import BY_NAME

__all__ = ["DIALECTS", "Dialect", "EngineConfigError", "EngineRequest", "EngineTurn", "ReplayRequest",
           "dialect_for"]

DIALECTS: dict[str, type[Dialect]] = {"sglang": SglangDialect, "vllm": VllmDialect}
# The setting declares the legal kinds (settings.py imports no engine code): the two must agree.
assert (*DIALECTS, "auto") == BY_NAME["backend_kind"].choices, "a dialect missing from --backend-kind"


def dialect_for(kind: str, replay: ReplayRequest | None = None, *, tool_call_parser: str = "hermes") -> Dialect:
    """The dialect of engine ``kind`` (``auto`` is resolved before: :mod:`webapp.engines.probe`).

    Raises :class:`EngineConfigError` for an unknown kind or a replay the engine cannot give."""
    try:
        cls = DIALECTS[kind]
    except KeyError:
        raise EngineConfigError(f"unknown backend kind {kind!r}: one of {', '.join(DIALECTS)}") from None
    if cls is VllmDialect:
        return VllmDialect(replay or ReplayRequest(), tool_call_parser)
    return cls(replay or ReplayRequest())
