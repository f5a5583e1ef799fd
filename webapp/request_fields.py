"""What the session server does with each top-level field of a chat request: declared once here.

A chat request's top-level fields reach the engine and the session's records unless a rule says
otherwise; a field nobody declared used to be forwarded to the engine and journaled verbatim
every turn (a 250 MB ``padding`` field stored whole). Every field now has one policy:

- ``ENGINE``: forwarded to the engine and stored in the turn's record (the request as sent);
- ``CLIENT``: concerns the client-facing transport only (streaming): neither forwarded nor stored;
- ``REFUSED``: the server sets it itself, or it would let one client reach into the engine's
  internals or make its reply unbounded: 400 naming the field and why.

An unknown field is refused (400, :class:`UnknownField`, naming it) rather than dropped: a
dropped field changes what the client asked for without telling it (a misspelt
``max_tokens`` would silently sample to the engine's limit), and a refusal costs the client one
request to learn it. The fields are OpenAI's chat-completions request and the sampling and
engine extensions SGLang's ``ChatCompletionRequest`` and vLLM's accept (read from their
``protocol.py``); fields only one engine knows are forwarded to either (the engine answers for
them, as it did before).

Imports nothing of the core: the core calls :func:`check_request_fields` on every parsed body.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from webapp.session_errors import InvalidField, UnknownField

__all__ = ["FIELDS", "Policy", "check_request_fields", "fields_with"]


class Policy(enum.Enum):
    ENGINE = "forwarded to the engine and stored in the record"
    CLIENT = "used for the client's reply only; neither forwarded nor stored"
    REFUSED = "refused"


_E, _C, _R = Policy.ENGINE, Policy.CLIENT, Policy.REFUSED
_SERVER_SETS = "the server sets it (from the messages, tokenized and checked here)"
_INTERNAL = "an engine-internal routing field; the server does not let clients set it"

# name -> (policy, why it is refused: the 400's text). Sorted by origin, then name.
FIELDS: dict[str, tuple[Policy, str]] = {
    # OpenAI chat completions
    **{name: (_E, "") for name in (
        "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
        "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "temperature",
        "top_p", "user", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "metadata",
        "service_tier", "store", "modalities", "prediction", "verbosity", "prompt_cache_key",
        "safety_identifier")},
    "stream": (_C, ""),
    "stream_options": (_C, ""),
    "functions": (_R, "deprecated by OpenAI; use tools"),
    "function_call": (_R, "deprecated by OpenAI; use tool_choice"),
    # SGLang's and vLLM's sampling and template extensions
    **{name: (_E, "") for name in (
        "top_k", "min_p", "min_tokens", "regex", "ebnf", "repetition_penalty", "stop_token_ids", "stop_regex",
        "no_stop_trim", "ignore_eos", "continue_final_message", "skip_special_tokens", "separate_reasoning",
        "stream_reasoning", "chat_template_kwargs", "return_meta_info", "return_token_ids",
        "return_prompt_token_ids", "return_cached_tokens_details", "return_routed_experts",
        "routed_experts_start_len", "return_indexer_topk", "max_dynamic_patch", "min_dynamic_patch",
        "lora_path", "priority", "extra_key", "cache_salt", "custom_params", "images_config",
        "include_stop_str_in_output", "spaces_between_special_tokens", "add_generation_prompt",
        "add_special_tokens", "length_penalty", "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
        "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "return_tokens_as_token_ids", "prompt_logprobs", "echo", "mm_processor_kwargs")},
    # Set by the server, or reaching into the engine
    "input_ids": (_R, _SERVER_SETS),
    "image_data": (_R, _SERVER_SETS),
    "custom_logit_processor": (_R, "runs code the client sends inside the engine"),
    "logits_processors": (_R, "runs code the client sends inside the engine"),
    "return_hidden_states": (_R, "makes the reply (and every record) as large as the model's hidden states"),
    "session_id": (_R, "the engine's own sessions; the session is in the URL"),
    "session_params": (_R, "the engine's own sessions; the session is in the URL"),
    "rid": (_R, "engine request ids are the server's, one per turn"),
    "request_id": (_R, "engine request ids are the server's, one per turn"),
    **{name: (_R, _INTERNAL) for name in (
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank",
        "data_parallel_rank", "kv_transfer_params", "vllm_xargs", "ngram_corpus_id")},
}


def fields_with(policy: Policy) -> tuple[str, ...]:
    return tuple(name for name, (p, _why) in FIELDS.items() if p is policy)


def check_request_fields(request: Mapping[str, Any]) -> None:
    """Raise :class:`UnknownField` for a field not in :data:`FIELDS`, :class:`InvalidField` for
    a refused one (both 400, naming the field)."""
    for name in request:
        rule = FIELDS.get(name)
        if rule is None:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise UnknownField(shown, "not a chat-completions field this server forwards or uses; "
                                      "unknown fields are refused (docs/session-server-ops.md)")
        if rule[0] is Policy.REFUSED:
            raise InvalidField(name, f"not accepted: {rule[1]}")
