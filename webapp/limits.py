"""Limits that bound the work one request or one client can make the session core do.

The body cap (``MAX_CHAT_BODY_BYTES``) bounds bytes on the wire, not work: one legal chat
with a 124 MiB message kept a worker busy for seconds (tokenizing, then encoding 130 M token
ids). These limits match the work instead, and are checked before it is done:

- JSON: more than :data:`MAX_JSON_CONTAINERS` brackets are refused before decoding (413),
  (the long base64 data URLs of image parts are cut out of the text before decoding and put
  back after: :func:`loads_strict`, same value, same errors),
  ``NaN``/``Infinity`` literals are refused at decode, nesting deeper than
  :data:`MAX_JSON_DEPTH` is refused (400, ``InvalidJSON``) before any code walks it, and so
  is a lone surrogate escape (``"\\ud800"``: not text, it cannot be encoded into a record).
- ``max_message_bytes``: the UTF-8 size of one message's text (content, text parts, tool-call
  names and arguments), checked before rendering (413, :class:`LimitExceeded`).
- ``max_prompt_tokens``: the prompt token ids of one turn (stored + new), checked right after
  tokenizing and before the backend call; the request's whole text is refused before
  tokenizing when it exceeds ``max_prompt_tokens * MAX_BYTES_PER_TOKEN`` bytes, so a request
  whose messages each pass cannot make the tokenizer do unbounded work either.
- ``max_sessions`` (429, :class:`TooManySessions`; counted over the server's data directory, so
  every worker admits against the same count) and ``session_idle_ttl`` (a session nobody
  touched that long is deleted, its journal too) bound the sessions a server holds.

Every limit is named in its error (``limit`` attribute and message), so a client can tell
which one it hit. Imports nothing of the core: the core calls it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import pybase64

from webapp.session_errors import BodyTooLarge, InvalidJSON, SessionError
from webapp.settings import default

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MAX_PROMPT_TOKENS",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_IDLE_TTL",
    "MAX_JSON_CONTAINERS",
    "MAX_JSON_DEPTH",
    "LimitExceeded",
    "RequestLimits",
    "SessionExpiry",
    "TooManySessions",
    "URLBytes",
    "json_depth_exceeds",
    "loads_strict",
    "loads_strict_urls",
    "require_positive",
]

# Declared in webapp.settings.SETTINGS; named here for the core's callers.
DEFAULT_MAX_MESSAGE_BYTES: int = default("max_message_bytes")  # a long tool output, far below the body cap
DEFAULT_MAX_PROMPT_TOKENS: int = default("max_prompt_tokens")  # the longest context windows served today
DEFAULT_MAX_SESSIONS: int = default("max_sessions")  # per server: the journals in its data directory
DEFAULT_SESSION_IDLE_TTL: float = default("session_idle_ttl")  # a day without a request: the client is gone
# Requests nest a handful of levels (messages -> content parts -> image_url); tool schemas a
# few more. Far below the interpreter's recursion limit, which a 1,000-level body reached.
MAX_JSON_DEPTH = 64
# Each '[' or '{' becomes a Python list or dict of ~60-250 bytes: a 256 MiB body of "[]" would
# decode to gigabytes. Counted in the raw body (brackets inside strings too, so conservative);
# a chat has a few thousand, a huge message of source code a few hundred thousand.
MAX_JSON_CONTAINERS = 2_000_000
# Byte-level BPE vocabularies average ~4 bytes per token; a request with more text than this
# many bytes per allowed token cannot fit, whatever the tokenizer.
MAX_BYTES_PER_TOKEN = 16
_SWEEP_INTERVAL = 1.0  # idle sessions are looked for at most this often
_PAIR = re.compile(rb"\[\]|\{\}")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: 16x faster on base64
# A \uD800-\uDFFF escape: the only way a surrogate gets into a decoded JSON string.
_SURROGATE_ESCAPE_TEXT = re.compile(r"\\u[dD][89a-fA-F]")
# The same patterns over the decoded text (loads_strict decodes once and scans the text).
_PAIR_TEXT = re.compile(r"\[\]|\{\}")
_JSON_STRING_TEXT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


class LimitExceeded(BodyTooLarge):
    """413: the request would make the core do more work than ``limit`` allows."""

    def __init__(self, limit: str, allowed: int, actual: int, what: str) -> None:
        super().__init__(limit, allowed, actual, what)
        self.limit = limit
        self.allowed = allowed
        self.actual = actual
        self.what = what

    def __str__(self) -> str:
        return f"{self.what} is {self.actual}, over the limit {self.limit}={self.allowed}"


class TooManySessions(SessionError):
    status = 429

    def __init__(self, allowed: int) -> None:
        super().__init__(allowed)
        self.limit = "max_sessions"
        self.allowed = allowed

    def __str__(self) -> str:
        return f"this server holds {self.allowed} sessions, the limit max_sessions={self.allowed}; delete some"


def _refuse_constant(name: str) -> Any:
    raise InvalidJSON(f"invalid JSON body: {name} is not a JSON number")


def json_depth_exceeds(body: bytes | str, max_depth: int) -> bool:
    """True if the valid JSON ``body`` (bytes or its decoded text) nests arrays/objects deeper
    than ``max_depth``.

    Runs at C speed: strings are cut out, then each pass removes the innermost ``[]``/``{}``
    pairs, exactly one level per pass.
    """
    opened = body.count("[") + body.count("{") if isinstance(body, str) else body.count(b"[") + body.count(b"{")
    if opened <= max_depth:  # the common case: nothing to scan
        return False
    brackets: str | bytes
    if isinstance(body, str):
        brackets = re.sub(r"[^\[\]{}]", "", _JSON_STRING_TEXT.sub("", body))
        pair: re.Pattern[Any] = _PAIR_TEXT
    else:
        brackets = re.sub(rb"[^\[\]{}]", b"", _JSON_STRING.sub(b"", body))
        pair = _PAIR
    for _ in range(max_depth):
        brackets = pair.sub(brackets[:0], brackets)
        if not brackets:
            return False
    return True


# A string this long that is a base64 data URL is cut out of the text before decoding (below).
_CUT_MIN_CHARS = 4096
_DATA_URL_OPEN = '"data:image/'
_DATA_URL_HEAD = re.compile(r'"data:image/(?:jpeg|jpg|png);base64,')
_CUT_MARK = "\x00"  # a cut string's stand-in is this + its index, written "\\u0000<index>"
_CUT_MARK_ESCAPE = "\\u0000"
_WS = " \t\n\r"


def _cut_data_urls(text: str) -> tuple[str, list[str], list[int]] | None:
    """``text`` with each long ``"data:image/(jpeg|jpg|png);base64,<base64>"`` string value
    replaced by ``"\\u0000<k>"``, the k-th URL, and where the k-th URL starts in ``text``;
    None when nothing is cut.

    What makes the result decode to the same value but for those strings: a cut string opens
    after ``:``, ``[`` or ``,`` (so its quote is no escaped one: in valid JSON it opens a string),
    is no object key (no ``:`` after it), and its payload is base64 (no backslash, quote or
    control character: ``json`` would decode it to exactly its text). Valid JSON stays valid and
    invalid stays invalid (the cut keeps the tokens' boundaries), and no stand-in can collide
    with a client's string: nothing is cut when the text outside the cut strings holds the
    ``\\u0000`` escape, the only way a decoded string starts with NUL.
    """
    start = text.find(_DATA_URL_OPEN)
    if start < 0:
        return None
    pieces: list[str] = []
    urls: list[str] = []
    starts: list[int] = []
    last = 0
    # Candidates looked at, bounded by what could be cut: a body of millions of short
    # '"data:image/' strings costs no more than one pass of finds.
    budget = len(text) // _CUT_MIN_CHARS + 64
    while start >= 0 and budget > 0:
        budget -= 1
        end = text.find('"', start + 1)
        if end < 0:
            break
        if end - start > _CUT_MIN_CHARS and _cuttable(text, start, end):
            pieces += (text[last:start], f'"{_CUT_MARK_ESCAPE}{len(urls)}"')
            urls.append(text[start + 1:end])
            starts.append(start + 1)
            last = end + 1
        start = text.find(_DATA_URL_OPEN, end + 1)
    if not urls:
        return None
    pieces.append(text[last:])
    if any(_CUT_MARK_ESCAPE in piece for piece in pieces[::2]):  # the text between the cuts
        return None
    return "".join(pieces), urls, starts


def _cuttable(text: str, start: int, end: int) -> bool:
    # The neighbours past at most 64 whitespace characters (more: not cut, not worth the care).
    before = text[max(0, start - 64):start].rstrip(_WS)[-1:]
    after = text[end + 1:end + 65].lstrip(_WS)[:1]
    if before not in (":", "[", ",") or after not in (",", "]", "}"):
        return False  # not a value in an array or object (a key, or not valid JSON here)
    head = _DATA_URL_HEAD.match(text, start, end)
    if head is None:
        return False
    try:
        pybase64.b64decode(text[head.end():end], validate=True)  # SIMD; only the alphabet passes
    except ValueError:
        return False
    return True


def _put_back(value: Any, urls: list[str]) -> int:
    """Put the cut URLs back into the decoded ``value`` (in place); how many were put back."""
    restored = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list) and _SCALARS.issuperset(map(type, node)):
            continue  # (at C speed: a prompt's token ids)
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            if isinstance(child, str):
                if child[:1] == _CUT_MARK and child[1:].isdigit() and int(child[1:]) < len(urls):
                    node[key] = urls[int(child[1:])]
                    restored += 1
            elif isinstance(child, (dict, list)):
                stack.append(child)
    return restored


# The types a decoded JSON value holds besides lists and dicts.
_SCALARS = frozenset((int, float, bool, type(None)))
# Walking a decoded container costs about what scanning this many bytes of text does.
_WALK_BYTES_PER_CONTAINER = 64


def _value_depth_exceeds(value: Any, max_depth: int) -> bool:
    """True if the decoded JSON ``value`` nests lists/dicts deeper than ``max_depth`` (the same
    count as :func:`json_depth_exceeds` on its text: ``[]`` is one level)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > max_depth:
            return True
        if _SCALARS.issuperset(map(type, children)):
            continue  # nothing nested (at C speed: a prompt's token ids)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class URLBytes:
    """The data URLs :func:`loads_strict_urls` cut out of a body, as bytes: views of the body
    itself, by the string the decoded value holds (looked up by identity, so only that very
    string finds its view). A view is as valid as the body: for the request that received it
    (a worker's receive buffer is lent to one request)."""

    def __init__(self, body: bytes | memoryview | None = None, urls: Sequence[str] = (),
                 starts: Sequence[int] = ()) -> None:
        view = memoryview(body).cast("B") if body is not None and urls else None
        self._by_id = {id(url): (url, view[at:at + len(url)]) for url, at in zip(urls, starts)} if view else {}

    def get(self, url: object) -> memoryview | None:
        """``url``'s text as the body's bytes (= its UTF-8 encoding), or None."""
        held = self._by_id.get(id(url))
        return held[1] if held is not None and held[0] is url else None


def loads_strict(body: bytes | memoryview, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode a UTF-8 JSON request body, refusing ``NaN``/``Infinity`` and deep nesting.

    ``body`` may be any bytes-like object (a worker passes a view of its receive buffer: no
    copy of the body is made besides its decoded text). Raises ``InvalidJSON`` (400) for
    anything else than strict JSON of bounded depth, and :class:`LimitExceeded` (413) for a
    body with more than :data:`MAX_JSON_CONTAINERS` brackets (before decoding the JSON).

    A screenshot turn's body is mostly base64 data URLs, which ``json`` would scan character
    by character (and the checks with it): they are cut out of the text before decoding and
    put back into the value after (:func:`_cut_data_urls`), so the decoding and every check
    runs over the rest. The value is the same; a body the cut text fails on is decoded again
    whole, so its error is the same too.
    """
    return loads_strict_urls(body, max_depth)[0]


def loads_strict_urls(body: bytes | memoryview, max_depth: int = MAX_JSON_DEPTH) -> tuple[Any, URLBytes]:
    """:func:`loads_strict`, and the data URLs it cut out as views of ``body`` (:class:`URLBytes`):
    a screenshot turn hashes them and sends them to the engine without encoding each string
    again. Views only when the body is ASCII (its characters are its bytes, one each)."""
    try:
        text = str(body, "utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJSON(f"invalid JSON body: {exc}") from exc
    cut = _cut_data_urls(text) if len(text) > _CUT_MIN_CHARS else None
    if cut is not None:
        try:
            value = _loads_text(cut[0], max_depth)
        except (ValueError, SessionError):
            pass  # the error as the whole text gives it
        else:
            if _put_back(value, cut[1]) == len(cut[1]):
                return value, URLBytes(body, cut[1], cut[2]) if text.isascii() else URLBytes()
    return _loads_text(text, max_depth), URLBytes()


def _loads_text(text: str, max_depth: int) -> Any:
    """:func:`loads_strict` of the decoded text."""
    containers = text.count("[") + text.count("{")
    if containers > MAX_JSON_CONTAINERS:
        raise LimitExceeded("max_json_containers", MAX_JSON_CONTAINERS, containers,
                            "the '[' and '{' characters in the request body")
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise InvalidJSON(f"invalid JSON body: nests deeper than {max_depth} levels") from None
    except ValueError as exc:
        if isinstance(exc, InvalidJSON):
            raise
        raise InvalidJSON(f"invalid JSON body: {exc}") from exc
    # The depth from the decoded value when it holds few containers for its size (a screenshot
    # turn: a few hundred around megabytes of base64, which the text scan would cut out string
    # by string), else at C speed over the text (a body of many small containers).
    few = containers * _WALK_BYTES_PER_CONTAINER < len(text)
    if _value_depth_exceeds(value, max_depth) if few else json_depth_exceeds(text, max_depth):
        raise InvalidJSON(f"invalid JSON body: nests deeper than {max_depth} levels")
    if _SURROGATE_ESCAPE_TEXT.search(text):  # rare: only then pay for a full re-encode
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidJSON("invalid JSON body: a lone surrogate (\\ud800-\\udfff) in a string") from None
    return value


def _utf8_size(text: str, bound: int) -> int:
    # len() is a lower bound and 4 * len() an upper one: encode only when it matters.
    if 4 * len(text) <= bound:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _message_texts(message: Any) -> Iterable[str]:
    if not isinstance(message, dict):
        return
    for key in ("content", "name", "role", "tool_call_id"):
        value = message.get(key)
        if isinstance(value, str):
            yield value
        elif key == "content" and isinstance(value, list):
            yield from (p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    calls = message.get("tool_calls")
    # Any JSON type may arrive here (5, "x", {}, true): only a list is walked; the turn's own
    # validation (webapp.tito.normalize_message) then refuses the others by name (400).
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            yield from (v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))


def require_positive(limits: Any) -> None:
    """Every field of the dataclass ``limits`` >= 1, else ``ValueError`` naming it."""
    for name in (f.name for f in fields(limits)):
        if getattr(limits, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(limits, name)}")


@dataclass(frozen=True)
class RequestLimits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS

    def __post_init__(self) -> None:
        require_positive(self)

    def check_messages(self, messages: Any) -> None:
        """Before rendering: every message's text within ``max_message_bytes``, the whole
        text within what ``max_prompt_tokens`` could ever hold. Malformed messages pass (the
        turn's own validation names them)."""
        if not isinstance(messages, list):
            return
        total_bound = self.max_prompt_tokens * MAX_BYTES_PER_TOKEN
        total = 0
        for i, message in enumerate(messages):
            size = sum(_utf8_size(t, self.max_message_bytes) for t in _message_texts(message))
            if size > self.max_message_bytes:
                raise LimitExceeded("max_message_bytes", self.max_message_bytes, size,
                                    f"the text of messages[{i}] in bytes")
            total += size
        if total > total_bound:
            raise LimitExceeded("max_prompt_tokens", self.max_prompt_tokens, total,
                                f"the messages' text in bytes (more than {MAX_BYTES_PER_TOKEN} per token)")

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if len(prompt_ids) > self.max_prompt_tokens:
            raise LimitExceeded("max_prompt_tokens", self.max_prompt_tokens, len(prompt_ids),
                                "the turn's prompt in tokens")


class SessionExpiry:
    """Admission (``max_sessions``) and idle expiry (``session_idle_ttl``) of one registry.

    Expiry is lazy, so both server modes get it without a timer of their own: every core call
    first deletes the sessions idle past the TTL, at most once per :data:`_SWEEP_INTERVAL`.
    ``idle_since()`` lists ``(session_id, last_used)``; ``remove(session_id)`` deletes one.
    """

    def __init__(self, max_sessions: int, idle_ttl: float, idle_since: Callable[[], Iterable[tuple[str, float]]],
                 remove: Callable[[str], object], clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1 or not idle_ttl > 0:
            raise ValueError(f"max_sessions must be >= 1 and session_idle_ttl > 0, got {max_sessions}, {idle_ttl}")
        self.max_sessions = max_sessions
        self.idle_ttl = idle_ttl
        self._idle_since = idle_since
        self._remove = remove
        self._clock = clock
        self._next_sweep = 0.0
        self._lock = threading.Lock()
        self.expired = 0

    def admit(self, live: int) -> None:
        if live >= self.max_sessions:
            raise TooManySessions(self.max_sessions)

    def sweep(self) -> None:
        now = self._clock()
        if now < self._next_sweep or not self._lock.acquire(blocking=False):
            return
        try:
            self._next_sweep = now + min(_SWEEP_INTERVAL, self.idle_ttl)
            stale = [sid for sid, used in list(self._idle_since()) if now - used > self.idle_ttl]
            for session_id in stale:
                try:
                    self._remove(session_id)
                except SessionError:  # deleted meanwhile
                    continue
                self.expired += 1
        finally:
            self._lock.release()
