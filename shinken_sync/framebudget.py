"""Bounded screencast frame queues and the per-event-loop byte budget they share.

No I/O and no asyncio here: the client pushes received frames in and pops them
out, and this module decides what to keep. Only the thread running the event
loop touches a loop's queues and budget, so there are no locks.

Two bounds govern queued frames:

* **Count, per queue** (``max_frames``, 32 by default): a push onto a full
  queue drops that queue's oldest frame (``frames_dropped``).
* **Bytes, per event loop** (:class:`FrameBudget`, off unless a limit is set):
  every queued frame is charged at its resident size -- the length of the
  WebSocket message that carried it, since its payload is a view into that
  message. A push that would take the loop over its limit evicts the globally
  oldest queued frames, whichever queue holds them (``frames_evicted``), until
  the new frame fits. A frame larger than the whole limit is not admitted (it
  counts as evicted): a budget smaller than one frame admits nothing.

Eviction order is one FIFO of push order spanning every queue of the loop.
Frames that leave their queue by other paths (consumed, dropped by the count
bound, cleared) stay in that FIFO as stale entries, skipped when they reach its
head and swept out in one pass once they are more than half of it, so every
operation is O(1) amortized.

A queue ends with a terminal sentinel (the client's end-of-stream or
stream-lost marker). Sentinels are not frames: they are never charged, counted,
dropped or evicted, and :meth:`FrameQueue.pop` keeps returning the sentinel
once the frames before it are gone. Frames pushed after the sentinel are
discarded, so a sentinel always sits behind every frame it ends.
"""

from __future__ import annotations

import asyncio
import enum
import weakref
from collections import deque
from typing import Any, Literal

#: A compaction sweep runs only when the FIFO holds at least this many stale
#: entries (and they are the majority), so tiny queues never sweep.
_MIN_SWEEP = 64


class FrameCounters:
    """Readable frame accounting for one scope (a stream, a connection, a loop).

    ``queued_frames``/``used_bytes`` are what sits in queues now;
    ``frames_dropped`` counts frames shed by a queue's count bound and
    ``frames_evicted`` frames shed (or refused) by the byte budget, both since
    the scope was created.
    """

    __slots__ = ("frames_dropped", "frames_evicted", "queued_frames", "used_bytes")

    def __init__(self) -> None:
        self.queued_frames = 0
        self.used_bytes = 0
        self.frames_dropped = 0
        self.frames_evicted = 0

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} queued={self.queued_frames} used={self.used_bytes}B "
            f"dropped={self.frames_dropped} evicted={self.frames_evicted}>"
        )


class FrameBudget(FrameCounters):
    """The byte budget of one event loop, shared by all of its frame queues.

    ``limit`` is in bytes; None turns eviction off (bytes are still counted).
    Changing it takes effect at the next push: lowering it evicts then, and
    frames already queued drain as they are consumed.
    """

    __slots__ = ("__weakref__", "_order", "_stale", "limit")

    def __init__(self, limit: int | None = None):
        super().__init__()
        if limit is not None and limit < 0:
            raise ValueError(f"frame budget must be >= 0 bytes or None, not {limit}")
        self.limit = limit
        self._order: deque[_Entry] = deque()  # push order across every queue
        self._stale = 0  # entries in _order whose frame already left its queue

    def _make_room(self, size: int, limit: int) -> None:
        """Evict the globally oldest frames until ``size`` more bytes fit."""
        order = self._order
        while self.used_bytes + size > limit:
            entry = order.popleft()  # used_bytes > 0 guarantees a live entry remains
            if entry.queue is None:
                self._stale -= 1
            else:
                entry.queue._evict_oldest(entry)

    def _forget(self) -> None:
        """Account one entry that left its queue while still in the FIFO."""
        self._stale += 1
        order = self._order
        while order and order[0].queue is None:
            order.popleft()
            self._stale -= 1
        if self._stale >= _MIN_SWEEP and self._stale * 2 > len(order):
            self._order = deque(entry for entry in order if entry.queue is not None)
            self._stale = 0


class _Entry:
    __slots__ = ("item", "queue", "size")

    def __init__(self, item: Any, size: int, queue: FrameQueue):
        self.item = item
        self.size = size
        self.queue: FrameQueue | None = queue  # None once the frame left its queue


class _Empty:
    def __repr__(self) -> str:
        return "EMPTY"


#: Returned by :meth:`FrameQueue.pop` when neither a frame nor a sentinel waits.
EMPTY: Any = _Empty()


class FrameQueue:
    """One stream's frames in arrival order, bounded by count, charged to a budget.

    ``counters`` are this queue's own; ``group`` (optional) is a shared
    :class:`FrameCounters`, e.g. the connection's, updated alongside.
    """

    __slots__ = ("_budget", "_items", "_scopes", "counters", "max_frames", "terminal")

    def __init__(self, budget: FrameBudget, max_frames: int = 32, group: FrameCounters | None = None):
        if max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, not {max_frames}")
        self.max_frames = max_frames
        self.counters = FrameCounters()
        self.terminal: Any = None
        self._budget = budget
        scopes = [self.counters, budget]
        if group is not None:
            scopes.append(group)
        self._scopes = tuple(scopes)
        self._items: deque[_Entry] = deque()

    def __len__(self) -> int:
        """Queued frames (the sentinel is not a frame)."""
        return len(self._items)

    def push(self, item: Any, size: int) -> bool:
        """Queue one frame of ``size`` resident bytes; False if it was not admitted."""
        if self.terminal is not None:
            return False
        budget = self._budget
        limit = budget.limit
        if limit is not None and size > limit:
            self._count("frames_evicted")
            return False
        if len(self._items) >= self.max_frames:
            self._release(self._items.popleft())
            self._count("frames_dropped")
        if limit is not None:
            budget._make_room(size, limit)
        entry = _Entry(item, size, self)
        self._items.append(entry)
        budget._order.append(entry)
        for scope in self._scopes:
            scope.queued_frames += 1
            scope.used_bytes += size
        return True

    def pop(self) -> Any:
        """The oldest frame, else the terminal sentinel (left in place), else :data:`EMPTY`."""
        if self._items:
            entry = self._items.popleft()
            self._release(entry)
            return entry.item
        return EMPTY if self.terminal is None else self.terminal

    def end(self, sentinel: Any) -> None:
        """Terminate the queue with ``sentinel``; the first sentinel wins."""
        if self.terminal is None:
            self.terminal = sentinel

    def clear(self) -> None:
        """Release every queued frame; a sentinel stays."""
        while self._items:
            self._release(self._items.popleft())

    def _release(self, entry: _Entry) -> None:
        entry.queue = None
        for scope in self._scopes:
            scope.queued_frames -= 1
            scope.used_bytes -= entry.size
        self._budget._forget()

    def _evict_oldest(self, entry: _Entry) -> None:
        # The budget's FIFO head is the oldest live frame anywhere, hence also
        # the oldest in its own queue; it has already left the FIFO.
        assert self._items[0] is entry
        self._items.popleft()
        entry.queue = None
        for scope in self._scopes:
            scope.queued_frames -= 1
            scope.used_bytes -= entry.size
        self._count("frames_evicted")

    def _count(self, counter: str) -> None:
        for scope in self._scopes:
            setattr(scope, counter, getattr(scope, counter) + 1)


_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FrameBudget] = weakref.WeakKeyDictionary()


class _UseGlobal(enum.Enum):
    USE_GLOBAL = "use-global"


#: "Not given": take ``client.GLOBAL_FRAME_BUDGET_BYTES`` when the loop's budget
#: is created (None, by contrast, means "no limit"); httpx's USE_CLIENT_DEFAULT.
USE_GLOBAL = _UseGlobal.USE_GLOBAL
BudgetSetting = int | None | Literal[_UseGlobal.USE_GLOBAL]


def budget_for_loop(loop: asyncio.AbstractEventLoop, limit: int | None = None) -> FrameBudget:
    """The one :class:`FrameBudget` of ``loop``, created on first use with ``limit``.

    ``limit`` only applies when this call creates the budget: later calls
    never change a loop's limit (only an explicit ``budget.limit = ...`` or
    ``aconnect(frame_budget_bytes=...)`` does). It lives as long as the loop
    does. ``setdefault`` is a single dict operation, so loops on different
    threads may race here safely.
    """
    budget = _budgets.get(loop)
    if budget is None:
        budget = _budgets.setdefault(loop, FrameBudget(limit))
    return budget
