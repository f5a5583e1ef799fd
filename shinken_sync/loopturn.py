"""A budget per event-loop turn, with a queue of who waits for a later turn.

Both bursts of a lockstep round are spread over loop turns the same way: the
call starts (:mod:`shinken_sync.turnbudget`) and the received bytes parsed
(:mod:`shinken_sync.readpacing`). Each keeps a count used in the current turn
against a limit, and a queue, in arrival order, of what did not fit. A turn
ends when the reset callback runs: it is queued with ``call_soon`` at the
turn's first use, so it runs after every callback already ready (and the loop
polls its sockets before it). The reset hands the next turn's budget to the
queue's head first, a unit at a time, and re-queues itself while anything was
handed over or still waits.

One unit is never split: a unit larger than the limit goes alone, first in its
turn. Only the loop's own thread touches a budget.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Generic, TypeVar

__all__ = ["PerTurnBudget"]

W = TypeVar("W")


class PerTurnBudget(Generic[W]):
    """Units used in the current turn of one loop, and the waiters (``W``) queued.

    A subclass says what a limit is (:meth:`_limit`), how large a waiter is
    (:meth:`_size_of`, None to drop it) and what admitting one does
    (:meth:`_release`)."""

    __slots__ = ("__weakref__", "_loop", "_reset_scheduled", "_used", "_waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._used = 0
        self._waiting: collections.deque[W] = collections.deque()
        self._reset_scheduled = False

    @property
    def used(self) -> int:
        """Units admitted in the current turn."""
        return self._used

    def _try_take(self, size: int, limit: int | None) -> bool:
        """Count ``size`` units against this turn if there is room and nobody waits."""
        if limit is None:
            return True
        if self._waiting or (self._used and self._used + size > limit):
            return False
        self._used += size
        self._schedule_reset()
        return True

    def _enqueue(self, waiter: W) -> None:
        self._waiting.append(waiter)
        self._schedule_reset()

    def _schedule_reset(self) -> None:
        if not self._reset_scheduled:
            self._reset_scheduled = True
            self._loop.call_soon(self._new_turn)

    def _new_turn(self) -> None:
        self._reset_scheduled = False
        self._used = 0
        limit = self._limit()
        waiting = self._waiting
        while waiting:
            waiter = waiting[0]
            size = self._size_of(waiter)
            if size is None:
                waiting.popleft()
                continue
            if limit is not None and self._used and self._used + size > limit:
                break
            waiting.popleft()
            self._used += size
            self._release(waiter)
        if self._used or waiting:
            self._schedule_reset()

    def _limit(self) -> int | None:
        raise NotImplementedError

    def _size_of(self, waiter: W) -> int | None:
        raise NotImplementedError

    def _release(self, waiter: W) -> None:
        raise NotImplementedError
