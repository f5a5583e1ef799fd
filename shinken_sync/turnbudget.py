"""Fair scheduling on one event loop: at most so many call starts per loop turn.

A lockstep round has every sandbox call ``step()`` in the same instant. Each
start prepares, JSON-encodes, frames and writes its calls; 1024 of them back
to back are one loop turn of 100+ ms during which no timer fires and no reply
is read. A :class:`TurnBudget` admits at most ``limit`` calls per turn (the
client's ``MAX_CALL_STARTS_PER_TURN``); the rest wait, in arrival order, for
the next turns (the per-turn count and its queue are
:class:`shinken_sync.loopturn.PerTurnBudget`'s: a turn ends when its reset
callback, queued at the turn's first admission, runs).

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
import weakref

from .loopturn import PerTurnBudget

__all__ = ["CALLS", "REPLIES", "TurnBudget", "turn_budget_for_loop"]


class TurnBudget(PerTurnBudget[tuple["asyncio.Future[None]", int]]):
    """Call starts admitted in the current turn of one event loop, and who waits."""

    __slots__ = ("_last_limit", "admitted_late")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._last_limit: int | None = None
        #: Units that had to wait for a later turn (a counter for benchmarks and tests).
        self.admitted_late = 0

    @property
    def waiting(self) -> int:
        """Units (steps, single calls) waiting for a later turn."""
        return len(self._waiting)

    def try_admit(self, calls: int, limit: int | None) -> bool:
        """Admit ``calls`` now if this turn has room (and nobody queued earlier)."""
        if limit is not None:
            self._last_limit = limit
        return self._try_take(calls, limit)

    async def admit(self, calls: int, limit: int | None) -> None:
        """Return once ``calls`` call starts fit in a turn (at once when they fit now)."""
        waiter = self.ticket(calls, limit)
        if waiter is not None:
            await waiter  # cancelled while waiting: the next turn skips the cancelled future

    def ticket(self, calls: int, limit: int | None) -> asyncio.Future[None] | None:
        """:meth:`admit` without a coroutine: None when admitted now, else the
        future that resolves at the admission (the hot path of every call
        start makes no coroutine object this way)."""
        if self.try_admit(calls, limit):
            return None
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._enqueue((waiter, calls))
        self.admitted_late += 1
        return waiter

    def _limit(self) -> int | None:
        return self._last_limit

    def _size_of(self, waiter: tuple[asyncio.Future[None], int]) -> int | None:
        future, calls = waiter
        return None if future.done() else calls  # done: its task was cancelled while it waited

    def _release(self, waiter: tuple[asyncio.Future[None], int]) -> None:
        waiter[0].set_result(None)


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
