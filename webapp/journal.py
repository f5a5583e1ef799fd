"""The session journal: every committed turn of a session, appended to the session's own file.

One file per session, ``<data_dir>/sessions/<session_id>.journal`` (``webapp.datadir``),
written only by the worker that owns the session's shard, only appended to, and read back
when a worker starts (after a crash, a hang, a channel teardown, a whole server restart, or
with a different ``--workers``: every worker loads the files whose ids hash to its shard, so
re-sharding is a start-up with another N and moves no file).

Format, version 1 (all integers little-endian)::

    file    = header entry*
    header  = "SHKJ" u32:version                        8 bytes
    entry   = u64:length u8:kind u32:crc32 payload      crc32 of the kind byte + payload
    payload = CREATE: JSON {"session_id", "created_at"}
              TURN:   u32:meta_length meta-JSON record
              IMAGE:  u32:meta_length meta-JSON image-file-bytes

A TURN's ``record`` is miles' ``SessionRecord`` JSON exactly as a records GET serves it (the
GET sends these bytes from the file), its meta the turn's TITO state as a delta on the state
it built on (``webapp.tito``; prefix lengths + suffixes, so a turn costs its own size, not the
conversation's) and the small fields samples read (``webapp.samples.TurnRecord``; the output
ids are the state's ids past ``prompt_len``). A turn's new images are IMAGE entries just
before its TURN entry, written with it in one ``writev``; images not followed by their TURN
are an unfinished commit.

Write: the entries of a turn go out before the reply does (a large or fsync'ed append in a
thread, so the worker's other sessions go on meanwhile); on any error (a full disk, EFBIG,
EIO) the file is cut back to its last good length and :class:`InsufficientStorage` (507) is
raised, so neither the file nor the session in memory holds the turn. ``fsync`` (setting
``fsync``, off by default) makes each append durable before the reply: without it a process
crash loses nothing answered (the bytes are in the page cache), a machine crash may lose the
last seconds; with it every turn waits for the disk (docs/session-server-ops.md).

Read: every entry's length chain and checksum are verified. A torn tail — a short header, a
length past the end of the file, a bad checksum, an unknown kind, or trailing images without
their turn — is what a crash mid-append leaves: the file is truncated to the last good entry
and a warning names it. Nothing after a bad entry is served. A file whose header is not ours
(another format version) is left untouched and not served.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Protocol

from webapp.datadir import sessions_dir
from webapp.filebody import FileSpan
from webapp.offload import run_blocking
from webapp.samples import TurnRecord
from webapp.session_errors import InsufficientStorage, SessionExists
from webapp.tito import INITIAL_STATE, TitoState

__all__ = [
    "ENTRY_HEADER",
    "FILE_HEADER",
    "FORMAT_VERSION",
    "MAGIC",
    "JournalStore",
    "Kind",
    "RestoredSession",
    "SessionJournal",
    "StoredImage",
]

log = logging.getLogger(__name__)

MAGIC = b"SHKJ"
FORMAT_VERSION = 1
FILE_HEADER = struct.Struct("<4sI")  # magic, version
ENTRY_HEADER = struct.Struct("<QBI")  # payload length, kind, crc32(kind byte + payload)
META_LENGTH = struct.Struct("<I")
SUFFIX = ".journal"
_READ_CHUNK = 8 << 20  # checksum reads at start-up
_IOV_MAX = 1024
_OFFLOAD_BYTES = 256 << 10  # appends this big (or fsync'ed) run in a thread under gevent (webapp.offload)


class Kind(IntEnum):
    CREATE = 1
    TURN = 2
    IMAGE = 3


class _Image(Protocol):
    sha256: str
    mime_type: str
    width: int
    height: int
    data: bytes


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


def encode_turn_meta(base: TitoState, state: TitoState, rollback: bool, turn: TurnRecord) -> bytes:
    assert tuple(state.token_ids[turn.prompt_len:]) == turn.output_ids, "token ids = prompt ids + output ids"
    meta = {
        "rollback": rollback,
        "messages": _delta(base.messages, state.messages),
        "token_ids": _delta(base.token_ids, state.token_ids),
        "rendered_prompt": _text_delta(base.rendered_prompt, state.rendered_prompt),
        "tools_key": state.tools_key,
        "eos": state.output_ended_with_eos,
        "prompt_len": turn.prompt_len,
        "logprobs": list(turn.logprobs),
        "finish_reason": turn.finish_reason,
        "meta": turn.meta,
        "timestamp": turn.timestamp,
        "request_timestamp": turn.request_timestamp,
        "replay": {k: list(v) for k, v in turn.replay.items()},
        "images": list(turn.images),
    }
    return json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()


def _apply(base: Sequence[Any], delta: list[Any]) -> tuple[Any, ...]:
    k, suffix = delta
    if not (type(k) is int and 0 <= k <= len(base)) or not isinstance(suffix, list):
        raise ValueError(f"bad delta prefix {k!r} on {len(base)} items")
    return (*base[:k], *suffix)


def decode_turn_meta(meta: dict[str, Any], base: TitoState, record: FileSpan) -> tuple[TitoState, TurnRecord]:
    k, text = meta["rendered_prompt"]
    if not (type(k) is int and 0 <= k <= len(base.rendered_prompt)) or not isinstance(text, str):
        raise ValueError("bad rendered_prompt delta")
    state = TitoState(messages=_apply(base.messages, meta["messages"]), tools_key=meta["tools_key"],
                      token_ids=_apply(base.token_ids, meta["token_ids"]),
                      rendered_prompt=base.rendered_prompt[:k] + text, output_ended_with_eos=bool(meta["eos"]))
    prompt_len = meta["prompt_len"]
    turn = TurnRecord(prompt_len=prompt_len, output_ids=state.token_ids[prompt_len:],
                      logprobs=tuple(meta["logprobs"]), finish_reason=meta["finish_reason"], meta=meta["meta"],
                      timestamp=meta["timestamp"], request_timestamp=meta["request_timestamp"],
                      record=record, replay={k: (s, e) for k, (s, e) in meta["replay"].items()},
                      images=tuple(meta["images"]))
    return state, turn


# -- writing ---------------------------------------------------------------------------------------

def _entry(kind: Kind, payload: Sequence[bytes]) -> list[bytes]:
    crc = zlib.crc32(bytes((kind,)))
    for chunk in payload:
        crc = zlib.crc32(chunk, crc)
    return [ENTRY_HEADER.pack(sum(len(c) for c in payload), kind, crc), *payload]


def _meta_payload(meta: bytes, *body: bytes) -> list[bytes]:
    return [META_LENGTH.pack(len(meta)), meta, *body]


class SessionJournal:
    """One session's file. Appends are serialized by the caller (the session's state lock)."""

    def __init__(self, path: str, size: int, fsync: bool, last_crc: int = 0) -> None:
        self.path = path
        self.size = size  # the last good length: everything before it is committed
        self.fsync = fsync
        # The last good entry's checksum: with ``size``, names this version of the session
        # (after a torn tail is cut and another turn written, the size alone may repeat).
        self.last_crc = last_crc

    @property
    def version(self) -> str:
        return f"{self.size:x}-{self.last_crc:08x}"

    def append_turn(self, base: TitoState, state: TitoState, rollback: bool, turn: TurnRecord,
                    record: Sequence[bytes], images: Sequence[_Image] = ()) -> tuple[TurnRecord, dict[str, StoredImage]]:
        """Append a turn (and its new images); returns the turn and images as the session keeps
        them (pointing into the file). Raises :class:`InsufficientStorage`: nothing written."""
        entries: list[list[bytes]] = []
        for image in images:
            meta = json.dumps({"sha256": image.sha256, "mime_type": image.mime_type, "width": image.width,
                               "height": image.height}, separators=(",", ":")).encode()
            entries.append(_entry(Kind.IMAGE, _meta_payload(meta, image.data)))
        meta = encode_turn_meta(base, state, rollback, turn)
        entries.append(_entry(Kind.TURN, _meta_payload(meta, *record)))
        starts = self._append(entries)
        stored = {}
        for image, entry, start in zip(images, entries, starts):
            data_at = start + ENTRY_HEADER.size + META_LENGTH.size + len(entry[2])
            stored[image.sha256] = StoredImage(image.sha256, image.mime_type, image.width, image.height,
                                               FileSpan(self.path, data_at, len(image.data)))
        record_at = starts[-1] + ENTRY_HEADER.size + META_LENGTH.size + len(meta)
        return replace(turn, record=FileSpan(self.path, record_at, sum(len(c) for c in record))), stored

    def _append(self, entries: list[list[bytes]], what: str = "the turn") -> list[int]:
        """Write the entries in one go at the end; returns each entry's offset. Raises
        :class:`InsufficientStorage` (naming ``what`` was not stored), the file cut back."""
        starts, pos = [], self.size
        for entry in entries:
            starts.append(pos)
            pos += sum(len(c) for c in entry)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InsufficientStorage(f"journal {self.path} is gone; {what} was not stored") from None
        chunks = [c for entry in entries for c in entry]
        try:
            if self.fsync or pos - self.size >= _OFFLOAD_BYTES:  # the hub goes on meanwhile
                run_blocking("journal", self._write, fd, chunks)
            else:
                self._write(fd, chunks)
        except OSError as exc:
            try:
                os.ftruncate(fd, self.size)
            except OSError:
                log.exception("cannot cut %s back to %d bytes after a failed append", self.path, self.size)
            raise InsufficientStorage(f"{what} was not stored: writing the session journal failed: "
                                      f"{exc.strerror or exc}") from exc
        finally:
            os.close(fd)
        self.size = pos
        self.last_crc = ENTRY_HEADER.unpack(entries[-1][0])[2]
        return starts

    def _write(self, fd: int, chunks: list[bytes]) -> None:
        _write_at(fd, chunks, self.size)
        if self.fsync:
            os.fsync(fd)

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _write_at(fd: int, chunks: list[bytes], offset: int) -> None:
    """``pwritev`` every chunk at ``offset`` (the last good length: a previous failed append's
    leftovers, if its truncate failed too, are overwritten), partial writes resumed."""
    views = [memoryview(c) for c in chunks if c]
    while views:
        written = os.pwritev(fd, views[:_IOV_MAX], offset)
        if written == 0:
            raise OSError(errno.ENOSPC, "no space left on device")
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if written:
            views[0] = views[0][written:]


# -- the store --------------------------------------------------------------------------------------

class JournalStore:
    """The journals of one data directory (``webapp.datadir``)."""

    def __init__(self, data_dir: str, *, fsync: bool = False) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.dir = sessions_dir(self.data_dir)
        self.fsync = fsync
        os.makedirs(self.dir, exist_ok=True)

    def path(self, session_id: str) -> str:
        return os.path.join(self.dir, session_id + SUFFIX)

    def count(self) -> int:
        """Sessions on disk, every shard's (the ``max_sessions`` count of the whole server)."""
        with os.scandir(self.dir) as it:
            return sum(1 for e in it if e.name.endswith(SUFFIX))

    def create(self, session_id: str, created_at: float,
               admit: Callable[[int], None] | None = None) -> SessionJournal:
        """A new session's file (header + CREATE). ``admit(sessions_on_disk)`` may refuse
        (raise) first; the count and the create hold the data directory's create lock, so
        workers of one server admit against one count. Raises ``SessionExists`` if the file is
        there, :class:`InsufficientStorage` if it cannot be written (no file is left)."""
        if admit is None:
            return self._create(session_id, created_at)
        fd = os.open(os.path.join(self.data_dir, "create.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a listdir and a small write
            admit(self.count())
            return self._create(session_id, created_at)
        finally:
            os.close(fd)  # releases the lock

    def _create(self, session_id: str, created_at: float) -> SessionJournal:
        path = self.path(session_id)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
        except FileExistsError:
            raise SessionExists(session_id) from None
        except OSError as exc:
            raise InsufficientStorage(f"cannot create the session journal: {exc.strerror or exc}") from exc
        journal = SessionJournal(path, 0, self.fsync)
        payload = json.dumps({"session_id": session_id, "created_at": created_at}).encode()
        try:  # the file header, then the CREATE entry: the same append (and fsync) as a turn's
            journal._append([[FILE_HEADER.pack(MAGIC, FORMAT_VERSION)], _entry(Kind.CREATE, [payload])],
                            what="the session")
            if self.fsync:
                try:
                    _fsync_dir(self.dir)
                except OSError as exc:
                    raise InsufficientStorage(f"the session was not stored: syncing the journal directory "
                                              f"failed: {exc.strerror or exc}") from exc
        except InsufficientStorage:
            os.unlink(path)
            raise
        return journal

    def restore(self, owns: Callable[[str], bool],
                pause: Callable[[], object] = lambda: None) -> Iterator[RestoredSession]:
        """Every session on disk whose id ``owns`` accepts, torn tails cut (see module doc).
        ``pause()`` is called after every read chunk (a gevent worker yields there, so it
        answers its heartbeats while it reads GiBs). A file that cannot be read is logged and
        left alone; the others load."""
        with os.scandir(self.dir) as it:
            names = sorted(e.name for e in it if e.name.endswith(SUFFIX))
        for name in names:
            session_id = name[:-len(SUFFIX)]
            if not owns(session_id):
                continue
            try:
                restored = self._restore(session_id, pause)
            except (_NotOurs, OSError) as exc:
                log.error("journal %s not loaded, left as it is: %s", self.path(session_id), exc)
                continue
            if restored is not None:
                yield restored

    def _restore(self, session_id: str, pause: Callable[[], object]) -> RestoredSession | None:
        path = self.path(session_id)
        with open(path, "rb", buffering=0) as f:
            entries = _Scan(f, pause)
            restored, good, torn = self._replay(session_id, path, entries)
            torn = torn or entries.torn
        if restored is None:
            log.warning("journal %s holds no session (%s); removed", path, torn or "empty")
            os.unlink(path)
            return None
        if torn:
            log.warning("journal %s: torn tail cut at byte %d of %d (%s)", path, good, os.path.getsize(path), torn)
            os.truncate(path, good)
        restored.journal.size = good
        return restored

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
                    if kind is not Kind.CREATE or meta.get("session_id") != session_id:
                        raise _NotOurs(f"the first entry is not session {session_id}'s CREATE")
                    restored = RestoredSession(session_id, float(meta["created_at"]),
                                               SessionJournal(path, 0, self.fsync))
                elif kind is Kind.IMAGE:
                    pending_from = start if pending_from is None else pending_from
                    pending[meta["sha256"]] = StoredImage(meta["sha256"], meta["mime_type"], meta["width"],
                                                          meta["height"], FileSpan(path, body_at, end - body_at))
                elif kind is Kind.TURN:
                    rollback = bool(meta.get("rollback"))
                    base = restored.previous if rollback else restored.state
                    if base is None:
                        raise _Torn("a rollback with no turn to roll back")
                    try:
                        state, turn = decode_turn_meta(meta, base, FileSpan(path, body_at, end - body_at))
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
                    raise _Torn(f"a second {kind.name} entry")
                if pending_from is None:
                    good, restored.journal.last_crc = end, crc
                else:
                    good = pending_from
        except _Torn as exc:
            return restored, good, str(exc)
        except (KeyError, TypeError, ValueError) as exc:
            if restored is None:
                raise _NotOurs(f"unreadable CREATE entry ({exc})") from exc
            return restored, good, f"an unreadable entry ({exc})"
        return restored, good, "images without the turn they belong to" if pending_from is not None else None


class _NotOurs(Exception):
    pass


class _Torn(Exception):
    """The entry at hand cannot be applied: the journal ends before it."""


class _Scan:
    """Iterates ``(kind, entry_start, entry_end, meta, body_at, crc)`` of the good entries;
    ``torn`` says why it stopped early (None: a clean end)."""

    def __init__(self, f: Any, pause: Callable[[], object]) -> None:
        self.f = f
        self.pause = pause
        self.torn: str | None = None
        self.size = os.fstat(f.fileno()).st_size
        header = f.read(FILE_HEADER.size)
        if len(header) < FILE_HEADER.size and header == MAGIC[:len(header)]:
            self.size = 0  # a crash before the header was complete: no session
            self.torn = "a short file header"
            return
        magic, version = FILE_HEADER.unpack(header) if len(header) == FILE_HEADER.size else (header, None)
        if magic != MAGIC:
            raise _NotOurs("not a session journal (bad magic)")
        if version != FORMAT_VERSION:
            raise _NotOurs(f"journal format version {version}, this server reads {FORMAT_VERSION}")

    def __iter__(self) -> Iterator[tuple[Kind, int, int, dict[str, Any], int, int]]:
        pos = FILE_HEADER.size
        buf = bytearray(_READ_CHUNK)
        while pos < self.size:
            header = os.pread(self.f.fileno(), ENTRY_HEADER.size, pos)
            if len(header) < ENTRY_HEADER.size:
                self.torn = "a short entry header"
                return
            length, kind, crc = ENTRY_HEADER.unpack(header)
            start, end = pos + ENTRY_HEADER.size, pos + ENTRY_HEADER.size + length
            if end > self.size:
                self.torn = f"an entry of {length} bytes past the end of the file"
                return
            try:
                kind = Kind(kind)
            except ValueError:
                self.torn = f"unknown entry kind {kind}"
                return
            got = zlib.crc32(bytes((kind,)))
            view = memoryview(buf)
            head = b""
            at = start
            while at < end:
                n = os.preadv(self.f.fileno(), [view[:min(_READ_CHUNK, end - at)]], at)
                if n <= 0:
                    self.torn = "a short read"
                    return
                got = zlib.crc32(view[:n], got)
                self.pause()
                if at == start:
                    head = bytes(view[:min(n, 1 << 16)])
                at += n
            if got != crc:
                self.torn = "a checksum mismatch"
                return
            try:
                meta, body_at = self._meta(kind, head, start, end)
            except (TypeError, ValueError, OSError) as exc:
                self.torn = f"an unreadable {kind.name} entry ({exc})"
                return
            yield kind, pos, end, meta, body_at, crc
            pos = end

    def _meta(self, kind: Kind, head: bytes, start: int, end: int) -> tuple[dict[str, Any], int]:
        """The entry's meta JSON (a CREATE's whole payload) and where its body starts; from the
        payload's first bytes already read (``head``), else read again."""
        if kind is Kind.CREATE:
            meta_at, n = start, end - start
        else:
            (n,) = META_LENGTH.unpack(head[:META_LENGTH.size])
            meta_at = start + META_LENGTH.size
            if meta_at + n > end:
                raise ValueError("meta past the entry")
        lo = meta_at - start
        meta_bytes = head[lo:lo + n] if lo + n <= len(head) else os.pread(self.f.fileno(), n, meta_at)
        body_at = meta_at + n
        meta = json.loads(meta_bytes)
        if not isinstance(meta, dict):
            raise TypeError("meta is not an object")
        return meta, body_at


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
