"""Tombstones: the ids of sessions that were deleted or expired, or whose journal a restart found
damaged past serving (set aside whole: ``webapp.journal``), kept a while so a request on
one answers 410 Gone (:class:`webapp.session_errors.SessionGone`) rather than the 404 of an id
never seen (miles' reclaimed sessions).

A tombstone lasts ``tombstone_ttl`` seconds (wall clock: it outlives a restart) and a shard
keeps at most ``max_tombstones``, the oldest dropped first: it is a breadcrumb for a client that
outlived its session, not a record of the run. Each shard keeps its own in the data directory::

    <data_dir>/tombstones/<shard>-of-<shards>   one JSON line per tombstone, appended

Appended (one ``write`` of one line, ``O_APPEND``) before the session's journal is removed, so a
worker killed between the two leaves a live session rather than an id that 404s; a torn last
line is skipped when read. Opening rewrites the file with what is still kept (a new file
renamed over it: never half-written), and so does an append once the file holds twice the
bound. Files of another worker count (``K-of-M``, M not this server's) are read too, keeping the
ids this shard owns now, so a server restarted with another ``--workers`` keeps its tombstones.
Files follow the data directory's rules (``webapp.datadir``: 0600, no symlink followed).

Imports nothing of the session core.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from webapp.datadir import DataDirUnsafe, ensure_private_dir, open_private
from webapp.session_errors import GONE_REASONS

__all__ = ["TOMBSTONES_DIR", "Tombstone", "Tombstones", "tombstones_path"]

log = logging.getLogger(__name__)

TOMBSTONES_DIR = "tombstones"
REASONS = tuple(GONE_REASONS)  # deleted, expired, damaged (its journal set aside whole at a restart)
_MAX_LINE = 1024  # far above any line of ours (ids are at most 128 characters): longer is not one


@dataclass(frozen=True)
class Tombstone:
    session_id: str
    at: float  # time.time() of the delete, the expiry or the restart that set the journal aside
    reason: str  # one of REASONS


def tombstones_path(data_dir: str, shard: int, shards: int) -> str:
    return os.path.join(data_dir, TOMBSTONES_DIR, f"{shard}-of-{shards}")


def _line(stone: Tombstone) -> bytes:
    return json.dumps({"session_id": stone.session_id, "at": stone.at, "reason": stone.reason},
                      separators=(",", ":")).encode() + b"\n"


def _parse(line: bytes) -> Tombstone | None:
    """A line as written, else None (a torn or foreign line is skipped, never fatal)."""
    if len(line) > _MAX_LINE:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    sid, at, reason = obj.get("session_id"), obj.get("at"), obj.get("reason")
    if not isinstance(sid, str) or isinstance(at, bool) or not isinstance(at, (int, float)) or reason not in REASONS:
        return None
    return Tombstone(sid, float(at), str(reason))


class Tombstones:
    """One shard's tombstones: in memory by id (oldest first), and in ``path`` when given
    (None: memory only, a core without a data directory of its own)."""

    def __init__(self, ttl: float, limit: int, path: str | None = None, *, fsync: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.ttl = ttl
        self.limit = limit
        self.path = path
        self._fsync = fsync
        self._clock = clock
        self._lock = threading.Lock()
        self._stones: OrderedDict[str, Tombstone] = OrderedDict()
        self._lines = 0  # lines in the file since it was last rewritten

    @classmethod
    def open(cls, data_dir: str, shard: int, shards: int, ttl: float, limit: int, *,
             owns: Callable[[str], bool] = lambda _sid: True, fsync: bool = False,
             clock: Callable[[], float] = time.time) -> Tombstones:
        """The shard's tombstones from the data directory (``owns``: the ids this shard serves,
        for the files of another worker count), its file rewritten with what is kept."""
        folder = os.path.join(data_dir, TOMBSTONES_DIR)
        ensure_private_dir(folder)
        store = cls(ttl, limit, tombstones_path(data_dir, shard, shards), fsync=fsync, clock=clock)
        found: list[Tombstone] = []
        for name in sorted(os.listdir(folder)):
            parts = name.split("-of-")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                continue  # a temporary file of an interrupted rewrite, or not ours
            mine = name == os.path.basename(store.path or "")
            if not mine and int(parts[1]) == shards:
                continue  # another shard of this layout: its worker reads it
            found += (s for s in store._read(os.path.join(folder, name)) if mine or owns(s.session_id))
        for stone in sorted(found, key=lambda s: s.at):
            store._stones.pop(stone.session_id, None)
            store._stones[stone.session_id] = stone
        with store._lock:
            store._trim()
            store._rewrite()
        return store

    @staticmethod
    def _read(path: str) -> list[Tombstone]:
        """The tombstones of a file; none of one that is missing, a link or unreadable (logged:
        tombstones are breadcrumbs, they never keep a shard from starting)."""
        try:
            fd = open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        except (OSError, DataDirUnsafe) as exc:
            log.warning("tombstones of %s not read: %s", path, exc)
            return []
        with os.fdopen(fd, "rb") as f:
            return [s for s in map(_parse, f.read().splitlines()) if s is not None]

    def _trim(self) -> None:
        """Drop the expired and, past the bound, the oldest (entries are in time order)."""
        cutoff = self._clock() - self.ttl
        while self._stones:
            oldest = next(iter(self._stones.values()))
            if oldest.at > cutoff and len(self._stones) <= self.limit:
                break
            self._stones.popitem(last=False)

    def _rewrite(self) -> None:
        """The file as the kept tombstones: a new file renamed over it (a reader or a crash
        sees the old file or the new one, never a part)."""
        if self.path is None:
            return
        tmp = f"{self.path}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        try:
            fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.write(fd, b"".join(_line(s) for s in self._stones.values()))
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except (OSError, DataDirUnsafe) as exc:  # a full disk costs the 410s of a restart, never a delete
            log.warning("could not rewrite %s: %s", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        self._lines = len(self._stones)

    def add(self, session_id: str, reason: str) -> None:
        """Remember ``session_id`` as ``reason`` (``deleted``, ``expired``): on disk first, then
        here. A file that cannot be written is logged; the tombstone then lasts until a restart."""
        assert reason in REASONS, reason
        if self.limit <= 0 or self.ttl <= 0:
            return
        stone = Tombstone(session_id, self._clock(), reason)
        with self._lock:
            if self.path is not None:
                try:
                    fd = open_private(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                    try:
                        os.write(fd, _line(stone))  # one write of one short line: appended whole
                        if self._fsync:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
                    self._lines += 1
                except (OSError, DataDirUnsafe) as exc:  # (a planted link: not followed, not written)
                    log.warning("could not write the tombstone of session %s to %s: %s", session_id, self.path, exc)
            self._stones.pop(session_id, None)
            self._stones[session_id] = stone
            self._trim()
            if self._lines > 2 * self.limit:
                self._rewrite()

    def get(self, session_id: str) -> Tombstone | None:
        """The id's tombstone while it lasts, else None."""
        with self._lock:
            stone = self._stones.get(session_id)
            if stone is not None and stone.at <= self._clock() - self.ttl:
                self._trim()  # it and everything older
                return None
            return stone

    def __len__(self) -> int:
        with self._lock:
            self._trim()
            return len(self._stones)
