"""Chat tokenizers: text <-> token ids plus the chat template that renders messages to text.

Two implementations share the ``ChatTokenizer`` protocol:

- ``ByteChatTokenizer``: the embedded default, no dependencies. One id per UTF-8 byte
  (0..255) plus three ChatML and three vision special tokens; exact and reversible
  (``decode(encode(s)) == s`` for every str without U+F0000).
- ``HFChatTokenizer``: a real model's ``tokenizer.json`` (via the ``tokenizers`` package) and
  its Jinja2 chat template, without importing ``transformers``.

``load_tokenizer(None)`` gives the byte tokenizer; ``load_tokenizer(path)`` the HF adapter.

Text never forges a control token: a message or tool definition may contain ``<|im_end|>``
(a tool's output, a web page), and both tokenizers must turn it into ordinary text tokens, or
untrusted text could close a turn and open a forged one in a token-exact record. ``render``
therefore escapes every special token's text inside message and tool fields (see
:class:`SpecialText`); ``encode`` maps the template's own special tokens to their ids and an
escaped one back to its text, tokenized as text (docs/session-server.md, "Hostile input").
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from webapp.errors import WebappError
from webapp.images import QwenVLRule, Vision

__all__ = [
    "ESCAPE_MEMO_CHARS",
    "ESCAPE_MEMO_MESSAGES",
    "ByteChatTokenizer",
    "ChatTokenizer",
    "EscapedMessages",
    "HFChatTokenizer",
    "SpecialText",
    "TokenizerLoadError",
    "content_text",
    "decode_lenient",
    "load_tokenizer",
    "template_message",
    "template_messages",
]

Message = dict[str, Any]

# Rendered in place of a content part that is neither text nor an image by the byte template.
IMAGE_PLACEHOLDER = "<|image|>"
# Qwen2-VL's vision tokens: the byte tokenizer's own, and the names looked for in a model's vocabulary.
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"


class TokenizerLoadError(WebappError):
    """The tokenizer directory is missing ``tokenizer.json`` or a usable chat template."""


class ChatTokenizer(Protocol):
    name: str
    eos_token: str  # the end-of-turn marker the model emits to finish an assistant turn
    eos_token_id: int
    special_token_ids: frozenset[int]  # ids of the special (added, ``special=True``) tokens
    vision: Vision | None  # None: the model takes no images (an image part is refused)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> str: ...


# The escape of special-token text inside rendered fields: a Unicode private-use code point
# (plane 15), doubled when it occurs in a field itself, so escaping is reversible for every str.
_ESC = "\U000F0000"
_MARKER_BASE = 0xF0001  # ESC + chr(_MARKER_BASE + k): the text of special token k
_MAX_STARTS = 4


class SpecialText:
    """Keeps special tokens out of text fields: the escape ``render`` applies to fields, and the
    split of rendered text into control tokens and ordinary text that ``encode`` uses."""

    def __init__(self, special_tokens: Sequence[str]) -> None:
        self.tokens = tuple(special_tokens)
        self._index = {tok: k for k, tok in enumerate(self.tokens)}
        # Longest first, so a token that is a prefix of another never wins.
        alternatives = "|".join(re.escape(t) for t in sorted(self.tokens, key=len, reverse=True))
        self._field_re = re.compile(re.escape(_ESC) + (f"|{alternatives}" if alternatives else ""))
        self._rendered_re = re.compile(f"{re.escape(_ESC)}(.)" + (f"|({alternatives})" if alternatives else ""),
                                       re.DOTALL)
        # A field holding none of the characters an escape starts with is returned as it is:
        # a substring test per character is a tenth of a regex call, and a turn escapes every
        # field of the conversation twice (two renders). Past a few characters the regex is cheaper.
        starts = sorted({t[0] for t in self.tokens if t} | {_ESC})
        self._starts = starts if len(starts) <= _MAX_STARTS else None

    def escape(self, value: Any) -> Any:
        """``value`` (str, or dicts/lists of them) with every special token's text escaped."""
        cls = type(value)
        if cls is str:
            return self._escape_str(value)
        if cls is dict:  # (a message: its fields inline, without a call each)
            escape_str, escape = self._escape_str, self.escape
            return {k: escape_str(v) if type(v) is str else escape(v) for k, v in value.items()}
        if cls is list or cls is tuple:
            escape_str, escape = self._escape_str, self.escape
            return [escape_str(v) if type(v) is str else escape(v) for v in value]
        if isinstance(value, str):
            return self._escape_str(value)
        if isinstance(value, dict):
            return {k: self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def _escape_str(self, value: str) -> str:
        starts = self._starts
        if starts is not None:
            for c in starts:
                if c in value:
                    break
            else:
                return value
        return self._field_re.sub(self._escape_one, value)

    def _escape_one(self, match: re.Match[str]) -> str:
        found = match.group(0)
        return _ESC + (_ESC if found == _ESC else chr(_MARKER_BASE + self._index[found]))

    def has_escapes(self, text: str) -> bool:
        return _ESC in text

    def split(self, text: str) -> list[str | int]:
        """Rendered ``text`` -> ordinary text pieces (str, unescaped) and the indexes (int) of
        the special tokens the template itself wrote."""
        pieces: list[str | int] = []
        run: list[str] = []
        at = 0
        for match in self._rendered_re.finditer(text):
            run.append(text[at:match.start()])
            at = match.end()
            escaped, control = match.group(1), match.group(2) if self.tokens else None
            if control is not None:
                pieces.extend(("".join(run), self._index[control]))
                run = []
            elif escaped == _ESC:
                run.append(_ESC)
            elif 0 <= ord(escaped) - _MARKER_BASE < len(self.tokens):
                run.append(self.tokens[ord(escaped) - _MARKER_BASE])
            else:  # not an escape render() made: keep it as it is
                run.append(match.group(0))
        run.append(text[at:])
        pieces.append("".join(run))
        return [p for p in pieces if p != ""]


# What :class:`EscapedMessages` keeps (least recently used dropped past either): messages, and
# characters of their strings. The strings are shared with the messages, so the second bound is
# what it can keep alive of sessions already gone.
ESCAPE_MEMO_MESSAGES = 32768
ESCAPE_MEMO_CHARS = 32 << 20
_PLAIN_TYPES = (int, float, bool, type(None))


def _snapshot(value: Any, chars: list[int]) -> Any:
    """A copy of a JSON-like value whose containers are its own (the strings shared): it stays
    equal to the value only while the value is not changed in place; ``chars[0]`` grows by the
    length of its strings. Raises ``TypeError`` for any other type (not memoized)."""
    cls = type(value)
    if cls is str:
        chars[0] += len(value)
        return value
    if cls is dict:
        return {k: _snapshot(v, chars) for k, v in value.items()}
    if cls is list:
        return [_snapshot(v, chars) for v in value]
    if cls is tuple:
        return tuple(_snapshot(v, chars) for v in value)
    if cls in _PLAIN_TYPES:
        return value
    raise TypeError(cls.__name__)


class EscapedMessages:
    """The messages a template renders, each prepared (``prepare``) and escaped
    (:meth:`SpecialText.escape`), the result kept per message object for the next render.

    A turn renders its whole conversation twice (the prompt, and the stored turn to find where
    its reply ended) and the next turn renders the same stored messages again: escaping every
    field of every message each time was most of a render outside the template itself. A kept
    result is used only while the message still equals the copy taken when it was escaped
    (a message changed in place is escaped anew); the entry holds the message, so its ``id``
    names no other object meanwhile. Bounded: ``limit`` messages and ``char_limit`` characters
    of their strings, least recently used dropped.
    """

    def __init__(self, special_text: SpecialText, prepare: Callable[[Any], Any] = lambda m: m,
                 limit: int = ESCAPE_MEMO_MESSAGES, char_limit: int = ESCAPE_MEMO_CHARS) -> None:
        self._special_text, self._prepare = special_text, prepare
        self.limit, self.char_limit = limit, char_limit
        # id -> (message, copy, escaped, characters). No lock (a gevent lock would cost what is
        # saved): each OrderedDict call is atomic, one that loses a race with another thread's is
        # skipped, and the character count may drift by a race's entry (it bounds memory only).
        self._memo: OrderedDict[int, tuple[Any, Any, Any, int]] = OrderedDict()
        self.chars = 0

    def __call__(self, messages: Sequence[Any]) -> list[Any]:
        out = []
        memo = self._memo
        for message in messages:
            key = id(message)
            kept = memo.get(key)
            if kept is not None and kept[0] is message and kept[1] == message:
                try:
                    memo.move_to_end(key)
                except KeyError:
                    pass
                out.append(kept[2])
                continue
            escaped = self._special_text.escape(self._prepare(message))
            out.append(escaped)
            chars = [0]
            try:
                entry = (message, _snapshot(message, chars), escaped, chars[0])
            except TypeError:  # not JSON-like: escaped each time
                continue
            try:
                if kept is not None:  # the message changed in place since: its old entry goes
                    self.chars -= memo.pop(key)[3]
                memo[key] = entry
                self.chars += entry[3]
                while len(memo) > self.limit or self.chars > self.char_limit:
                    self.chars -= memo.popitem(last=False)[1][3]
            except KeyError:  # a race lost to another thread, or nothing left to drop
                pass
        return out

    def __len__(self) -> int:
        return len(self._memo)


def content_text(content: Any) -> str:
    """The text of an OpenAI ``content`` (str, None, or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            pieces.append(str(part.get("text", "")))
        elif kind in ("image", "image_url"):
            pieces.append(VISION_START + IMAGE_PAD + VISION_END)  # expanded per image by ``Vision``
        else:
            pieces.append(IMAGE_PLACEHOLDER)
    return "".join(pieces)


class ByteChatTokenizer:
    """Byte-level ids with a ChatML template.

    ``decode(encode(s)) == s`` for every str without the escape code point U+F0000, and field
    text that ``render`` escaped (special-token text included) decodes back exactly.

    Template, per message: ``<|im_start|>{role}\\n{content}{tool calls}<|im_end|>\\n``; tool
    calls render as ``\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; a
    ``tools`` list renders first as a ``system`` block ``# Tools`` with one JSON per line; the
    generation prompt is ``<|im_start|>assistant\\n``. An image part renders as Qwen2-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>`` (ids 259-261), the pad expanded by
    :class:`webapp.images.QwenVLRule` with its defaults.
    """

    name = "byte-chatml"
    SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_PAD)
    eos_token = "<|im_end|>"

    def __init__(self) -> None:
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self._special_by_id = {i: tok for tok, i in self._special_ids.items()}
        self._special_text = SpecialText(self.SPECIAL_TOKENS)
        self._escaped_messages = EscapedMessages(self._special_text)
        self.eos_token_id = self._special_ids[self.eos_token]
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS)
        self.special_token_ids = frozenset(self._special_by_id)
        self.vision: Vision | None = Vision(self._special_ids[VISION_START], self._special_ids[IMAGE_PAD],
                                            self._special_ids[VISION_END], QwenVLRule())

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._special_text.split(text):
            if isinstance(piece, int):
                ids.append(256 + piece)
            else:
                ids.extend(piece.encode("utf-8", "surrogatepass"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for tid in ids:
            if 0 <= tid < 256:
                run.append(tid)
                continue
            out.append(run.decode("utf-8", "surrogatepass"))
            run.clear()
            out.append(self._special_by_id.get(tid, ""))
        out.append(run.decode("utf-8", "surrogatepass"))
        return "".join(out)

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> str:
        messages, tools = self._escaped_messages(messages), self._special_text.escape(tools)
        parts: list[str] = []
        if tools:
            lines = "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)
            parts.append(f"<|im_start|>system\n# Tools\n{lines}<|im_end|>\n")
        for m in messages:
            body = content_text(m.get("content"))
            for call in m.get("tool_calls") or ():
                fn = call.get("function") or {}
                payload = json.dumps({"name": fn.get("name"), "arguments": fn.get("arguments")},
                                     ensure_ascii=False)
                body += f"\n<tool_call>\n{payload}\n</tool_call>"
            parts.append(f"<|im_start|>{m['role']}\n{body}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


def template_messages(messages: Sequence[Message]) -> list[Message]:
    """``messages`` as a model's chat template expects them: each tool call's ``arguments`` (a JSON
    string on the OpenAI wire) as the object it encodes.

    Tool-use templates (Qwen2.5's: ``tool_call.arguments | tojson``) are written for objects, and
    the engines render so before applying them (vLLM's ``_postprocess_messages``, per
    transformers' docs); a string would render JSON-escaped inside a string, a prompt the model
    never saw in training and not what the engine's own chat API renders. A string that is not
    a JSON object stays as it is (nothing is lost; vLLM would render ``{}``).
    """
    return [template_message(m) for m in messages]


def template_message(m: Message) -> Message:
    """One message of :func:`template_messages`."""
    calls = m.get("tool_calls") if m.get("role") == "assistant" else None
    if isinstance(calls, list) and calls:
        return {**m, "tool_calls": [_parsed_call(c) for c in calls]}
    return m


def _parsed_call(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    if not isinstance(args, str):
        return call
    try:
        parsed = json.loads(args)
    except ValueError:
        return call
    assert isinstance(fn, dict)  # args is a str, so it came from fn
    return {**call, "function": {**fn, "arguments": parsed}} if isinstance(parsed, dict) else call


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict.
    content: str | None = value.get("content") if isinstance(value, dict) else value  # JSON: its text
    return content


class HFChatTokenizer:
    """A Hugging Face ``tokenizer.json`` plus Jinja2 chat template, without ``transformers``.

    The directory must hold ``tokenizer.json`` and a chat template, either in
    ``tokenizer_config.json`` (``chat_template``, a string or a list of named templates where
    ``default`` wins), in ``chat_template.jinja`` or in ``chat_template.json`` (the processor's
    file, as Qwen2-VL models ship it). The end-of-turn token is
    ``tokenizer_config.json``'s ``eos_token``. Rendering follows ``transformers``: a sandboxed
    environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``
    and a ``tojson`` filter that keeps non-ASCII text; tool-call arguments reach the template as
    objects (:func:`template_messages`), as the engines pass them.
    """

    def __init__(self, path: str) -> None:
        try:
            import jinja2.sandbox
            from tokenizers import Tokenizer
        except ModuleNotFoundError as exc:
            raise TokenizerLoadError(f"a tokenizer directory needs the {exc.name!r} package: "
                                     f"pip install 'shinken[hf]'") from None

        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise TokenizerLoadError(f"{tok_file} not found")
        self._tok = Tokenizer.from_file(tok_file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Encodes field text: special tokens split into ordinary tokens, like transformers'
        # split_special_tokens; a second instance, so the flag never changes under a caller.
        self._text_tok = Tokenizer.from_file(tok_file)
        self._text_tok.encode_special_tokens = True
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._special_text = SpecialText([t.content for t in added.values() if t.special])
        self._require_special_text_split()
        self._escaped_messages = EscapedMessages(self._special_text, template_message)
        config: dict[str, Any] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        json_file = os.path.join(path, "chat_template.json")  # where Qwen2-VL / Qwen2.5-VL ship theirs
        if template is None and os.path.isfile(json_file):
            with open(json_file, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        if not template:
            raise TokenizerLoadError(f"no chat template in {path}")
        eos = _token_content(config.get("eos_token"))
        if eos is None or self._tok.token_to_id(eos) is None:
            raise TokenizerLoadError(f"eos_token {eos!r} of {path} is not in the vocabulary")
        self.name = os.path.basename(os.path.normpath(path))
        self.eos_token = eos
        eos_token_id = self._tok.token_to_id(eos)
        assert eos_token_id is not None  # checked above
        self.eos_token_id = eos_token_id
        self._special = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token",
                                                                    "unk_token")}
        self.vision = self._load_vision(path, config)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self._template = env.from_string(template)

    def _require_special_text_split(self) -> None:
        """Field text must never become a control token. tokenizers 0.15.0 accepts
        ``encode_special_tokens`` and ignores it, so the setting is checked by what it does: every
        special token's text, encoded as field text, gives none of the special ids."""
        for text in self._special_text.tokens:
            if self.special_token_ids.intersection(self._text_tok.encode(text, add_special_tokens=False).ids):
                import tokenizers

                raise TokenizerLoadError(
                    f"tokenizers {tokenizers.__version__} encodes the text {text!r} as the special token "
                    f"even with encode_special_tokens set: text in messages could forge control tokens; "
                    f"tokenizers >= 0.15.1 is needed")

    def _load_vision(self, path: str, config: dict[str, Any]) -> Vision | None:
        """Qwen2-VL's vision tokens when the vocabulary has them as special tokens (the pad's
        name from ``tokenizer_config.json``'s ``image_token`` if given), and the rule from
        ``preprocessor_config.json`` (its defaults without one); None for a text-only model."""
        names = (VISION_START, _token_content(config.get("image_token")) or IMAGE_PAD, VISION_END)
        ids = [self._tok.token_to_id(name) for name in names]
        if any(i is None or i not in self.special_token_ids for i in ids):
            return None
        start, pad, end = ids
        assert start is not None and pad is not None and end is not None  # checked just above
        rule = QwenVLRule()
        pre_file = os.path.join(path, "preprocessor_config.json")
        if os.path.isfile(pre_file):
            with open(pre_file, encoding="utf-8") as f:
                rule = QwenVLRule.from_preprocessor_config(json.load(f))
        return Vision(start, pad, end, rule)

    def encode(self, text: str) -> list[int]:
        if not self._special_text.has_escapes(text):  # nothing but template text: exactly as the model's
            whole: list[int] = self._tok.encode(text, add_special_tokens=False).ids  # Any without tokenizers
            return whole
        ids: list[int] = []
        for piece in self._special_text.split(text):
            if isinstance(piece, int):
                special_id = self._tok.token_to_id(self._special_text.tokens[piece])
                assert special_id is not None  # one of the vocabulary's added tokens (__init__)
                ids.append(special_id)
            else:
                ids.extend(self._text_tok.encode(piece, add_special_tokens=False).ids)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)  # Any without tokenizers
        return text

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> str:
        return self._template.render(
            messages=self._escaped_messages(messages),
            tools=self._special_text.escape(list(tools)) if tools else None,
            add_generation_prompt=add_generation_prompt, **self._special
        )


# A UTF-8 character is at most 4 bytes: a run of undecodable ids longer than this is garbage.
_MAX_PARTIAL_IDS = 4


def decode_lenient(tokenizer: ChatTokenizer, ids: Sequence[int]) -> str:
    """``tokenizer.decode(ids)``, except that ids which are only part of a character (a
    byte-level tokenizer's output cut mid-character, e.g. by ``max_tokens``) become U+FFFD
    instead of raising, as ``tokenizers``' byte-level decoder does for a text we only report."""
    try:
        return tokenizer.decode(ids)
    except UnicodeDecodeError:
        pass
    out: list[str] = []
    pending: list[int] = []

    def flush(at_least: int) -> None:
        # Decode what is pending; while it cannot be decoded and holds ``at_least`` ids, its
        # first id starts no character: replace it and retry with the rest.
        nonlocal pending
        while pending:
            try:
                out.append(tokenizer.decode(pending))
                pending = []
            except UnicodeDecodeError:
                if len(pending) < at_least:
                    return
                out.append("\ufffd")
                pending = pending[1:]

    for tid in ids:
        pending.append(tid)
        flush(_MAX_PARTIAL_IDS)
    flush(1)
    return "".join(out)


def load_tokenizer(path: str | None) -> ChatTokenizer:
    """``None`` -> the byte tokenizer; a directory -> ``HFChatTokenizer(path)``."""
    if path is None:
        return ByteChatTokenizer()
    if not os.path.isdir(path):
        raise TokenizerLoadError(f"tokenizer path {path!r} is not a directory")
    return HFChatTokenizer(path)
