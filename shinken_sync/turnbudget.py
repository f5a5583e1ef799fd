"""Fair scheduling on one event loop: at most so many call starts per loop turn.

A lockstep round has every sandbox call ``step()`` in the same instant. Each
start prepares, JSON-encodes, frames and writes its calls; 1024 of them back
to back are one loop turn of 100+ ms during which no timer fires and no reply
is read. A :class:`TurnBudget` admits at most ``limit`` calls per turn (the
client's ``MAX_CALL_STARTS_PER_TURN``); the rest wait, in arrival order, for
the next turns. A turn ends when the budget's reset callback runs: it is
queued with ``call_soon`` at the first admission of a turn, so it runs after
everything already ready, and the loop polls its sockets before it.

The bound is in *calls*, not steps: a step of five actions and an observation
is six calls. One unit is never split: a step larger than the limit is
admitted alone, in a turn of its own.

The replies of such a round come back as a burst too: the client's readers
take one unit of a second budget (``replies``, the client's
``MAX_REPLIES_PER_TURN``) per message dispatched, so the continuations a
burst of replies wakes (each step's rows, each caller's code) are spread over
turns the same way, whoever owns the loop's select.

No asyncio task or lock per admission: the fast path (room left in this turn,
nobody waiting) is a comparison and an addition. Only the loop's own thread
touches a loop's budget.
"""

from __future__ import annotations

import asyncio
import collections
import weakref

__all__ = ["CALLS", "REPLIES", "TurnBudget", "turn_budget_for_loop"]


class TurnBudget:
    """Call starts admitted in the current turn of one event loop, and who waits."""

    __slots__ = ("__weakref__", "_limit", "_loop", "_reset_scheduled", "_used", "_waiters", "admitted_late")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._used = 0
        self._limit: int | None = None
        self._waiters: collections.deque[tuple[asyncio.Future[None], int]] = collections.deque()
        self._reset_scheduled = False
        #: Units that had to wait for a later turn (a counter for benchmarks and tests).
        self.admitted_late = 0

    @property
    def used(self) -> int:
        """Calls admitted in the current turn."""
        return self._used

    @property
    def waiting(self) -> int:
        """Units (steps, single calls) waiting for a later turn."""
        return len(self._waiters)

    def try_admit(self, calls: int, limit: int | None) -> bool:
        """Admit ``calls`` now if this turn has room (and nobody queued earlier)."""
        if limit is None:
            return True
        self._limit = limit
        if self._waiters or (self._used and self._used + calls > limit):
            return False
        self._used += calls
        self._schedule_reset()
        return True

    async def admit(self, calls: int, limit: int | None) -> None:
        """Return once ``calls`` call starts fit in a turn (at once when they fit now)."""
        waiter = self.ticket(calls, limit)
        if waiter is not None:
            await waiter  # cancelled while waiting: _new_turn skips the cancelled future

    def ticket(self, calls: int, limit: int | None) -> asyncio.Future[None] | None:
        """:meth:`admit` without a coroutine: None when admitted now, else the
        future that resolves at the admission (the hot path of every call
        start makes no coroutine object this way)."""
        if self.try_admit(calls, limit):
            return None
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append((waiter, calls))
        self._schedule_reset()
        self.admitted_late += 1
        return waiter

    def _schedule_reset(self) -> None:
        if not self._reset_scheduled:
            self._reset_scheduled = True
            self._loop.call_soon(self._new_turn)

    def _new_turn(self) -> None:
        self._reset_scheduled = False
        self._used = 0
        limit = self._limit
        waiters = self._waiters
        while waiters:
            waiter, calls = waiters[0]
            if waiter.done():  # its task was cancelled while it waited
                waiters.popleft()
                continue
            if self._used and limit is not None and self._used + calls > limit:
                break
            waiters.popleft()
            self._used += calls
            waiter.set_result(None)
        if self._used or waiters:
            self._schedule_reset()


CALLS = "calls"
REPLIES = "replies"

_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, TurnBudget]] = weakref.WeakKeyDictionary()


def turn_budget_for_loop(loop: asyncio.AbstractEventLoop, kind: str = CALLS) -> TurnBudget:
    """The :class:`TurnBudget` of ``loop`` for ``kind`` (``calls`` started, ``replies``
    dispatched), created on first use; it lives as long as the loop."""
    budgets = _budgets.get(loop)
    if budgets is None:
        budgets = _budgets.setdefault(loop, {})
    budget = budgets.get(kind)
    if budget is None:
        budget = budgets.setdefault(kind, TurnBudget(loop))
    return budget
