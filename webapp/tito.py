"""Token-in/token-out accounting for one session, free of I/O.

A session's token state is a ``TitoState``: the normalized messages so far (ending with the
committed assistant reply), the accumulated token ids (last prompt ids + output ids), and
what is needed to append the next turn without re-tokenizing earlier ones.

Rules (see docs/session-server.md):

- First turn: prompt ids = ``encode(render(messages, add_generation_prompt=True))``.
- Later turns: the request's messages must extend the stored ones append-only, message
  equality being the server's matcher's (``webapp.matchers``; the stored message stays where
  it says equal). Prompt ids =
  stored ids + ``encode(closer + suffix)``, where ``suffix`` is what the chat template renders
  for the new messages (the text past the rendering of the stored messages) and ``closer`` is
  what the template puts after the model's end-of-turn token (ChatML: ``"\\n"``; the whole
  ``"<|im_end|>\\n"`` when the output stopped without the end-of-turn token).
- A request may instead extend the state before the last turn: a rollback of exactly one
  assistant step. Anything that rewrites older messages is ``RollbackTooDeep``.
- If the template renders the stored messages differently once new ones follow, the ids
  cannot be appended: ``TokenPrefixMismatch``.
- Tools may change between turns (as in miles); ``tools: []`` is the same as no tools. The
  stored ids keep the tools they were rendered with: the closer is found by rendering the
  stored messages with the stored turn's tools, the suffix by rendering old and new messages
  both with the request's tools.
- Images: the messages hold reference parts (``webapp.images``); the template renders one
  pad token per image and :class:`webapp.images.Vision` repeats it to the image's token count,
  for the images of the text being encoded only (the first turn: all; later turns: those of
  the new messages). Earlier turns' images are never re-tokenized: their ids are stored.
- The ids never drop a token the model emitted (the closer is appended after the output), so
  the chat template trims nothing: miles' ``max_trim_tokens`` is 0 (:data:`MAX_TRIM_TOKENS`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, count
from typing import Any

from webapp.images import image_refs
from webapp.matchers import MessageMatcher, strict_message_matches
from webapp.session_errors import AppendOnlyViolation, InvalidField, RollbackTooDeep, TokenPrefixMismatch
from webapp.tokenizers import ChatTokenizer, decode_lenient

__all__ = [
    "INITIAL_STATE",
    "MAX_MESSAGES",
    "MAX_TRIM_TOKENS",
    "TitoState",
    "TurnPlan",
    "commit_turn",
    "encode_messages",
    "normalize_message",
    "normalize_messages",
    "plan_turn",
    "session_mismatch",
]

Message = dict[str, Any]

# A computer-use episode of a few hundred steps has ~1-2k messages; far beyond that is a
# runaway client, refused before any rendering work.
MAX_MESSAGES = 100_000
# Output tokens the next turn's rendering may drop (miles' ``TITOTokenizer.max_trim_tokens``).
MAX_TRIM_TOKENS = 0


@dataclass(frozen=True)
class TitoState:
    messages: tuple[Message, ...]
    tools_key: str | None
    token_ids: tuple[int, ...]
    rendered_prompt: str  # render(messages[:-1], add_generation_prompt=True) of the last turn
    output_ended_with_eos: bool


INITIAL_STATE = TitoState(messages=(), tools_key=None, token_ids=(), rendered_prompt="",
                          output_ended_with_eos=True)


@dataclass(frozen=True)
class TurnPlan:
    base: TitoState
    rollback: bool
    messages: tuple[Message, ...]
    tools_key: str | None
    prompt_text: str
    prompt_ids: list[int]


def _check_str(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise InvalidField(field, f"expected a string, got {type(value).__name__}")
    return value


def normalize_message(raw: Any, where: str = "message") -> Message:
    """The comparable form of one OpenAI message: role, content, name, tool_calls, tool_call_id.

    Other keys (``refusal``, ``annotations``, ``reasoning_content`` ...) and None values are
    dropped, so a client echoing the assistant message through the ``openai`` models still
    compares equal to what was stored.
    """
    if not isinstance(raw, dict):
        raise InvalidField(where, f"expected an object, got {type(raw).__name__}")
    msg: Message = {"role": _check_str(raw.get("role"), f"{where}.role")}
    content = raw.get("content")
    if content is None or isinstance(content, str):
        msg["content"] = content or ""
    elif isinstance(content, list) and all(isinstance(p, dict) for p in content):
        msg["content"] = [{k: v for k, v in p.items() if v is not None} for p in content]
    else:
        raise InvalidField(f"{where}.content", "expected a string, null or a list of parts")
    if raw.get("name") is not None:
        msg["name"] = _check_str(raw["name"], f"{where}.name")
    if raw.get("tool_call_id") is not None:
        msg["tool_call_id"] = _check_str(raw["tool_call_id"], f"{where}.tool_call_id")
    calls = raw.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise InvalidField(f"{where}.tool_calls", "expected a list")
        norm_calls = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise InvalidField(f"{where}.tool_calls[{j}].function", "expected an object")
            arguments = fn.get("arguments")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            norm_calls.append({
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {"name": _check_str(fn.get("name"), f"{where}.tool_calls[{j}].function.name"),
                             "arguments": arguments},
            })
        msg["tool_calls"] = norm_calls
    return msg


def normalize_messages(raw: Any) -> tuple[Message, ...]:
    if not isinstance(raw, list) or not raw:
        raise InvalidField("messages", "expected a non-empty list")
    if len(raw) > MAX_MESSAGES:
        raise InvalidField("messages", f"more than {MAX_MESSAGES} messages")
    return tuple(normalize_message(m, f"messages[{i}]") for i, m in enumerate(raw))


def tools_key(tools: Any) -> str | None:
    """The JSON of a request's tools, keys in the client's order; None for absent or ``[]``
    (the same thing).

    The order is kept because templates render it: Qwen2.5's ``tool | tojson`` writes the keys
    as given, as ``transformers`` does and as the engines' chat APIs do for the OpenAI field
    order; sorted keys made a prompt the engine would never render (found against a real vLLM).
    Two requests whose tools differ only in key order render differently, so they count as a
    change of tools (allowed between turns).
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidField("tools", "expected a list")
    return json.dumps(tools, ensure_ascii=False) if tools else None


def tools_of(key: str | None) -> list[Any] | None:
    return None if key is None else json.loads(key)


def _extends(messages: tuple[Message, ...], stored: tuple[Message, ...], matcher: MessageMatcher) -> bool:
    return len(messages) > len(stored) and all(matcher(a, b) for a, b in zip(stored, messages))


def _first_difference(messages: tuple[Message, ...], stored: tuple[Message, ...], matcher: MessageMatcher) -> int:
    for i, (a, b) in enumerate(zip(stored, messages)):
        if not matcher(a, b):
            return i
    return min(len(messages), len(stored))


def _choose_base(messages: tuple[Message, ...], current: TitoState,
                 previous: TitoState | None, matcher: MessageMatcher) -> tuple[TitoState, bool]:
    if _extends(messages, current.messages, matcher):
        return current, False
    if previous is not None and _extends(messages, previous.messages, matcher):
        return previous, True
    i = _first_difference(messages, current.messages, matcher)
    if i == len(messages) == len(current.messages):
        raise AppendOnlyViolation("no new message after the stored conversation")
    if previous is not None and i < len(previous.messages):
        raise RollbackTooDeep(
            f"message {i} differs from the stored conversation; only the last assistant step "
            f"(messages {len(previous.messages)}..) may be rolled back")
    raise AppendOnlyViolation(f"message {i} differs from the stored conversation (append-only)")


def _turn_closer(reply_region: str, eos_token: str, ended_with_eos: bool) -> str:
    """Text the template renders after the model's tokens for the stored assistant reply."""
    k = reply_region.rfind(eos_token)
    if k < 0:
        return ""
    return reply_region[k + len(eos_token):] if ended_with_eos else reply_region[k:]


def encode_messages(tokenizer: ChatTokenizer, text: str, messages: Sequence[Message]) -> list[int]:
    """``tokenizer.encode(text)``, ``text`` being what the template rendered for ``messages``:
    each image's pad token expanded to its count (see :class:`webapp.images.Vision`)."""
    ids = tokenizer.encode(text)
    refs = image_refs(messages)
    vision = tokenizer.vision
    if vision is None:
        if refs:
            raise InvalidField("messages", f"the tokenizer {tokenizer.name!r} has no vision tokens: "
                                           "this model takes no images")
        return ids
    return vision.expand(ids, refs)


def plan_turn(current: TitoState, previous: TitoState | None, raw_messages: Any, tools: Any,
              tokenizer: ChatTokenizer, matcher: MessageMatcher = strict_message_matches) -> TurnPlan:
    """Validate a turn's messages against the session and compute its prompt ids.

    ``matcher(stored, request)`` decides whether a request's message is the stored one at its
    position (``webapp.matchers``); where it says so, the stored message stays: the plan's
    messages are the base's followed by the request's beyond them, as miles'
    ``effective_messages``, so the prompt ids are the stored ones and the next turn compares
    against the same stored history.

    Raises ``InvalidField``, ``AppendOnlyViolation``/``RollbackTooDeep`` (400),
    ``MessageMatcherFailed`` or ``TokenPrefixMismatch`` (500); never mutates state.
    """
    requested = normalize_messages(raw_messages)
    key = tools_key(tools)
    tools = tools_of(key)
    base, rollback = _choose_base(requested, current, previous, matcher)
    messages = (*base.messages, *requested[len(base.messages):])
    if messages[-1]["role"] == "assistant":
        raise AppendOnlyViolation("the last message must not be an assistant message")
    prompt_text = tokenizer.render(messages, add_generation_prompt=True, tools=tools)
    if not base.messages:
        return TurnPlan(base, rollback, messages, key, prompt_text,
                        encode_messages(tokenizer, prompt_text, messages))
    # The stored turn as it was rendered (its own tools): where its assistant reply ends.
    stored_render = tokenizer.render(base.messages, add_generation_prompt=False, tools=tools_of(base.tools_key))
    if not stored_render.startswith(base.rendered_prompt):
        raise TokenPrefixMismatch(
            "chat template renders the stored prompt differently once the assistant reply follows")
    rendered_base = stored_render if key == base.tools_key else tokenizer.render(
        base.messages, add_generation_prompt=False, tools=tools)
    if not prompt_text.startswith(rendered_base):
        raise TokenPrefixMismatch(
            "chat template re-renders the stored messages differently when new messages follow")
    closer = _turn_closer(stored_render[len(base.rendered_prompt):], tokenizer.eos_token,
                          base.output_ended_with_eos)
    new_ids = encode_messages(tokenizer, closer + prompt_text[len(rendered_base):], messages[len(base.messages):])
    return TurnPlan(base, rollback, messages, key, prompt_text, [*base.token_ids, *new_ids])


def commit_turn(plan: TurnPlan, assistant_message: Message, output_ids: Sequence[int],
                eos_token_id: int) -> TitoState:
    """The session state after the turn ``plan`` produced ``output_ids``."""
    return TitoState(
        messages=(*plan.messages, assistant_message),
        tools_key=plan.tools_key,
        token_ids=(*plan.prompt_ids, *output_ids),
        rendered_prompt=plan.prompt_text,
        output_ended_with_eos=bool(output_ids) and output_ids[-1] == eos_token_id,
    )


def _segments(ids: list[int], special: frozenset[int]) -> list[tuple[bool, list[int]]]:
    """``ids`` split at special tokens: each special token alone, runs of others together.
    The special positions are found by C iterators and the runs sliced: a loop over every id
    was most of a long session's first records GET."""
    out: list[tuple[bool, list[int]]] = []
    start = 0
    for i in compress(count(), map(special.__contains__, ids)):
        if i > start:
            out.append((False, ids[start:i]))
        out.append((True, [ids[i]]))
        start = i + 1
    if start < len(ids):
        out.append((False, ids[start:]))
    return out


def _assistant_opener(tokenizer: ChatTokenizer) -> str:
    """What the template puts before an assistant reply (ChatML: ``<|im_start|>assistant``),
    miles' ``assistant_start_str``, found from the generation prompt."""
    probe = ({"role": "user", "content": ""},)
    without = tokenizer.render(probe, add_generation_prompt=False)
    return tokenizer.render(probe, add_generation_prompt=True)[len(without):].strip()


def session_mismatch(state: TitoState, tokenizer: ChatTokenizer) -> list[dict[str, Any]] | None:
    """Where the session's accumulated ids differ from the chat template's own rendering of
    its messages (miles' ``tito_session_mismatch``): a list of
    ``{type, segment_index, expected_text, actual_text, detail}``, empty when they agree,
    None for an empty session.

    Both sequences are split at special tokens and compared segment by segment; the types are
    miles': ``special_token_count`` (the segments do not line up), ``special_token_type``,
    ``assistant_text`` (expected: the model's own tokens need not be the template's) and
    ``non_assistant_text`` (a TITO bug). Trailing whitespace-only tokens (the template's
    newline after the last end-of-turn) are left out on both sides, as miles does.
    """
    if not state.token_ids:
        return None
    expected = encode_messages(tokenizer, tokenizer.render(state.messages, add_generation_prompt=False,
                                                           tools=tools_of(state.tools_key)), state.messages)
    if expected == list(state.token_ids):
        # Nothing to report (every segment pair would be equal), and the common case: a screenshot
        # session's image pads are special tokens, each its own segment, ~1,200 an image, so
        # splitting both sides was most of its first records GET.
        return []
    special = tokenizer.special_token_ids

    def trimmed(ids: Sequence[int]) -> list[int]:
        end = len(ids)
        while end and ids[end - 1] not in special and not decode_lenient(tokenizer, [ids[end - 1]]).strip():
            end -= 1
        return list(ids[:end])

    exp, act = _segments(trimmed(expected), special), _segments(trimmed(state.token_ids), special)
    opener_text = _assistant_opener(tokenizer)

    # A special segment is one id, and a screenshot's ~1,200 image pads are as many segments:
    # each distinct id is decoded once (the same text as decoding every segment).
    special_text = functools.cache(lambda token_id: decode_lenient(tokenizer, [token_id]))

    def describe(segs: list[tuple[bool, list[int]]]) -> str:
        return " ".join(f"[{special_text(ids[0])}]" if sp else f"({len(ids)} tokens)" for sp, ids in segs)

    if [sp for sp, _ in exp] != [sp for sp, _ in act]:
        detail = (f"segment count differs: expected {len(exp)}, got {len(act)}" if len(exp) != len(act)
                  else "segment structure (special/content pattern) differs")
        return [{"type": "special_token_count", "segment_index": -1, "expected_text": describe(exp),
                 "actual_text": describe(act), "detail": detail}]
    mismatches = []
    for i, ((sp, e_ids), (_, a_ids)) in enumerate(zip(exp, act)):
        if e_ids == a_ids:  # most segments: equal ids need no decoding (a long session's GET)
            continue
        e_text, a_text = decode_lenient(tokenizer, e_ids), decode_lenient(tokenizer, a_ids)
        if not sp and e_text == a_text:
            continue
        if sp:
            kind = "special_token_type"
        else:
            opener = decode_lenient(tokenizer, exp[i - 1][1]) if i and exp[i - 1][0] else ""
            kind = "assistant_text" if (opener + e_text).startswith(opener_text) else "non_assistant_text"
        mismatches.append({"type": kind, "segment_index": i, "expected_text": e_text, "actual_text": a_text,
                           "detail": ""})
    return mismatches
