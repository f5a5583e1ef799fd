"""Session message matchers: when a replayed message counts as the stored one (miles'
``--session-message-matcher``), and the selector that names the server's one.

A matcher is ``fn(stored, replayed) -> bool``: True means the client's message at a position is
the stored message there, so the session goes on from the stored state. It decides nothing
else: on a match the stored messages (and their token ids) stay the conversation, the request
only contributes what lies beyond them; on a mismatch the session's usual rules apply (a line
session rolls back one step or answers 400, a tree session branches). The server applies it to
both messages in their comparable form (``webapp.tito.normalize_message``).

The built-ins are miles' (``miles/utils/chat_template_utils/message_matcher_hub/`` at
31f1ca961), by miles' names and with miles' rules:

- ``strict`` (the default): compares ``role``, ``content``, ``reasoning_content`` and
  ``tool_calls``, the keys chat templates read. None, ``""`` and ``[]`` are one value (Jinja
  renders them alike); a tool call's ``index`` is ignored (a wire-only key). Nothing else is
  forgiven: ``" text"`` is not ``"text"``.
- ``loose_tool_call``: everything ``strict`` accepts, plus ``tool_calls[].function.arguments``
  that are the same JSON object however spelled (key order, whitespace, a dict or its JSON
  text; None, ``""`` and ``{}`` are the empty object). JSON types stay apart (``true`` is not
  ``1``, ``1`` is ``1.0``), arrays keep their order; arguments that are not a JSON object (or
  have duplicate keys, NaN, Infinity) compare raw and type-sensitively. Call ids, types,
  function names, the calls' count and order, unknown fields and ``reasoning_content`` must
  still match.
- ``role_content_only``: ``role`` and ``content`` only (with the empty-value rule). High risk:
  different tool-call or reasoning histories collapse into one lineage, and call ids are not
  reconciled (the stored ``call-A`` stays, a replayed tool result may name ``call-B``).

A selector is a built-in's exact name (case-sensitive, as miles), miles' own import path of a
built-in (so a miles configuration's value selects ours), or an import path
``package.module.function`` / ``package.module:function`` of a trusted synchronous custom
matcher. Every resolved matcher is held to the contract at call time: a matcher that raises or
returns anything but a ``bool`` is :class:`MessageMatcherFailed` (500, as miles), never a
match or a mismatch. A selector that names none is :class:`UnknownMatcher`, raised at start-up.

Imports only the error roots, so the launcher checks a selector without the session core.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from webapp.errors import WebappError
from webapp.named_functions import resolve_function
from webapp.session_errors import SessionError

__all__ = [
    "DEFAULT_MATCHER",
    "MATCHERS",
    "ConfiguredMatcher",
    "MessageMatcher",
    "MessageMatcherFailed",
    "UnknownMatcher",
    "loose_tool_call_message_matches",
    "resolve_matcher",
    "role_content_only_message_matches",
    "strict_message_matches",
]

Message = dict[str, Any]
# fn(stored, replayed) -> the replayed message is the stored one (miles' SessionMessageMatcher)
MessageMatcher = Callable[[Message, Message], bool]

# The keys chat templates read; within a tool call, the keys no template reads (SGLang sends
# ``index`` on non-streamed calls, accumulated streamed ones may omit or renumber it).
TEMPLATE_RELEVANT_KEYS = ("role", "content", "reasoning_content", "tool_calls")
WIRE_ONLY_TOOL_CALL_KEYS = ("index",)


class UnknownMatcher(WebappError, ValueError):
    """A ``session_message_matcher`` selector that names no synchronous matcher (start-up)."""


class MessageMatcherFailed(SessionError):
    """The configured matcher raised or returned a non-``bool``: a configuration error, never
    taken as a match or a mismatch (miles answers 500 too). Nothing is stored."""

    status = 500

    def __init__(self, message: str, *, matcher: str) -> None:
        super().__init__(message)
        self.matcher = matcher


# -- normalization (miles' message_matcher_hub/utils.py) ------------------------------------------

_INVALID = object()  # an ``arguments`` value that is no JSON object: compared raw


def _empty_as_none(value: Any) -> Any:
    """None, "" and [] render alike in Jinja; anything else (whitespace included) is kept."""
    if value is None or value == "" or value == []:
        return None
    return value


def _without_wire_keys(calls: Any) -> Any:
    if not isinstance(calls, list):
        return calls
    return [{k: v for k, v in call.items() if k not in WIRE_ONLY_TOOL_CALL_KEYS} if isinstance(call, dict)
            else call for call in calls]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate JSON object key: {key!r}")
        result[key] = value
    return result


def _finite_number(raw: str) -> Decimal:
    try:
        value = Decimal(raw)
    except InvalidOperation as exc:
        raise ValueError(f"invalid JSON number: {raw!r}") from exc
    if not value.is_finite():
        raise ValueError(f"non-finite JSON number: {raw!r}")
    return value


def _no_constant(raw: str) -> Any:
    raise ValueError(f"non-standard JSON constant: {raw!r}")


def _tagged(value: Any, *, allow_decimal: bool) -> tuple[Any, ...]:
    """A parsed JSON value in a type-tagged, key-sorted form: ``True`` and ``1`` stay apart,
    ``1`` and ``1.0`` are one exact number, object keys are sorted, arrays keep their order."""
    kind = type(value)
    if value is None:
        return ("null",)
    if kind is bool:
        return ("boolean", value)
    if kind is str:
        return ("string", value)
    if kind is int:
        return ("number", Decimal(value))
    if kind is float:
        if not math.isfinite(value):
            raise ValueError("non-finite JSON number")
        return ("number", Decimal(str(value)))
    if kind is Decimal:
        if not allow_decimal or not value.is_finite():
            raise ValueError("value is not a JSON-compatible number")
        return ("number", value)
    if kind is list:
        return ("array", tuple(_tagged(item, allow_decimal=allow_decimal) for item in value))
    if kind is dict:
        if any(type(key) is not str for key in value):
            raise ValueError("JSON object keys must be strings")
        return ("object", tuple(sorted((key, _tagged(item, allow_decimal=allow_decimal))
                                       for key, item in value.items())))
    raise ValueError(f"value of type {kind.__name__} is not JSON-compatible")


def _json_object(value: Any) -> tuple[Any, ...] | object:
    """``arguments`` as a comparable JSON object (None and "" are the empty one), or _INVALID."""
    if value is None or value == "":
        return ("object", ())
    parsed = value
    if type(value) is str:
        try:
            parsed = json.loads(value, object_pairs_hook=_unique_keys, parse_int=Decimal,
                                parse_float=_finite_number, parse_constant=_no_constant)
        except (OverflowError, RecursionError, TypeError, ValueError):
            return _INVALID
    if type(parsed) is not dict:
        return _INVALID
    try:
        return _tagged(parsed, allow_decimal=type(value) is str)
    except (RecursionError, TypeError, ValueError):
        return _INVALID


def _raw_equal(stored: Any, replayed: Any) -> bool:
    """Type-sensitive structural equality (``1 == True`` is not a match here)."""
    try:
        if type(stored) is not type(replayed):
            return False
        if isinstance(stored, list):
            return len(stored) == len(replayed) and all(_raw_equal(a, b) for a, b in zip(stored, replayed))
        if isinstance(stored, dict):
            return stored.keys() == replayed.keys() and all(_raw_equal(stored[k], replayed[k]) for k in stored)
        return bool(stored == replayed)
    except RecursionError:
        return False


# -- the built-ins (miles' message_matcher_hub/funcs.py) ------------------------------------------

def strict_message_matches(stored: Message, replayed: Message) -> bool:
    """The keys templates read, equal up to the empty-value rule and tool calls' ``index``."""
    for key in TEMPLATE_RELEVANT_KEYS:
        a, b = _empty_as_none(stored.get(key)), _empty_as_none(replayed.get(key))
        if key == "tool_calls":
            a, b = _without_wire_keys(a), _without_wire_keys(b)
        if a != b:
            return False
    return True


def _arguments_match(stored: Any, replayed: Any) -> bool:
    a, b = _json_object(stored), _json_object(replayed)
    if a is _INVALID or b is _INVALID:
        return _raw_equal(stored, replayed)
    return a == b


def _function_matches(stored: Any, replayed: Any) -> bool:
    if not isinstance(stored, dict) or not isinstance(replayed, dict):
        return _raw_equal(stored, replayed)
    if stored.keys() != replayed.keys():
        return False
    return all(_arguments_match(stored[k], replayed[k]) if k == "arguments" else stored[k] == replayed[k]
               for k in stored)


def _tool_call_matches(stored: Any, replayed: Any) -> bool:
    if not isinstance(stored, dict) or not isinstance(replayed, dict):
        return _raw_equal(stored, replayed)
    a = {k: v for k, v in stored.items() if k not in WIRE_ONLY_TOOL_CALL_KEYS}
    b = {k: v for k, v in replayed.items() if k not in WIRE_ONLY_TOOL_CALL_KEYS}
    if a.keys() != b.keys():
        return False
    return all(_function_matches(a[k], b[k]) if k == "function" else a[k] == b[k] for k in a)


def loose_tool_call_message_matches(stored: Message, replayed: Message) -> bool:
    """``strict``, plus tool-call arguments that are the same JSON object however spelled."""
    try:
        if strict_message_matches(stored, replayed):
            return True
    except RecursionError:
        pass
    for key in ("role", "content", "reasoning_content"):
        if _empty_as_none(stored.get(key)) != _empty_as_none(replayed.get(key)):
            return False
    a, b = _empty_as_none(stored.get("tool_calls")), _empty_as_none(replayed.get("tool_calls"))
    if not isinstance(a, list) or not isinstance(b, list):
        return _raw_equal(a, b)
    return len(a) == len(b) and all(_tool_call_matches(x, y) for x, y in zip(a, b))


def role_content_only_message_matches(stored: Message, replayed: Message) -> bool:
    """``role`` and ``content`` only, with the empty-value rule; every other field is ignored."""
    return all(_empty_as_none(stored.get(k)) == _empty_as_none(replayed.get(k)) for k in ("role", "content"))


MATCHERS: dict[str, MessageMatcher] = {
    "strict": strict_message_matches,
    "loose_tool_call": loose_tool_call_message_matches,
    "role_content_only": role_content_only_message_matches,
}
DEFAULT_MATCHER = "strict"
_MILES_HUB = "miles.utils.chat_template_utils.message_matcher_hub"
# miles' import paths of its built-ins (the package re-exports them; funcs defines them)
_MILES_PATHS: dict[str, MessageMatcher] = {
    f"{_MILES_HUB}{module}.{fn.__name__}": fn
    for fn in MATCHERS.values() for module in ("", ".funcs")
}


# -- the selector ---------------------------------------------------------------------------------

class ConfiguredMatcher:
    """The server's matcher: ``fn`` held to the contract (exactly a ``bool``, no exception),
    reported by the selector that named it."""

    def __init__(self, fn: MessageMatcher, name: str) -> None:
        self.fn = fn
        self.name = name

    def __call__(self, stored: Message, replayed: Message) -> bool:
        try:
            result = self.fn(stored, replayed)
        except Exception as exc:  # a matcher bug is the configuration's, answered as such
            raise MessageMatcherFailed(f"session message matcher {self.name} raised "
                                       f"{type(exc).__name__}: {exc}", matcher=self.name) from exc
        if type(result) is not bool:
            raise MessageMatcherFailed(f"session message matcher {self.name} must return bool, got "
                                       f"{type(result).__name__}", matcher=self.name)
        return result

    def __repr__(self) -> str:
        return f"ConfiguredMatcher({self.name!r})"


def _choices() -> str:
    return ", ".join(MATCHERS)


def resolve_matcher(selector: str | None) -> ConfiguredMatcher:
    """The matcher ``selector`` names (module docstring); None or "" is the default.

    Raises :class:`UnknownMatcher` when it names none, names something that is not callable,
    or an async function (matchers run synchronously, under a session's lock)."""
    if selector is not None and not isinstance(selector, str):
        raise UnknownMatcher(f"session message matcher {selector!r}: not a string")
    name = (selector or "").strip() or DEFAULT_MATCHER
    fn = resolve_function(name, {**MATCHERS, **_MILES_PATHS}, UnknownMatcher, "session message matcher",
                          f"unknown session message matcher {name!r}: use one of {_choices()}, or an "
                          "import path package.module.function (or package.module:function)")
    return ConfiguredMatcher(fn, name)
