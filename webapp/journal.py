"""The session journal: every committed turn of a session, appended to the session's own file.

One file per session, ``<data_dir>/sessions/<session_id>.journal`` (``webapp.datadir``),
written only by the worker that owns the session's shard, only appended to, and read back
when a worker starts (after a crash, a hang, a channel teardown, a whole server restart, or
with a different ``--workers``: every worker loads the files whose ids hash to its shard, so
re-sharding is a start-up with another N and moves no file).

Format, version 2 (all integers little-endian; docs/session-server-ops.md *Sessions on disk*)::

    file    = header entry*
    header  = "SHKJ" u32:version                        8 bytes (version 1 files are read too;
                                                        3: a tree session's, see below)
    entry   = u64:length u8:kind u32:crc32 payload      crc32 of the kind byte + payload
    payload = CREATE: JSON {"session_id", "created_at" [, "mode": "v2"]}
              DELTA:  u32:meta_length meta-JSON [u32 ids] [f64 logprobs] field-bytes*
              IMAGE:  u32:meta_length meta-JSON image-file-bytes
              TURN:   u32:meta_length meta-JSON record  (version 1 only, never written)

A DELTA holds what its turn adds on the turn it builds on (the last, or for a rollback the one
before): the TITO state as a delta (``webapp.tito``; the new token ids as u32), the small
fields samples read (``webapp.samples.TurnRecord``; logprobs as f64 when all are floats) and
miles' ``SessionRecord`` as fields (``webapp.records``): text shared with the base record's same
field by prefix and suffix plus the new bytes between, the prompt ids (generated from the token
ids, never stored as text) and replay payloads as packed rows (the base record's first bytes
plus the new tokens' rows). A version 1 TURN's record is the whole record, served as it is.
A turn's new images are IMAGE entries just before its DELTA entry, written with it in one
``writev``; images not followed by their turn are an unfinished commit.

A tree session (miles' v2: version 3 and ``"mode": "v2"`` in its CREATE; a line's has no mode) stores
each node as a DELTA on its PARENT node (``"parent": seq | null`` and ``"response_id"`` in the
meta; never a rollback): the same linear storage, per node. Restore re-adds the nodes in file
order (their ``seq``) and the last one is the active node. A session keeps the mode it was
created with whatever the server's ``--session-mode`` (which only decides new sessions').

Write: the entries of a turn go out before the reply does (a large or fsync'ed append in a
thread, so the worker's other sessions go on meanwhile); on any error (a full disk, EFBIG,
EIO) the file is cut back to its last good length and :class:`InsufficientStorage` (507) is
raised, so neither the file nor the session in memory holds the turn. ``fsync`` (setting
``fsync``, off by default) makes each append durable before the reply: without it a process
crash loses nothing answered (the bytes are in the page cache), a machine crash may lose the
last seconds; with it every turn waits for the disk (docs/session-server-ops.md).

Read: every entry's length chain and checksum are verified, and no byte is deleted on a
checksum. Whatever cannot be served is *set aside* first, in a sidecar next to the journal
(``<id>.journal.damaged.<offset>``: the original bytes from ``offset`` on, 0600), then cut:

- a torn tail — a short header, a length past the end of the file, trailing images without
  their turn — is what a crash mid-append leaves (a warning names it);
- a damaged entry — complete, but its checksum fails (or its kind or meta cannot be read) —
  is not a torn tail: the session is served up to the last turn before it (later turns build
  on its state, so they cannot be replayed without it), the entry and everything after it go to
  the sidecar, an error names the session, the offset and how many verified entries were set
  aside with it;
- a damaged CREATE entry (the first one) with verified turns after it: the turns do not need
  it (the first turn builds on the empty state), so the entry is set aside and rewritten in
  place with the same length (``created_at`` = the first turn's request time), and the whole
  session is served;
- nothing of a session verifies: the whole file is renamed to its sidecar; only a file too
  short to hold a file header (a crash before it was written) is removed.

``JournalStore.set_aside`` counts the sidecars of the store's sessions (on disk at start plus
written since): ``/health`` reports it as ``journal_damage`` (docs/session-server-ops.md). A
file whose header is not ours (another format version) is left untouched and not served.

While the server runs, a records GET is sent from the page cache without re-reading it; the
journal is the server's alone (0600 in a 0700 directory), so any change comes from outside: a
GET first compares the file's size and mtime with what the last append left and, if they
differ, verifies every entry and answers :class:`JournalDamaged` (500) instead of serving
damaged bytes.

Budgets: a session's journal may not grow past ``max_session_bytes`` and the data directory's
journals past ``max_data_bytes`` (:class:`StorageBudget`, 507, nothing stored). The server-wide
session count (``max_sessions``) and byte total are kept in ``<data_dir>/usage`` under the
create lock, shared by every worker, instead of listing the directory per create; the data
directory's owner removes the file at start and the first user rebuilds it from the files.
Turns move the byte total only under a ``max_data_bytes`` budget (its only reader), so a turn
without one takes no lock; creates and deletes always move both counts.
"""

from __future__ import annotations

import binascii
import errno
import fcntl
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import numpy as np
import pybase64

from webapp import iovec
from webapp.datadir import USAGE_FILE, DataDirUnsafe, ensure_private_dir, open_private, sessions_dir
from webapp.filebody import FileSpan, Piece, read_pieces, slice_pieces
from webapp.offload import run_blocking
from webapp.records import Field, Ids, RecordBody, RecordParts, Rows, Text, b64_length, ids_json
from webapp.samples import TurnRecord
from webapp.session_errors import (
    InsufficientStorage,
    JournalDamaged,
    SessionError,
    SessionExists,
    StorageBudget,
)
from webapp.tito import INITIAL_STATE, TitoState
from webapp.tree import SessionTree, TreeNode

if TYPE_CHECKING:  # images imports nothing of the journal; the journal only names its type
    from webapp.images import SessionImage

__all__ = [
    "ENTRY_HEADER",
    "FILE_HEADER",
    "FORMAT_VERSION",
    "MAGIC",
    "READ_VERSIONS",
    "SIDECAR",
    "TREE_FORMAT_VERSION",
    "JournalStore",
    "Kind",
    "RestoredSession",
    "SessionJournal",
    "StoredImage",
    "Usage",
]

log = logging.getLogger(__name__)

MAGIC = b"SHKJ"
FORMAT_VERSION = 2  # what a new file's header says
# A tree session's file: format 2 whose DELTAs are stored on their parent node. Its own version so
# a server that does not know trees refuses the file (it would apply the nodes as one line).
TREE_FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)  # what is read (a version 1 file is served and continued with DELTA entries)
FILE_HEADER = struct.Struct("<4sI")  # magic, version
ENTRY_HEADER = struct.Struct("<QBI")  # payload length, kind, crc32(kind byte + payload)
META_LENGTH = struct.Struct("<I")
SUFFIX = ".journal"
SIDECAR = ".damaged."  # <id>.journal.damaged.<offset>: bytes set aside by recovery
_READ_CHUNK = 8 << 20  # checksum reads at start-up
_KNOWN_BYTES = 64 << 10  # per session: the last record's fields kept for the next delta (text, whole rows)
_IDS_TEXT_BYTES = 1 << 20  # per session: the last state's token ids as JSON text, kept for the next turn
_OFFLOAD_BYTES = 256 << 10  # appends this big (or fsync'ed) run in a thread under gevent (webapp.offload)
OPEN_JOURNALS = 256  # journal descriptors a process keeps open between appends (least recently used closed)


class _Process:
    """This process's id, kept up to date across ``os.fork`` (a ``getpid`` syscall per use was
    two of every turn's)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.pid = os.getpid()


_process = _Process()


class _OpenJournals:
    """Journal descriptors kept open between a session's appends, by path, per process, at most
    ``limit`` (the least recently used closed past it): opening the file per turn was an
    ``openat`` (a path walk), an ``fstat``, two ``fcntl`` and a ``close`` of every turn.

    A descriptor is *taken* for an append and *given* back after it, so one in use is never in
    the cache and never closed under its writer. Per process: a forked child finds the parent's
    descriptors in the cache and closes its copies (the parent's stay open) before it opens its
    own; a worker that dies takes its descriptors with it. A session's delete discards its
    descriptor before the file goes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pid = _process.pid
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _mine(self) -> None:
        if self._pid != _process.pid:  # a forked child: the inherited copies are not its to use
            fds, self._fds, self._pid = self._fds, OrderedDict(), _process.pid
            for fd in fds.values():
                os.close(fd)

    def take(self, path: str) -> int | None:
        with self._lock:
            self._mine()
            return self._fds.pop(path, None)

    def give(self, path: str, fd: int) -> None:
        closing = []
        with self._lock:
            self._mine()
            old = self._fds.pop(path, None)
            if old is not None and old != fd:
                closing.append(old)
            self._fds[path] = fd
            while len(self._fds) > self.limit:
                closing.append(self._fds.popitem(last=False)[1])
        for old_fd in closing:
            os.close(old_fd)

    def discard(self, path: str) -> None:
        fd = self.take(path)
        if fd is not None:
            os.close(fd)

    def discard_under(self, directory: str) -> None:
        """Close the kept descriptors of every journal in ``directory`` (a store closed)."""
        prefix = os.path.join(directory, "")
        with self._lock:
            self._mine()
            gone = [path for path in self._fds if path.startswith(prefix)]
            fds = [self._fds.pop(path) for path in gone]
        for fd in fds:
            os.close(fd)

    def __len__(self) -> int:
        with self._lock:
            self._mine()
            return len(self._fds)


_open_journals = _OpenJournals(OPEN_JOURNALS)


class Kind(IntEnum):
    CREATE = 1
    TURN = 2  # version 1: meta + the whole record (read, never written)
    IMAGE = 3
    DELTA = 4  # version 2: meta + what the turn adds (see the module doc)


@dataclass(frozen=True)
class StoredImage:
    """An image as the session keeps it once committed: its facts in memory, its bytes in the
    journal (read for ``?images=1`` and samples; the same fields as ``DecodedImage``)."""

    sha256: str
    mime_type: str
    width: int
    height: int
    span: FileSpan

    @property
    def data(self) -> bytes:
        return self.span.read()

    @property
    def ref(self) -> str:
        from webapp.images import IMAGE_REF_PREFIX

        return IMAGE_REF_PREFIX + self.sha256


@dataclass
class RestoredSession:
    """A session as its journal leaves it; ``webapp.core`` turns it into a live ``Session``."""

    session_id: str
    created_at: float
    journal: SessionJournal
    state: TitoState = INITIAL_STATE
    previous: TitoState | None = None
    records: list[TurnRecord] = field(default_factory=list)
    rollbacks: int = 0
    images: dict[str, StoredImage] = field(default_factory=dict)
    damaged_create: tuple[int, int] | None = None  # a damaged CREATE entry's bytes, to be rewritten
    # A tree session (miles' v2; its CREATE says ``"mode": "v2"``): the forest and its active
    # node (the last committed); ``state``/``records`` are then the active path's.
    tree: SessionTree | None = None
    active: TreeNode | None = None


# -- the turn meta: a state delta plus the TurnRecord fields -------------------------------------

def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    if len(b) >= len(a) and b[:len(a)] == a:
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _delta(base: Sequence[Any], new: Sequence[Any]) -> list[Any]:
    k = _common_prefix(base, new)
    return [k, list(new[k:])]


def _text_delta(base: str, new: str) -> list[Any]:
    k = len(base) if new.startswith(base) else 0
    return [k, new[k:]]


def _apply(base: Sequence[Any], delta: list[Any]) -> tuple[Any, ...]:
    k, suffix = delta
    if not (type(k) is int and 0 <= k <= len(base)) or not isinstance(suffix, list):
        raise ValueError(f"bad delta prefix {k!r} on {len(base)} items")
    return (*base[:k], *suffix)


def decode_turn_meta(meta: dict[str, Any], base: TitoState, record: FileSpan) -> tuple[TitoState, TurnRecord]:
    """A version 1 TURN entry: the state delta (JSON) and the whole record in ``record``."""
    k, text = meta["rendered_prompt"]
    if not (type(k) is int and 0 <= k <= len(base.rendered_prompt)) or not isinstance(text, str):
        raise ValueError("bad rendered_prompt delta")
    state = TitoState(messages=_apply(base.messages, meta["messages"]), tools_key=meta["tools_key"],
                      token_ids=_apply(base.token_ids, meta["token_ids"]),
                      rendered_prompt=base.rendered_prompt[:k] + text, output_ended_with_eos=bool(meta["eos"]))
    prompt_len = meta["prompt_len"]
    v1_replay = {k: (s, e) for k, (s, e) in meta["replay"].items()}
    turn = TurnRecord(prompt_len=prompt_len, output_ids=state.token_ids[prompt_len:],
                      logprobs=tuple(meta["logprobs"]), finish_reason=meta["finish_reason"], meta=meta["meta"],
                      timestamp=meta["timestamp"], request_timestamp=meta["request_timestamp"],
                      record=RecordBody((Text((record,)),), v1_replay), replay=tuple(v1_replay),
                      images=tuple(meta["images"]))
    return state, turn


# -- version 2: a turn's entry holds what it adds --------------------------------------------------

_INPUT_IDS = b'"input_ids":['
_U32 = np.dtype("<u4")
_F64 = np.dtype("<f8")


def _lcp(a: bytes | memoryview, b: bytes | memoryview) -> int:
    """Length of the common prefix of ``a`` and ``b`` (memcmp-sized steps, not a byte loop)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _lcs(a: bytes | memoryview, b: bytes | memoryview, limit: int) -> int:
    """Length of the common suffix of ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n == 0 or a[len(a) - n:] == b[len(b) - n:]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[len(a) - mid:len(a) - lo] == b[len(b) - mid:len(b) - lo]:
            lo = mid
        else:
            hi = mid
    return lo


def _canonical_b64(text: bytes) -> bytes | None:
    """The packed bytes of ``text`` if encoding them gives ``text`` back exactly; else None
    (the payload is then kept as text). Checked by re-encoding: base64 has other texts for
    the same bytes (newlines, non-zero padding bits) that must not be normalized away."""
    try:
        packed = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    if b64_length(len(packed)) != len(text) or pybase64.b64encode(packed) != text:
        return None
    return packed


@dataclass(frozen=True)
class _Incremental:
    """Replay rows an engine sent after the first ``prefix`` packed bytes of ``held`` (the base
    record's same payload): the record's rows are ``held[:prefix] + new``, never joined here."""

    held: Rows
    prefix: int
    new: bytes


# ("t", None, text) | ("i", None, b"") | ("r", key, packed or _Incremental)
_Raw = tuple[str, str | None, "bytes | _Incremental"]


def _split_record(parts: RecordParts, prompt_ids: Sequence[int], base: RecordBody | None,
                  ids_text: bytes | None = None) -> list[_Raw]:
    """The record's fields: its head, the request around the prompt ids (generated on read),
    the rest of the text around the replay payloads (kept packed; an incremental payload
    after the base record's first ``parts.replay_prefix[key]`` bytes of it). ``ids_text``:
    ``ids_json(prompt_ids)`` if the caller has it."""
    fields: list[_Raw] = [("t", None, parts.head)]
    req = parts.request
    ids = ids_json(prompt_ids) if ids_text is None else ids_text
    at = req.rfind(_INPUT_IDS + ids + b"]")
    if at >= 0:
        cut = at + len(_INPUT_IDS)
        fields += [("t", None, req[:cut]), ("i", None, b"")]
        rest = [req[cut + len(ids):]]
    else:
        rest = [req]
    rest.append(b',"response":')
    resp, pos = parts.response, 0
    for key, start, end in sorted(parts.replay_spans, key=lambda span: span[1]):
        if start < pos or any(f[1] == key for f in fields):
            continue
        packed = _canonical_b64(resp[start:end])
        if packed is None:
            continue
        rows: bytes | _Incremental = packed
        prefix = parts.replay_prefix.get(key, 0)
        if prefix:
            held = next((f for f in base.fields if isinstance(f, Rows) and f.key == key), None) if base else None
            if held is None or held.length < prefix:
                raise ValueError(f"an incremental {key} payload on a base record without {prefix} bytes of it")
            rows = _Incremental(held, prefix, packed)
        rest.append(resp[pos:start])
        fields += [("t", None, b"".join(rest)), ("r", key, rows)]
        rest, pos = [], end
    rest += (resp[pos:], b"}")
    fields.append(("t", None, b"".join(rest)))
    return fields


def _base_field(base: RecordBody | None, i: int, kind: str, key: str | None) -> Text | Rows | None:
    if base is None or i >= len(base.fields) or base.v1_replay:
        return None  # a version 1 record shares nothing (the turn after it stores its fields whole)
    f = base.fields[i]
    if kind == "t" and isinstance(f, Text):
        return f
    if kind == "r" and isinstance(f, Rows) and f.key == key:
        return f
    return None


def _encode_fields(raw: list[_Raw], base: RecordBody | None, known: Mapping[int, bytes] | None = None,
                   fds: Mapping[str, int] | None = None) -> tuple[list[Any], list[bytes]]:
    """Each field as (meta, new bytes): text as [``t``, prefix, suffix, n] shared with the base
    record's same field, replay rows as [``r``, key, prefix, n] (prefix a multiple of 3).
    ``known``: the base record's fields by index (text, rows sent whole), as the journal wrote
    them last (not read back from the file). ``fds``: the journal's open descriptor (see ``read_pieces``)."""
    metas: list[Any] = []
    bodies: list[bytes] = []
    for i, (kind, key, data) in enumerate(raw):
        if kind == "i":
            metas.append(["i"])
            continue
        old = _base_field(base, i, kind, key)
        if isinstance(data, _Incremental):
            if old is data.held:  # shared up to the prefix by construction: read only the base's rest
                metas_body = _encode_incremental(data, fds)
                metas.append(["r", key, *metas_body[0]])
                bodies.append(metas_body[1])
                continue
            data = read_pieces(slice_pieces(data.held.pieces, 0, data.prefix), fds) + data.new
        if old is None:
            old_bytes = b""
        elif known is not None and i in known:
            old_bytes = known[i]
        else:
            old_bytes = read_pieces(old.pieces, fds)
        p = _lcp(old_bytes, data)
        if kind == "t":
            s = _lcs(old_bytes, data, min(len(old_bytes), len(data)) - p)
            middle = data[p:len(data) - s]
            metas.append(["t", p, s, len(middle)])
        else:
            p -= p % 3  # the shared part and the new one each a whole number of base64 quanta
            middle = data[p:]
            metas.append(["r", key, p, len(middle)])
        bodies.append(middle)
    return metas, bodies


def _encode_incremental(data: _Incremental, fds: Mapping[str, int] | None = None) -> tuple[tuple[int, int], bytes]:
    """(prefix kept, new length) and the new bytes of incremental rows: what comparing the whole
    base payload with ``held[:prefix] + new`` gives, reading only the base's bytes after the
    last whole base64 quantum of the prefix (its first ``prefix`` bytes are the same by
    construction), never the whole payload (the longest field of a long session)."""
    start = data.prefix - data.prefix % 3
    tail = read_pieces(slice_pieces(data.held.pieces, start, data.held.length), fds)
    ours = tail[:data.prefix - start] + data.new
    p = _lcp(tail, ours)
    p -= p % 3  # the shared part and the new one each a whole number of base64 quanta
    middle = ours[p:]
    return (start + p, len(middle)), middle


def _decode_fields(metas: Any, base: RecordBody | None, path: str, at: int, end: int,
                   prompt_len: int) -> tuple[RecordBody, int]:
    """The record body of a DELTA entry whose field bytes start at ``at``; (body, bytes used)."""
    fields: list[Field] = []
    pos = at
    if not isinstance(metas, list):
        raise TypeError("fields is not a list")
    for i, m in enumerate(metas):
        if m == ["i"]:
            fields.append(Ids(prompt_len))
            continue
        if not (isinstance(m, list) and len(m) == 4 and m[0] in ("t", "r")):
            raise ValueError(f"bad field {m!r}")
        kind = m[0]
        key = m[1] if kind == "r" else None
        p, s, n = (m[1], m[2], m[3]) if kind == "t" else (m[2], 0, m[3])
        if not (type(p) is int and type(s) is int and type(n) is int and p >= 0 and s >= 0 and n >= 0) or (
                kind == "r" and not isinstance(key, str)):
            raise ValueError(f"bad field {m!r}")
        old = _base_field(base, i, kind, key)
        old_len = old.length if old is not None else 0
        if p + s > old_len or pos + n > end:
            raise ValueError(f"field {i} reaches past its base or its entry")
        old_pieces = old.pieces if old is not None else ()
        # The common shapes without slicing: a field that only grows (all of the base, then the
        # new bytes) or is new; pieces are never empty.
        pieces = list(old_pieces) if p == old_len else slice_pieces(old_pieces, 0, p) if p else []
        if n:
            pieces.append(FileSpan(path, pos, n))
        if s:
            pieces += _last_bytes(old_pieces, s)
        pos += n
        if kind == "t":
            fields.append(Text(tuple(pieces)))
        else:
            assert key is not None
            fields.append(Rows(key, tuple(q for q in pieces if isinstance(q, FileSpan))))
    return RecordBody(tuple(fields)), pos - at


def _last_bytes(pieces: Sequence[Piece], count: int) -> list[Piece]:
    """The last ``count`` bytes of ``pieces`` (at most their length), sliced from only the
    pieces that hold them: a field shares a short suffix with its base, whose pieces are one
    per turn that changed it, and a slice from the start walked them all."""
    i, size = len(pieces), 0
    while size < count and i:
        i -= 1
        size += len(pieces[i])
    return slice_pieces(pieces[i:], max(size - count, 0), size)


def _id_delta(base: Sequence[int], new: Sequence[int]) -> tuple[int, bytes | None, list[int]]:
    """(prefix kept, the new ids as u32 (None: not all fit), the new ids)."""
    k = _common_prefix(base, new)
    tail = list(new[k:])
    try:
        return k, np.asarray(tail, dtype=_U32).tobytes() if tail else b"", tail
    except (OverflowError, ValueError, TypeError):
        return k, None, tail


def encode_delta(base: TitoState, state: TitoState, rollback: bool, turn: TurnRecord, parts: RecordParts,
                 base_record: RecordBody | None, node: dict[str, Any] | None = None,
                 known: Mapping[int, bytes] | None = None, fds: Mapping[str, int] | None = None,
                 ids_text: bytes | None = None) -> tuple[list[bytes], dict[str, Any], list[_Raw]]:
    """A DELTA entry's payload (meta length, meta, sections), its meta as a value and the
    record's fields as split. ``node``: a tree node's ``{"parent": seq | None, "response_id"}``
    (``base`` is then the parent's). ``known``, ``fds``: see :func:`_encode_fields`;
    ``ids_text``: the prompt ids' JSON text, see :func:`_split_record`."""
    assert tuple(state.token_ids[turn.prompt_len:]) == turn.output_ids, "token ids = prompt ids + output ids"
    k, packed_ids, tail = _id_delta(base.token_ids, state.token_ids)
    sections: list[bytes] = []
    if packed_ids is not None:
        sections.append(packed_ids)
        ids_meta: list[Any] = [k, len(tail)]
    else:
        ids_meta = [k, tail]
    if all(type(lp) is float for lp in turn.logprobs):
        sections.append(np.asarray(turn.logprobs, dtype=_F64).tobytes())
        lp_meta: Any = len(turn.logprobs)
    else:  # None or int logprobs: kept as the engine gave them
        lp_meta = list(turn.logprobs)
    raw = _split_record(parts, state.token_ids[:turn.prompt_len], base_record, ids_text)
    field_metas, bodies = _encode_fields(raw, base_record, known, fds)
    meta = {
        "rollback": rollback,
        "messages": _delta(base.messages, state.messages),
        "ids": ids_meta,
        "rendered_prompt": _text_delta(base.rendered_prompt, state.rendered_prompt),
        "tools_key": state.tools_key,
        "eos": state.output_ended_with_eos,
        "prompt_len": turn.prompt_len,
        "logprobs": lp_meta,
        "finish_reason": turn.finish_reason,
        "meta": turn.meta,
        "timestamp": turn.timestamp,
        "request_timestamp": turn.request_timestamp,
        "images": list(turn.images),
        "fields": field_metas,
        **(node or {}),
    }
    encoded = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
    return [META_LENGTH.pack(len(encoded)), encoded, *sections, *bodies], meta, raw


def decode_delta(meta: dict[str, Any], base: TitoState, base_record: RecordBody | None, fd: int, path: str,
                 at: int, end: int) -> tuple[TitoState, TurnRecord]:
    """A DELTA entry whose sections start at ``at`` (``end``: the entry's end)."""
    k, ids = meta["ids"]
    if not (type(k) is int and 0 <= k <= len(base.token_ids)):
        raise ValueError(f"bad ids prefix {k!r}")
    pos = at
    if isinstance(ids, int):
        raw = os.pread(fd, 4 * ids, pos)
        if len(raw) != 4 * ids or pos + 4 * ids > end:
            raise ValueError("ids past the entry")
        ids, pos = np.frombuffer(raw, dtype=_U32).tolist(), pos + 4 * ids
    lp = meta["logprobs"]
    if isinstance(lp, int):
        raw = os.pread(fd, 8 * lp, pos)
        if len(raw) != 8 * lp or pos + 8 * lp > end:
            raise ValueError("logprobs past the entry")
        lp, pos = np.frombuffer(raw, dtype=_F64).tolist(), pos + 8 * lp
    t, text = meta["rendered_prompt"]
    if not (type(t) is int and 0 <= t <= len(base.rendered_prompt)) or not isinstance(text, str):
        raise ValueError("bad rendered_prompt delta")
    state = TitoState(messages=_apply(base.messages, meta["messages"]), tools_key=meta["tools_key"],
                      token_ids=(*base.token_ids[:k], *ids), rendered_prompt=base.rendered_prompt[:t] + text,
                      output_ended_with_eos=bool(meta["eos"]))
    prompt_len = meta["prompt_len"]
    if not (type(prompt_len) is int and 0 <= prompt_len <= len(state.token_ids)):
        raise ValueError(f"bad prompt_len {prompt_len!r}")
    body, used = _decode_fields(meta["fields"], base_record, path, pos, end, prompt_len)
    if pos + used != end:
        raise ValueError(f"the entry holds {end - pos - used} bytes its fields do not name")
    turn = TurnRecord(prompt_len=prompt_len, output_ids=state.token_ids[prompt_len:], logprobs=tuple(lp),
                      finish_reason=meta["finish_reason"], meta=meta["meta"], timestamp=meta["timestamp"],
                      request_timestamp=meta["request_timestamp"], record=body, replay=body.replay_keys(),
                      images=tuple(meta["images"]))
    return state, turn


# -- writing ---------------------------------------------------------------------------------------

def _sections(meta: dict[str, Any]) -> int:
    """How many binary sections (ids, logprobs) precede a DELTA entry's field bytes."""
    return int(isinstance(meta["ids"][1], int)) + int(isinstance(meta["logprobs"], int))


def _entry(kind: Kind, payload: Sequence[bytes]) -> list[bytes]:
    crc = zlib.crc32(bytes((kind,)))
    for chunk in payload:
        crc = zlib.crc32(chunk, crc)
    return [ENTRY_HEADER.pack(sum(len(c) for c in payload), kind, crc), *payload]


def _meta_payload(meta: bytes, *body: bytes) -> list[bytes]:
    return [META_LENGTH.pack(len(meta)), meta, *body]


class SessionJournal:
    """One session's file. Appends are serialized by the caller (the session's state lock)."""

    def __init__(self, path: str, size: int, fsync: bool, last_crc: int = 0, *,
                 usage: Usage | None = None, max_bytes: int | None = None) -> None:
        self.path = path
        self.size = size  # the last good length: everything before it is committed
        self.fsync = fsync
        # The last good entry's checksum: with ``size``, names this version of the session
        # (after a torn tail is cut and another turn written, the size alone may repeat).
        self.last_crc = last_crc
        self.usage = usage  # the data directory's shared byte total (None: not counted)
        self.max_bytes = max_bytes  # max_session_bytes (None: no cap)
        self.mtime_ns = 0  # the file's mtime after our last write: another writer changes it
        # The last committed record and its text fields' bytes (at most _KNOWN_BYTES): the next
        # turn's delta is taken against them without reading them back from the file.
        self._known: tuple[RecordBody, dict[int, bytes]] | None = None
        # The last committed state's token ids and their JSON text (at most _IDS_TEXT_BYTES): the
        # next turn's prompt ids extend them, so only the new ids are turned into text.
        self._ids: tuple[Sequence[int], bytes] | None = None

    @property
    def version(self) -> str:
        return f"{self.size:x}-{self.last_crc:08x}"

    def append_turn(self, base: TitoState, state: TitoState, rollback: bool, turn: TurnRecord,
                    parts: RecordParts, base_record: RecordBody | None = None,
                    images: Sequence[SessionImage] = (),
                    node: dict[str, Any] | None = None,
                    prompt_text: bytes | None = None) -> tuple[TurnRecord, dict[str, StoredImage]]:
        """Append a turn (and its new images) as a DELTA entry on ``base_record`` (the record
        whose state is ``base``; None: the first turn); returns the turn and images as the
        session keeps them (pointing into the file). ``node``: a tree node's parent and
        response id (``base``/``base_record``: the parent's; see :func:`encode_delta`).
        ``prompt_text``: :meth:`prompt_ids_text` of the turn's prompt ids when the caller made
        it already (for the engine request), so the turn's new ids are turned into text once.
        Raises :class:`InsufficientStorage`: nothing written."""
        entries: list[list[bytes]] = []
        for image in images:
            facts = json.dumps({"sha256": image.sha256, "mime_type": image.mime_type, "width": image.width,
                                "height": image.height}, separators=(",", ":")).encode()
            entries.append(_entry(Kind.IMAGE, _meta_payload(facts, image.data)))
        known = self._known[1] if self._known is not None and self._known[0] is base_record else None
        if prompt_text is None:
            prompt_text = self._ids_text(state.token_ids[:turn.prompt_len])
        fd = self._take_fd()
        try:
            payload, meta, raw = encode_delta(base, state, rollback, turn, parts, base_record, node, known,
                                              {self.path: fd}, prompt_text)
            entries.append(_entry(Kind.DELTA, payload))
            starts = self._append(entries, fd)
        except BaseException:
            try:
                gone = not os.fstat(fd).st_nlink
            except OSError:
                gone = True
            if gone:  # deleted from outside: a later turn opens the path (and fails) again
                os.close(fd)
            else:
                _open_journals.give(self.path, fd)
            raise
        _open_journals.give(self.path, fd)
        stored = {}
        for image, entry, start in zip(images, entries, starts):
            data_at = start + ENTRY_HEADER.size + META_LENGTH.size + len(entry[2])
            stored[image.sha256] = StoredImage(image.sha256, image.mime_type, image.width, image.height,
                                               FileSpan(self.path, data_at, len(image.data)))
        at = starts[-1] + ENTRY_HEADER.size + META_LENGTH.size + len(payload[1])
        end = starts[-1] + ENTRY_HEADER.size + sum(len(c) for c in payload)
        body_at = at + sum(len(c) for c in payload[2:2 + _sections(meta)])
        body, _used = _decode_fields(meta["fields"], base_record, self.path, body_at, end, turn.prompt_len)
        # Text fields, then replay rows the engine sent whole while they fit (incremental ones
        # read only a tail of the base's).
        texts = {i: data for i, (kind, _key, data) in enumerate(raw) if kind == "t" and isinstance(data, bytes)}
        room = _KNOWN_BYTES - sum(map(len, texts.values()))
        for i, (kind, _key, data) in enumerate(raw):
            if kind == "r" and isinstance(data, bytes) and len(data) <= room:
                texts[i] = data
                room -= len(data)
        self._known = (body, texts) if room >= 0 else None
        output = ids_json(turn.output_ids)
        text = prompt_text + b"," + output if prompt_text and output else prompt_text or output
        self._ids = (state.token_ids, text) if len(text) <= _IDS_TEXT_BYTES else None
        return replace(turn, record=body, replay=body.replay_keys()), stored

    def prompt_ids_text(self, ids: Sequence[int]) -> bytes:
        """``ids_json(ids)`` of a turn's prompt ids (cheap: see :meth:`_ids_text`); the engine
        request is built around it, as the record is. (The state's ids are a tuple: a list of
        the same ids would never compare equal to them.)"""
        return self._ids_text(ids if isinstance(ids, tuple) else tuple(ids))

    def _ids_text(self, ids: Sequence[int]) -> bytes:
        """``ids_json(ids)``, from the last state's text when ``ids`` extend its ids (TITO appends)."""
        if self._ids is not None:
            held, text = self._ids
            n = len(held)
            if n <= len(ids) and ids[:n] == held:
                if n == len(ids):
                    return text
                tail = ids_json(ids[n:])
                return text + b"," + tail if n else tail
        return ids_json(ids)

    def _take_fd(self, what: str = "the turn") -> int:
        """The journal's descriptor (read/write) for an append: the one kept open since the last
        append (``_OpenJournals``), or opened now; give it back with ``_open_journals.give``."""
        fd = _open_journals.take(self.path)
        if fd is not None:
            return fd
        try:
            return open_private(self.path, os.O_RDWR)
        except FileNotFoundError:
            raise InsufficientStorage(f"journal {self.path} is gone; {what} was not stored") from None
        except (DataDirUnsafe, OSError) as exc:
            raise InsufficientStorage(f"{what} was not stored: cannot open the session journal: {exc}") from exc

    def _append(self, entries: list[list[bytes]], fd: int, what: str = "the turn") -> list[int]:
        """Write the entries in one go at the end of the file open as ``fd``; returns each
        entry's offset. Raises :class:`InsufficientStorage` (naming ``what`` was not stored),
        the file cut back, and :class:`StorageBudget` (nothing written) past a byte budget."""
        starts, pos = [], self.size
        for entry in entries:
            starts.append(pos)
            pos += sum(len(c) for c in entry)
        grow = pos - self.size
        if self.max_bytes is not None and pos > self.max_bytes:
            raise StorageBudget("max_session_bytes", self.max_bytes, pos, f"{what} (the session's journal)")
        chunks = [c for entry in entries for c in entry]
        # The shared byte total serves only the data budget: without one a turn takes no lock.
        usage = self.usage if self.usage is not None and self.usage.max_bytes is not None else None
        if usage is not None:
            usage.add(0, grow, what)  # StorageBudget past max_data_bytes: nothing written
        try:
            if self.fsync or grow >= _OFFLOAD_BYTES:  # the hub goes on meanwhile
                run_blocking("journal", self._write, fd, chunks)
            else:
                self._write(fd, chunks)
            st = os.fstat(fd)
            if not st.st_nlink:  # the file was deleted from outside since it was opened
                raise FileNotFoundError(errno.ENOENT, "the session journal is gone", self.path)
        except BaseException as exc:
            # Failed, or interrupted (the greenlet killed, a gevent.Timeout) with the write done
            # or never made (run_blocking waits its thread out): the turn is not committed, so its
            # bytes go too; the next append, written at the committed end, would leave a tail.
            if usage is not None:
                usage.add(0, -grow)
            if isinstance(exc, FileNotFoundError):
                raise InsufficientStorage(f"journal {self.path} is gone; {what} was not stored") from None
            try:
                os.ftruncate(fd, self.size)
            except OSError:
                log.exception("cannot cut %s back to %d bytes after a failed append", self.path, self.size)
            if isinstance(exc, OSError):
                raise InsufficientStorage(f"{what} was not stored: writing the session journal failed: "
                                          f"{exc.strerror or exc}") from exc
            raise
        self.mtime_ns = st.st_mtime_ns
        self.size = pos
        self.last_crc = ENTRY_HEADER.unpack(entries[-1][0])[2]
        return starts

    def _write(self, fd: int, chunks: list[bytes]) -> None:
        _write_at(fd, chunks, self.size)
        if self.fsync:
            os.fsync(fd)

    def check_unchanged(self) -> None:
        """Raise :class:`JournalDamaged` if the file no longer holds what this server wrote.
        One ``stat`` when size and mtime are as the last write left them; else every entry up
        to the committed length is verified (a mere touch passes and is remembered)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return  # deleted meanwhile: the caller answers 404 when it opens the file
        if st.st_size == self.size and st.st_mtime_ns == self.mtime_ns:
            return
        problem = f"its size is {st.st_size}, {self.size} bytes were written" if st.st_size < self.size else None
        if problem is None:
            fd = open_private(self.path, os.O_RDONLY)
            with os.fdopen(fd, "rb", buffering=0) as f:
                scan = _Scan(f, lambda: None, end=self.size)
                for _entry_ in scan:
                    pass
                if scan.problem is not None:
                    problem = f"{scan.problem} at byte {scan.bad_at}"
        if problem is not None:
            log.error("journal %s changed while the server runs (%s): its records are not served; a restart "
                      "keeps what verifies and sets the rest aside", self.path, problem)
            raise JournalDamaged(f"the session's journal is damaged ({problem}); its records are not served")
        self.mtime_ns = st.st_mtime_ns


def _write_at(fd: int, chunks: list[bytes], offset: int) -> None:
    """``pwritev`` every chunk at ``offset`` (the last good length: a previous failed append's
    leftovers, if its truncate failed too, are overwritten), partial writes resumed."""
    buffers, first = iovec.views(chunks), 0
    while first < len(buffers):
        written = os.pwritev(fd, buffers[first:first + iovec.IOV_MAX], offset)
        if written == 0:
            raise OSError(errno.ENOSPC, "no space left on device")
        offset += written
        first = iovec.advance(buffers, first, written)


# -- the store --------------------------------------------------------------------------------------

class Usage:
    """The sessions and journal bytes of a whole data directory, shared by every process of the
    server: two little-endian i64 in ``<data_dir>/usage``, read and written under the create
    lock (``flock``: a few syscalls, instead of listing the directory per create). A missing or
    short file is rebuilt from the journals; counts a crash left off are right again at the next
    server start (the directory's owner removes the file, ``webapp.datadir.lock_data_dir``)."""

    RECORD = struct.Struct("<qq")

    def __init__(self, data_dir: str, journals_dir: str, max_bytes: int | None = None) -> None:
        self.path = os.path.join(data_dir, USAGE_FILE)
        self.lock_path = os.path.join(data_dir, "create.lock")
        self.journals_dir = journals_dir
        self.max_bytes = max_bytes  # max_data_bytes (None: no budget)
        # (pid, lock fd, usage fd), opened at the first add and kept: every turn moves the counts,
        # and opening both files each time was ten syscalls of a turn. Per process: a forked
        # child sharing the parent's descriptions would share its flock, so it opens its own.
        # The files stay put while the server runs (only the owner removes usage, at its start).
        self._fds: tuple[int, int, int] | None = None

    def _open(self, what: str) -> tuple[int, int]:
        if self._fds is not None and self._fds[0] == _process.pid:
            return self._fds[1], self._fds[2]
        try:
            lock = open_private(self.lock_path, os.O_RDWR | os.O_CREAT)
        except (DataDirUnsafe, OSError) as exc:
            raise InsufficientStorage(f"{what} was not stored: {exc}") from exc
        try:
            fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
        except (DataDirUnsafe, OSError) as exc:
            os.close(lock)
            raise InsufficientStorage(f"{what} was not stored: {exc}") from exc
        self._fds = (_process.pid, lock, fd)
        return lock, fd

    def close(self) -> None:
        """Close the kept descriptors (this process's); the next :meth:`add` opens them again."""
        fds, self._fds = self._fds, None
        if fds is not None and fds[0] == _process.pid:
            os.close(fds[1])
            os.close(fds[2])

    def add(self, sessions: int, nbytes: int, what: str = "the turn",
            admit: Callable[[int], None] | None = None, then: Callable[[], Any] | None = None) -> Any:
        """Under the lock: ``admit(sessions now)`` may refuse (raise); a growth past
        ``max_bytes`` raises :class:`StorageBudget`; then ``then()`` (its result returned) and,
        unless it raised, the counts are moved by ``sessions`` and ``nbytes``."""
        lock, fd = self._open(what)
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            raw = os.pread(fd, self.RECORD.size, 0)
            count, total = self.RECORD.unpack(raw) if len(raw) == self.RECORD.size else self._scan()
            if admit is not None:
                admit(count)
            if nbytes > 0 and self.max_bytes is not None and total + nbytes > self.max_bytes:
                raise StorageBudget("max_data_bytes", self.max_bytes, total + nbytes,
                                    f"{what} (the server's journals)")
            result = then() if then is not None else (count, total)
            os.pwrite(fd, self.RECORD.pack(max(0, count + sessions), max(0, total + nbytes)), 0)
            return result
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

    def _scan(self) -> tuple[int, int]:
        count = total = 0
        with os.scandir(self.journals_dir) as it:
            for e in it:
                if e.name.endswith(SUFFIX):
                    try:
                        total += e.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue
                    count += 1
        return count, total

    def read(self) -> tuple[int, int]:
        """(sessions, bytes) now."""
        counts: tuple[int, int] = self.add(0, 0)
        return counts


class JournalStore:
    """The journals of one data directory (``webapp.datadir``)."""

    def __init__(self, data_dir: str, *, fsync: bool = False, max_session_bytes: int | None = None,
                 max_data_bytes: int | None = None) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.dir = sessions_dir(self.data_dir)
        self.fsync = fsync
        self.max_session_bytes = max_session_bytes
        ensure_private_dir(self.data_dir, tighten=False)
        ensure_private_dir(self.dir)
        self.usage = Usage(self.data_dir, self.dir, max_data_bytes)
        self.set_aside = 0  # sidecars of this store's sessions: found at restore + written since

    def path(self, session_id: str) -> str:
        return os.path.join(self.dir, session_id + SUFFIX)

    def close(self) -> None:
        """Close what the store keeps open in this process (the usage files, the journals' kept
        descriptors); the next append or count opens them again."""
        self.usage.close()
        _open_journals.discard_under(self.dir)

    def count(self) -> int:
        """Sessions on disk, every shard's (the ``max_sessions`` count of the whole server)."""
        return self.usage.read()[0]

    def _journal(self, path: str, size: int, last_crc: int = 0) -> SessionJournal:
        return SessionJournal(path, size, self.fsync, last_crc, usage=self.usage, max_bytes=self.max_session_bytes)

    def create(self, session_id: str, created_at: float,
               admit: Callable[[int], None] | None = None, mode: str = "v1") -> SessionJournal:
        """A new session's file (header + CREATE). ``admit(sessions_on_disk)`` may refuse
        (raise) first; the count and the create hold the data directory's create lock, so
        workers of one server admit against one count. Raises ``SessionExists`` if the file is
        there, :class:`InsufficientStorage` if it cannot be written (no file is left)."""
        head: dict[str, Any] = {"session_id": session_id, "created_at": created_at}
        if mode != "v1":  # a line's CREATE stays as it always was
            head["mode"] = mode
        payload = json.dumps(head).encode()
        version = FORMAT_VERSION if mode == "v1" else TREE_FORMAT_VERSION
        entries = [[FILE_HEADER.pack(MAGIC, version)], _entry(Kind.CREATE, [payload])]
        size = sum(len(c) for entry in entries for c in entry)
        journal: SessionJournal = self.usage.add(1, size, "the session", admit,
                                                 lambda: self._create(session_id, entries))
        return journal

    def _create(self, session_id: str, entries: list[list[bytes]]) -> SessionJournal:
        path = self.path(session_id)
        try:
            fd = open_private(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)  # kept for the turns' appends
        except FileExistsError:
            raise SessionExists(session_id) from None
        except (DataDirUnsafe, OSError) as exc:
            raise InsufficientStorage(f"cannot create the session journal: {exc}") from exc
        journal = SessionJournal(path, 0, self.fsync, max_bytes=self.max_session_bytes)  # counted by create
        try:  # the file header, then the CREATE entry: the same append (and fsync) as a turn's
            journal._append(entries, fd, what="the session")
            if self.fsync:
                try:
                    _fsync_dir(self.dir)
                except OSError as exc:
                    raise InsufficientStorage(f"the session was not stored: syncing the journal directory "
                                              f"failed: {exc.strerror or exc}") from exc
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        _open_journals.give(path, fd)
        journal.usage = self.usage
        return journal

    def remove(self, journal: SessionJournal) -> None:
        """Delete a session's file (and count it out)."""
        _open_journals.discard(journal.path)
        try:
            size = os.stat(journal.path, follow_symlinks=False).st_size
            os.unlink(journal.path)
        except FileNotFoundError:
            return
        self.usage.add(-1, -size)

    def restore(self, owns: Callable[[str], bool], pause: Callable[[], object] = lambda: None,
                lost: Callable[[str], object] = lambda session_id: None) -> Iterator[RestoredSession]:
        """Every session on disk whose id ``owns`` accepts, torn tails and damage set aside (see
        module doc). ``pause()`` is called after every read chunk (a gevent worker yields there,
        so it answers its heartbeats while it reads GiBs). ``lost(session_id)`` is called for a
        session of which nothing is served (its whole file set aside), so its id can answer as
        gone rather than as never seen. A file that cannot be read is logged and left alone; the
        others load."""
        with os.scandir(self.dir) as it:
            all_names = sorted(e.name for e in it)
        names = [n for n in all_names if n.endswith(SUFFIX)]
        self.set_aside += sum(1 for n in all_names if SUFFIX + SIDECAR in n and owns(n.split(SUFFIX)[0]))
        if self.set_aside:
            log.error("%d journal sidecars (damaged or torn bytes set aside) in %s", self.set_aside, self.dir)
        for name in names:
            session_id = name[:-len(SUFFIX)]
            if not owns(session_id):
                continue
            try:
                restored = self._restore(session_id, pause, lost)
            except (_NotOurs, DataDirUnsafe, OSError) as exc:
                log.error("journal %s not loaded, left as it is: %s", self.path(session_id), exc)
                continue
            if restored is not None:
                yield restored

    def _restore(self, session_id: str, pause: Callable[[], object],
                 lost: Callable[[str], object]) -> RestoredSession | None:
        path = self.path(session_id)
        _open_journals.discard(path)  # restore may cut or set the file aside: appends open it anew
        fd = open_private(path, os.O_RDWR)  # every change below goes through this fd: no link followed
        with os.fdopen(fd, "rb", buffering=0) as f:
            entries = _Scan(f, pause, first_may_be_damaged=True)
            restored, good, torn = self._replay(session_id, path, entries)
            torn = torn or entries.problem
            size = entries.size
            if restored is None:
                if size <= FILE_HEADER.size:
                    log.warning("journal %s holds no session (%s); removed", path, torn or "empty")
                    os.unlink(path)
                    return None
                self.usage.add(-1, -size)
                aside = self._set_aside(f, path, 0, size, whole=True)
                log.error("journal %s: nothing of a session verifies (%s); the file is set aside as %s and "
                          "not served", path, torn, aside)
                lost(session_id)
                return None
            if restored.damaged_create is not None and not self._repair_create(f, path, restored):
                self.usage.add(-1, -size)
                aside = self._set_aside(f, path, 0, size, whole=True)
                log.error("journal %s: its CREATE entry is damaged and cannot be rewritten; set aside as %s",
                          path, aside)
                lost(session_id)
                return None
            if good < size:
                aside = self._set_aside(f, path, good, size)
                after = _verified_after(f, entries.bad_end, size) if entries.damaged and entries.bad_end < size else 0
                if after:  # verified entries after a bad one: damage, never what a crash leaves
                    log.error("journal %s: damaged entry at byte %d (%s); session %s served up to byte %d "
                              "(%d turns), the rest (%d bytes, %d verified entries after the damage) set aside "
                              "as %s", path, entries.bad_at, torn, session_id, good, len(restored.records),
                              size - good, after, aside)
                else:
                    log.warning("journal %s: torn tail cut at byte %d of %d (%s); the cut bytes are kept in %s",
                                path, good, size, torn, aside)
                self.usage.add(0, good - size)  # before the cut: a rebuild now counts the file as it was
                os.ftruncate(f.fileno(), good)
            restored.journal.mtime_ns = os.fstat(f.fileno()).st_mtime_ns
        restored.journal.size = good
        return restored

    def _set_aside(self, f: Any, path: str, start: int, end: int, whole: bool = False) -> str:
        """Keep bytes ``[start, end)`` of the journal in a new sidecar (``whole``: the file is
        renamed to it instead); its path. Written (and synced) before the journal is cut."""
        base = f"{path}{SIDECAR}{start}"
        for n in range(1000):
            aside = base if n == 0 else f"{base}.{n}"
            if whole:
                if not os.path.lexists(aside):
                    os.rename(path, aside)
                    break
                continue
            try:
                out = open_private(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                continue
            try:
                pos = start
                while pos < end:
                    n_copied = os.copy_file_range(f.fileno(), out, end - pos, pos)
                    if n_copied <= 0:
                        raise OSError(errno.EIO, f"copying {path} to {aside} stopped at byte {pos}")
                    pos += n_copied
                os.fsync(out)
            except BaseException:
                os.close(out)
                os.unlink(aside)
                raise
            os.close(out)
            break
        else:
            raise OSError(errno.EEXIST, f"no free sidecar name for {path}")
        self.set_aside += 1
        return aside

    def _repair_create(self, f: Any, path: str, restored: RestoredSession) -> bool:
        """Rewrite a damaged CREATE entry in place, the same length (the turns' offsets stay),
        after setting its bytes aside; False if a valid one does not fit."""
        assert restored.damaged_create is not None
        start, end = restored.damaged_create
        room = end - start - ENTRY_HEADER.size
        created_at = restored.records[0].request_timestamp if restored.records else os.fstat(f.fileno()).st_mtime
        for value in (created_at, round(created_at, 3), int(created_at)):
            head: dict[str, Any] = {"session_id": restored.session_id, "created_at": value}
            if restored.tree is not None:  # known from its nodes
                head["mode"] = "v2"
            payload = json.dumps(head, separators=(",", ":")).encode()
            if len(payload) <= room:
                break
        else:
            return False
        payload += b" " * (room - len(payload))  # JSON allows trailing whitespace
        aside = self._set_aside(f, path, start, end)
        entry = b"".join(_entry(Kind.CREATE, [payload]))
        _write_at(f.fileno(), [entry], start)
        if self.fsync:
            os.fsync(f.fileno())
        restored.created_at = float(created_at)
        log.error("journal %s: damaged CREATE entry (bytes %d-%d) set aside as %s and rewritten; session %s "
                  "served with its %d turns", path, start, end, aside, restored.session_id, len(restored.records))
        return True

    def _replay(self, session_id: str, path: str,
                entries: _Scan) -> tuple[RestoredSession | None, int, str | None]:
        """Apply the entries in order: (the session, the last good length, why it stopped early)."""
        restored: RestoredSession | None = None
        pending: dict[str, StoredImage] = {}
        pending_from: int | None = None  # a turn's images count once its TURN entry is read
        good = FILE_HEADER.size
        try:
            for kind, start, end, meta, body_at, crc in entries:
                if restored is None:
                    if kind is None:  # a damaged CREATE: the turns after it do not need it
                        restored = RestoredSession(session_id, 0.0, self._journal(path, 0),
                                                   damaged_create=(start, end))
                    elif kind is not Kind.CREATE or meta.get("session_id") != session_id:
                        raise _NotOurs(f"the first entry is not session {session_id}'s CREATE")
                    else:
                        restored = RestoredSession(session_id, float(meta["created_at"]), self._journal(path, 0))
                        mode = meta.get("mode", "v1")
                        if mode == "v2":
                            restored.tree = SessionTree()
                        elif mode != "v1":
                            raise _NotOurs(f"session mode {mode!r}: this server serves v1 and v2")
                elif kind is Kind.IMAGE:
                    pending_from = start if pending_from is None else pending_from
                    pending[meta["sha256"]] = StoredImage(meta["sha256"], meta["mime_type"], meta["width"],
                                                          meta["height"], FileSpan(path, body_at, end - body_at))
                elif kind is Kind.DELTA and (restored.tree is not None or "parent" in meta):
                    # A tree node: stored on its parent (a damaged CREATE: its turns name the mode).
                    tree = restored.tree = restored.tree if restored.tree is not None else SessionTree()
                    parent_seq = meta["parent"]
                    if not (parent_seq is None or (type(parent_seq) is int and 0 <= parent_seq < len(tree))):
                        raise _Torn(f"a node under unknown node {parent_seq!r}")
                    parent = None if parent_seq is None else tree.nodes[parent_seq]
                    try:
                        state, turn = decode_delta(meta, parent.state if parent else INITIAL_STATE,
                                                   parent.turn.record if parent else None,
                                                   entries.f.fileno(), path, body_at, end)
                        node = tree.add(parent, state, turn, response_id=str(meta["response_id"]),
                                        committed_at=turn.timestamp)
                    except (KeyError, TypeError, ValueError, SessionError) as exc:
                        raise _Torn(f"an unreadable node ({exc})") from exc
                    restored.active, restored.state = node, state
                    restored.records = [n.turn for n in node.path()]
                    restored.images.update(pending)
                    pending, pending_from = {}, None
                elif kind in (Kind.TURN, Kind.DELTA):
                    rollback = bool(meta.get("rollback"))
                    base = restored.previous if rollback else restored.state
                    if base is None:
                        raise _Torn("a rollback with no turn to roll back")
                    recs = restored.records
                    base_record = (recs[-2] if len(recs) > 1 else None) if rollback else (recs[-1] if recs else None)
                    try:
                        if kind is Kind.TURN:
                            state, turn = decode_turn_meta(meta, base, FileSpan(path, body_at, end - body_at))
                        else:
                            state, turn = decode_delta(meta, base, base_record.record if base_record else None,
                                                       entries.f.fileno(), path, body_at, end)
                    except (KeyError, TypeError, ValueError) as exc:
                        raise _Torn(f"an unreadable turn ({exc})") from exc
                    if rollback:
                        restored.records.pop()
                        restored.rollbacks += 1
                    restored.previous, restored.state = base, state
                    restored.records.append(turn)
                    restored.images.update(pending)
                    pending, pending_from = {}, None
                else:
                    raise _Torn(f"a second {kind.name if kind else 'CREATE'} entry")
                if pending_from is None:
                    good = end
                    if kind is not None:
                        restored.journal.last_crc = crc
                else:
                    good = pending_from
        except _Torn as exc:
            entries.mark_damaged(good)
            return restored, good, str(exc)
        except (KeyError, TypeError, ValueError) as exc:
            if restored is None:
                raise _NotOurs(f"unreadable CREATE entry ({exc})") from exc
            entries.mark_damaged(good)
            return restored, good, f"an unreadable entry ({exc})"
        return restored, good, "images without the turn they belong to" if pending_from is not None else None


class _NotOurs(Exception):
    pass


class _Torn(Exception):
    """The entry at hand cannot be applied: the journal ends before it."""


_Item = tuple[Kind | None, int, int, dict[str, Any], int, int]


class _Scan:
    """Iterates ``(kind, entry_start, entry_end, meta, body_at, crc)`` of the good entries up
    to ``end`` (the file's size); ``problem`` says why it stopped early (None: a clean end),
    ``bad_at``/``bad_end`` where the entry it stopped at lies, ``damaged`` whether that entry
    was complete (a checksum, kind or meta failure: damage, not a torn tail).
    ``first_may_be_damaged``: a damaged first entry that the length chain passes (more entries
    follow) is yielded with kind None and the scan goes on."""

    def __init__(self, f: Any, pause: Callable[[], object], *, first_may_be_damaged: bool = False,
                 end: int | None = None, start: int = FILE_HEADER.size) -> None:
        self.f = f
        self.pause = pause
        self.first_may_be_damaged = first_may_be_damaged
        self.problem: str | None = None
        self.bad_at: int | None = None
        self.bad_end = 0
        self.damaged = False
        self.start = start
        self.size = os.fstat(f.fileno()).st_size if end is None else end
        if start != FILE_HEADER.size:
            return
        header = os.pread(f.fileno(), FILE_HEADER.size, 0)
        if len(header) < FILE_HEADER.size and header == MAGIC[:len(header)]:
            self.size = len(header)  # a crash before the header was complete: no session
            self.problem = "a short file header"
            return
        magic, version = FILE_HEADER.unpack(header) if len(header) == FILE_HEADER.size else (header, None)
        if magic != MAGIC:
            raise _NotOurs("not a session journal (bad magic)")
        if version not in READ_VERSIONS:
            raise _NotOurs(f"journal format version {version}, this server reads {READ_VERSIONS}")

    def mark_damaged(self, at: int) -> None:
        """The replay refused an entry the scan passed: damage at ``at`` (not a torn tail)."""
        if self.bad_at is None:
            self.damaged, self.bad_at = True, at
            length = ENTRY_HEADER.unpack(os.pread(self.f.fileno(), ENTRY_HEADER.size, at))[0] \
                if at + ENTRY_HEADER.size <= self.size else 0
            self.bad_end = min(self.size, at + ENTRY_HEADER.size + length)

    def _stop(self, pos: int, why: str, damaged: bool, end: int = 0) -> None:
        self.problem, self.bad_at, self.damaged, self.bad_end = why, pos, damaged, end

    def __iter__(self) -> Iterator[_Item]:
        pos = self.start if self.size >= FILE_HEADER.size else self.size
        buf = bytearray(_READ_CHUNK)
        while pos < self.size:
            header = os.pread(self.f.fileno(), ENTRY_HEADER.size, pos)
            if len(header) < ENTRY_HEADER.size or pos + ENTRY_HEADER.size > self.size:
                self._stop(pos, "a short entry header", False)
                return
            length, kind_byte, crc = ENTRY_HEADER.unpack(header)
            start, end = pos + ENTRY_HEADER.size, pos + ENTRY_HEADER.size + length
            if end > self.size:
                self._stop(pos, f"an entry of {length} bytes past the end of the file", False)
                return
            problem = self._verify(start, end, kind_byte, crc, buf)
            if problem == "short":
                self._stop(pos, "a short read", False)
                return
            kind: Kind | None = None
            meta: dict[str, Any] = {}
            body_at = start
            if problem is None:
                kind = Kind(kind_byte)
                try:
                    meta, body_at = self._meta(kind, start, end)
                except (TypeError, ValueError, OSError) as exc:
                    problem = f"an unreadable {kind.name} entry ({exc})"
            if problem is not None:
                if pos == FILE_HEADER.size and self.first_may_be_damaged and end < self.size:
                    yield None, pos, end, {}, start, crc  # the replay decides (see the class doc)
                    pos = end
                    continue
                self._stop(pos, problem, True, end)
                return
            yield kind, pos, end, meta, body_at, crc
            pos = end

    def _verify(self, start: int, end: int, kind_byte: int, crc: int, buf: bytearray) -> str | None:
        """None if the entry's kind is known and its checksum holds; else why not ("short": the
        file ended while reading)."""
        if kind_byte not in Kind._value2member_map_:
            return f"unknown entry kind {kind_byte}"
        got = zlib.crc32(bytes((kind_byte,)))
        view = memoryview(buf)
        at = start
        while at < end:
            n = os.preadv(self.f.fileno(), [view[:min(_READ_CHUNK, end - at)]], at)
            if n <= 0:
                return "short"
            got = zlib.crc32(view[:n], got)
            self.pause()
            at += n
        return None if got == crc else "a checksum mismatch"

    def _meta(self, kind: Kind, start: int, end: int) -> tuple[dict[str, Any], int]:
        """The entry's meta JSON (a CREATE's whole payload) and where its body starts."""
        if kind is Kind.CREATE:
            meta_at, n = start, end - start
        else:
            if end - start < META_LENGTH.size:
                raise ValueError("no meta length")
            (n,) = META_LENGTH.unpack(os.pread(self.f.fileno(), META_LENGTH.size, start))
            meta_at = start + META_LENGTH.size
            if meta_at + n > end:
                raise ValueError("meta past the entry")
        meta = json.loads(os.pread(self.f.fileno(), n, meta_at))
        if not isinstance(meta, dict):
            raise TypeError("meta is not an object")
        return meta, meta_at + n


def _verified_after(f: Any, pos: int, size: int) -> int:
    """How many entries from ``pos`` on still verify (reported with a damaged entry)."""
    scan = _Scan(f, lambda: None, start=pos, end=size)
    return sum(1 for _ in scan)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
