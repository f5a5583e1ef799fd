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

from webapp.datadir import USAGE_FILE, DataDirUnsafe, ensure_private_dir, open_private, sessions_dir
from webapp.filebody import FileSpan
from webapp.offload import run_blocking
from webapp.samples import TurnRecord
from webapp.session_errors import InsufficientStorage, JournalDamaged, SessionExists, StorageBudget
from webapp.tito import INITIAL_STATE, TitoState

__all__ = [
    "ENTRY_HEADER",
    "FILE_HEADER",
    "FORMAT_VERSION",
    "MAGIC",
    "SIDECAR",
    "JournalStore",
    "Kind",
    "RestoredSession",
    "SessionJournal",
    "StoredImage",
    "Usage",
]

log = logging.getLogger(__name__)

MAGIC = b"SHKJ"
FORMAT_VERSION = 1
FILE_HEADER = struct.Struct("<4sI")  # magic, version
ENTRY_HEADER = struct.Struct("<QBI")  # payload length, kind, crc32(kind byte + payload)
META_LENGTH = struct.Struct("<I")
SUFFIX = ".journal"
SIDECAR = ".damaged."  # <id>.journal.damaged.<offset>: bytes set aside by recovery
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
    damaged_create: tuple[int, int] | None = None  # a damaged CREATE entry's bytes, to be rewritten


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
        :class:`InsufficientStorage` (naming ``what`` was not stored), the file cut back, and
        :class:`StorageBudget` (nothing written) past a byte budget."""
        starts, pos = [], self.size
        for entry in entries:
            starts.append(pos)
            pos += sum(len(c) for c in entry)
        grow = pos - self.size
        if self.max_bytes is not None and pos > self.max_bytes:
            raise StorageBudget("max_session_bytes", self.max_bytes, pos, f"{what} (the session's journal)")
        try:
            fd = open_private(self.path, os.O_WRONLY)
        except FileNotFoundError:
            raise InsufficientStorage(f"journal {self.path} is gone; {what} was not stored") from None
        except (DataDirUnsafe, OSError) as exc:
            raise InsufficientStorage(f"{what} was not stored: cannot open the session journal: {exc}") from exc
        chunks = [c for entry in entries for c in entry]
        try:
            if self.usage is not None:
                self.usage.add(0, grow, what)  # StorageBudget past max_data_bytes: nothing written
            try:
                if self.fsync or grow >= _OFFLOAD_BYTES:  # the hub goes on meanwhile
                    run_blocking("journal", self._write, fd, chunks)
                else:
                    self._write(fd, chunks)
            except OSError as exc:
                if self.usage is not None:
                    self.usage.add(0, -grow)
                try:
                    os.ftruncate(fd, self.size)
                except OSError:
                    log.exception("cannot cut %s back to %d bytes after a failed append", self.path, self.size)
                raise InsufficientStorage(f"{what} was not stored: writing the session journal failed: "
                                          f"{exc.strerror or exc}") from exc
            self.mtime_ns = os.fstat(fd).st_mtime_ns
        finally:
            os.close(fd)
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

    def add(self, sessions: int, nbytes: int, what: str = "the turn",
            admit: Callable[[int], None] | None = None, then: Callable[[], Any] | None = None) -> Any:
        """Under the lock: ``admit(sessions now)`` may refuse (raise); a growth past
        ``max_bytes`` raises :class:`StorageBudget`; then ``then()`` (its result returned) and,
        unless it raised, the counts are moved by ``sessions`` and ``nbytes``."""
        try:
            lock = open_private(self.lock_path, os.O_RDWR | os.O_CREAT)
        except (DataDirUnsafe, OSError) as exc:
            raise InsufficientStorage(f"{what} was not stored: {exc}") from exc
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                fd = open_private(self.path, os.O_RDWR | os.O_CREAT)
            except (DataDirUnsafe, OSError) as exc:
                raise InsufficientStorage(f"{what} was not stored: {exc}") from exc
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
                os.close(fd)
        finally:
            os.close(lock)  # releases the lock

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

    def count(self) -> int:
        """Sessions on disk, every shard's (the ``max_sessions`` count of the whole server)."""
        return self.usage.read()[0]

    def _journal(self, path: str, size: int, last_crc: int = 0) -> SessionJournal:
        return SessionJournal(path, size, self.fsync, last_crc, usage=self.usage, max_bytes=self.max_session_bytes)

    def create(self, session_id: str, created_at: float,
               admit: Callable[[int], None] | None = None) -> SessionJournal:
        """A new session's file (header + CREATE). ``admit(sessions_on_disk)`` may refuse
        (raise) first; the count and the create hold the data directory's create lock, so
        workers of one server admit against one count. Raises ``SessionExists`` if the file is
        there, :class:`InsufficientStorage` if it cannot be written (no file is left)."""
        payload = json.dumps({"session_id": session_id, "created_at": created_at}).encode()
        entries = [[FILE_HEADER.pack(MAGIC, FORMAT_VERSION)], _entry(Kind.CREATE, [payload])]
        size = sum(len(c) for entry in entries for c in entry)
        journal: SessionJournal = self.usage.add(1, size, "the session", admit,
                                                 lambda: self._create(session_id, entries))
        return journal

    def _create(self, session_id: str, entries: list[list[bytes]]) -> SessionJournal:
        path = self.path(session_id)
        try:
            os.close(open_private(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            raise SessionExists(session_id) from None
        except (DataDirUnsafe, OSError) as exc:
            raise InsufficientStorage(f"cannot create the session journal: {exc}") from exc
        journal = SessionJournal(path, 0, self.fsync, max_bytes=self.max_session_bytes)  # counted by create
        try:  # the file header, then the CREATE entry: the same append (and fsync) as a turn's
            journal._append(entries, what="the session")
            if self.fsync:
                try:
                    _fsync_dir(self.dir)
                except OSError as exc:
                    raise InsufficientStorage(f"the session was not stored: syncing the journal directory "
                                              f"failed: {exc.strerror or exc}") from exc
        except InsufficientStorage:
            os.unlink(path)
            raise
        journal.usage = self.usage
        return journal

    def remove(self, journal: SessionJournal) -> None:
        """Delete a session's file (and count it out)."""
        try:
            size = os.stat(journal.path, follow_symlinks=False).st_size
            os.unlink(journal.path)
        except FileNotFoundError:
            return
        self.usage.add(-1, -size)

    def restore(self, owns: Callable[[str], bool],
                pause: Callable[[], object] = lambda: None) -> Iterator[RestoredSession]:
        """Every session on disk whose id ``owns`` accepts, torn tails and damage set aside (see
        module doc). ``pause()`` is called after every read chunk (a gevent worker yields there,
        so it answers its heartbeats while it reads GiBs). A file that cannot be read is logged
        and left alone; the others load."""
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
                restored = self._restore(session_id, pause)
            except (_NotOurs, DataDirUnsafe, OSError) as exc:
                log.error("journal %s not loaded, left as it is: %s", self.path(session_id), exc)
                continue
            if restored is not None:
                yield restored

    def _restore(self, session_id: str, pause: Callable[[], object]) -> RestoredSession | None:
        path = self.path(session_id)
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
                return None
            if restored.damaged_create is not None and not self._repair_create(f, path, restored):
                self.usage.add(-1, -size)
                aside = self._set_aside(f, path, 0, size, whole=True)
                log.error("journal %s: its CREATE entry is damaged and cannot be rewritten; set aside as %s",
                          path, aside)
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
            payload = json.dumps({"session_id": restored.session_id, "created_at": value},
                                 separators=(",", ":")).encode()
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
        if version != FORMAT_VERSION:
            raise _NotOurs(f"journal format version {version}, this server reads {FORMAT_VERSION}")

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
