"""A committed record as the session keeps it: miles' ``SessionRecord`` bytes as fields.

A record's bytes are the concatenation of its *fields* (:class:`RecordBody`), each one of:

- :class:`Text`: bytes kept as pieces (``webapp.filebody``): spans of the session journal, mostly
  spans of earlier turns' entries (a turn stores only the bytes its field does not share with
  the same field of the turn it builds on: ``webapp.journal``);
- :class:`Ids`: the JSON text of the session's first ``count`` token ids (``1,2,3``), which is
  where a record's ``request.input_ids`` is: generated from the token ids, never stored as text;
- :class:`Rows`: a replay payload (R3, the indexer top-k): its packed bytes in the journal,
  served as the base64 text the engine sent (``webapp.filebody.B64Span``).

A record written by the first journal format is one :class:`Text` field holding the whole
record; its replay payloads are base64 text spans inside it (``v1_replay``).

:class:`RecordParts` is the other side: a new turn's record as the core builds it (its head,
the engine request as recorded, the engine reply and where the replay payloads sit in it).
"""

from __future__ import annotations

import binascii
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from operator import add

from webapp.filebody import B64Span, FileSpan, Piece, read_pieces

__all__ = ["Ids", "IdsText", "RecordBody", "RecordParts", "Rows", "Text", "b64_length", "ids_json"]


def b64_length(n: int) -> int:
    """Length of the (padded) base64 text of ``n`` bytes."""
    return 4 * ((n + 2) // 3)


@dataclass(frozen=True)
class Text:
    pieces: tuple[Piece, ...]

    @property
    def length(self) -> int:
        return sum(len(p) for p in self.pieces)


@dataclass(frozen=True)
class Ids:
    count: int  # the session's first ``count`` token ids


@dataclass(frozen=True)
class Rows:
    key: str  # the replay key (``routed_experts``, ``indexer_topk``)
    pieces: tuple[FileSpan, ...]  # the packed bytes; every piece but the last a multiple of 3 long

    @property
    def length(self) -> int:
        return sum(p.length for p in self.pieces)

    @cached_property
    def b64_pieces(self) -> tuple[Piece, ...]:
        """The payload's base64 text as pieces; made once per record (a records GET serves every
        record again, and a long session's rows are one piece per turn that added some)."""
        # Each piece but the last is a whole number of base64 quanta: the texts concatenate.
        return tuple(B64Span(p.path, p.offset, p.length) for p in self.pieces if p.length)


Field = Text | Ids | Rows


@dataclass(frozen=True)
class RecordBody:
    fields: tuple[Field, ...]
    v1_replay: dict[str, tuple[int, int]] = field(default_factory=dict)  # first format: base64 spans

    def pieces(self, ids_text: Callable[[int], bytes | memoryview]) -> list[Piece]:
        """The record's bytes as pieces; ``ids_text(n)``: the text of the session's first ``n`` ids."""
        out: list[Piece] = []
        for f in self.fields:
            if isinstance(f, Text):
                out += f.pieces
            elif isinstance(f, Ids):
                out.append(ids_text(f.count))
            else:
                out += f.b64_pieces
        return out

    def replay_keys(self) -> tuple[str, ...]:
        return tuple(self.v1_replay) + tuple(f.key for f in self.fields if isinstance(f, Rows))

    def replay(self, key: str) -> bytes:
        """The replay payload's packed bytes (KeyError: the record has none)."""
        if key in self.v1_replay:
            (whole,) = (f for f in self.fields if isinstance(f, Text))
            start, end = self.v1_replay[key]
            return binascii.a2b_base64(read_pieces(whole.pieces)[start:end])
        for f in self.fields:
            if isinstance(f, Rows) and f.key == key:
                return read_pieces(f.pieces)
        raise KeyError(key)


@dataclass(frozen=True)
class RecordParts:
    """A new record: ``head + request + ',"response":' + response + '}'`` (each replay payload
    in ``response`` completed by ``replay_prefix``)."""

    head: bytes  # '{"timestamp":...,"request":'
    request: bytes  # the engine request as recorded
    response: bytes  # the engine reply as recorded
    replay_spans: Sequence[tuple[str, int, int]] = ()  # (key, start, end) of base64 text in ``response``
    # key -> packed bytes the payload in ``response`` leaves out: the base record's first ones
    # (an incremental request; the record holds the whole payload, as a full request's would).
    replay_prefix: dict[str, int] = field(default_factory=dict)


def ids_json(ids: Sequence[int]) -> bytes:
    """The JSON text of token ids between the brackets (``1,2,3``), at C speed."""
    return ",".join(map(str, ids)).encode()


class IdsText:
    """The JSON text of a token id sequence and where each prefix of it ends: the text of a
    record's prompt ids is a prefix of the session's accumulated ids (TITO only appends)."""

    def __init__(self, ids: Sequence[int]) -> None:
        strs = list(map(str, ids))
        self.text = ",".join(strs).encode()  # = ids_json(ids)
        # ends[n]: the length of the text of the first n ids (their digits and n - 1 commas),
        # summed by C iterators: a per-id generator cost a long session's first GET ~40 ms.
        self.ends = [0, *map(add, accumulate(map(len, strs)), range(len(strs)))]

    def prefix(self, n: int) -> memoryview:
        """The text of the first ``n`` ids: a view of :attr:`text`, not a copy (a records GET
        serves one per record: a copy each made a long session's GET copy the ids per record)."""
        return memoryview(self.text)[:self.ends[n]]
