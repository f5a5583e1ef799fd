"""Chat tokenizers: text <-> token ids plus the chat template that renders messages to text.

Two implementations share the ``ChatTokenizer`` protocol:

- ``ByteChatTokenizer``: the embedded default, no dependencies. One id per UTF-8 byte
  (0..255) plus three ChatML special tokens; exact and reversible
  (``decode(encode(s)) == s`` for every str).
- ``HFChatTokenizer``: a real model's ``tokenizer.json`` (via the ``tokenizers`` package) and
  its Jinja2 chat template, without importing ``transformers``.

``load_tokenizer(None)`` gives the byte tokenizer; ``load_tokenizer(path)`` the HF adapter.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "ByteChatTokenizer",
    "ChatTokenizer",
    "HFChatTokenizer",
    "TokenizerLoadError",
    "content_text",
    "decode_lenient",
    "load_tokenizer",
]

Message = dict[str, Any]

# Rendered in place of a non-text content part (an image) by the byte template, which has no
# vision tokens; a real model's template decides for itself.
IMAGE_PLACEHOLDER = "<|image|>"


class TokenizerLoadError(Exception):
    """The tokenizer directory is missing ``tokenizer.json`` or a usable chat template."""


class ChatTokenizer(Protocol):
    name: str
    eos_token: str  # the end-of-turn marker the model emits to finish an assistant turn
    eos_token_id: int
    special_token_ids: frozenset[int]  # ids of the special (added, ``special=True``) tokens

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> str: ...


def content_text(content: Any) -> str:
    """The text of an OpenAI ``content`` (str, None, or a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            pieces.append(str(part.get("text", "")))
        else:
            pieces.append(IMAGE_PLACEHOLDER)
    return "".join(pieces)


class ByteChatTokenizer:
    """Byte-level ids with a ChatML template.

    Template, per message: ``<|im_start|>{role}\\n{content}{tool calls}<|im_end|>\\n``; tool
    calls render as ``\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``; a
    ``tools`` list renders first as a ``system`` block ``# Tools`` with one JSON per line; the
    generation prompt is ``<|im_start|>assistant\\n``.
    """

    name = "byte-chatml"
    SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    eos_token = "<|im_end|>"

    def __init__(self) -> None:
        self._special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self._special_by_id = {i: tok for tok, i in self._special_ids.items()}
        self._special_re = re.compile("(" + "|".join(re.escape(t) for t in self.SPECIAL_TOKENS) + ")")
        self.eos_token_id = self._special_ids[self.eos_token]
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS)
        self.special_token_ids = frozenset(self._special_by_id)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, piece in enumerate(self._special_re.split(text)):
            if i % 2:
                ids.append(self._special_ids[piece])
            elif piece:
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


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFChatTokenizer:
    """A Hugging Face ``tokenizer.json`` plus Jinja2 chat template, without ``transformers``.

    The directory must hold ``tokenizer.json`` and a chat template, either in
    ``tokenizer_config.json`` (``chat_template``, a string or a list of named templates where
    ``default`` wins) or in ``chat_template.jinja``. The end-of-turn token is
    ``tokenizer_config.json``'s ``eos_token``. Rendering follows ``transformers``: a sandboxed
    environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``
    and a ``tojson`` filter that keeps non-ASCII text.
    """

    def __init__(self, path: str) -> None:
        import jinja2.sandbox
        from tokenizers import Tokenizer

        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise TokenizerLoadError(f"{tok_file} not found")
        self._tok = Tokenizer.from_file(tok_file)
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
        if not template:
            raise TokenizerLoadError(f"no chat template in {path}")
        eos = _token_content(config.get("eos_token"))
        if eos is None or self._tok.token_to_id(eos) is None:
            raise TokenizerLoadError(f"eos_token {eos!r} of {path} is not in the vocabulary")
        self.name = os.path.basename(os.path.normpath(path))
        self.eos_token = eos
        self.eos_token_id = self._tok.token_to_id(eos)
        self.special_token_ids = frozenset(
            i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special)
        self._special = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "pad_token",
                                                                    "unk_token")}

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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool, tools: Sequence[Any] | None = None
    ) -> str:
        return self._template.render(
            messages=list(messages), tools=list(tools) if tools else None,
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
