"""Fair reading on one event loop: at most so many received bytes parsed per loop turn.

The replies of a lockstep round arrive together: at N=1024, 1024 sockets turn
readable within a few ms, and a plain asyncio loop runs every ready socket's
read callback in one turn. With the ``websockets`` transport each callback also
parses its data in Python (frame headers, copies, the message queue), ~20 us
per 72 KiB observation on a quiet core and 2-3x that on a loaded one, so one
turn took 20-50 ms during which no timer fired. The SharedLoop bounds the ready
sockets per select (``sharedloop.MAX_EVENTS_PER_SELECT``); the async face runs
on the caller's loop, which the SDK does not replace.

So each connection's protocol is wrapped in a :class:`PacedProtocol`: data
arriving within the turn's budget (:data:`MAX_READ_BYTES_PER_TURN` across the
loop's connections) goes to the WebSocket parser at once; past it, the data is
held as received (no parsing) -- past :data:`HOLD_BYTES_BEFORE_PAUSE` held,
the socket stops being read -- and the next turns hand the held data to the
parser, in arrival order, a budget's worth each (the per-turn budget and its
queue are :class:`shinken_sync.loopturn.PerTurnBudget`'s).

Order is kept (held data is always delivered before anything after it, and
before the end of the stream); the library's own flow control is respected (a
connection the library paused stays paused). Only the loop's thread touches a
loop's budget.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from .loopturn import PerTurnBudget

log = logging.getLogger("shinken_sync.readpacing")

__all__ = ["HOLD_BYTES_BEFORE_PAUSE", "MAX_READ_BYTES_PER_TURN", "PacedProtocol", "ReadBudget", "pace", "read_budget_for_loop"]

#: Received bytes handed to the WebSocket parsers per loop turn, across every
#: connection of the loop (about 28 observations of 72 KiB); None = no bound.
#: Read at every arrival. A single read larger than this is delivered alone.
MAX_READ_BYTES_PER_TURN: int | None = 2 << 20

#: A connection holding more than this many unparsed bytes stops reading its
#: socket until its turn (TCP pushes back on the sender). Below it the socket is
#: left alone: a pause and a resume are two epoll_ctl system calls, ~6% of the
#: loop's CPU at N=1024 when every held observation paid them, while a lockstep
#: round holds about one observation per connection for a turn or two.
HOLD_BYTES_BEFORE_PAUSE = 256 * 1024


class ReadBudget(PerTurnBudget["PacedProtocol"]):
    """The bytes parsed in the current turn of one loop, and the connections waiting."""

    __slots__ = ("held_turns",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        #: Times a connection's data had to wait for a later turn (for benchmarks and tests).
        self.held_turns = 0

    def take(self, size: int) -> bool:
        """Count ``size`` bytes against this turn if there is room and nobody waits."""
        return self._try_take(size, MAX_READ_BYTES_PER_TURN)

    def wait(self, paced: PacedProtocol) -> None:
        self._enqueue(paced)
        self.held_turns += 1

    def _limit(self) -> int | None:
        return MAX_READ_BYTES_PER_TURN

    def _size_of(self, waiter: PacedProtocol) -> int:
        return waiter.held_bytes

    def _release(self, waiter: PacedProtocol) -> None:
        waiter.release()


class PacedProtocol(asyncio.Protocol):
    """Stands between a transport and the library's protocol; see the module docstring."""

    def __init__(self, inner: Any, transport: Any, budget: ReadBudget) -> None:
        self._inner = inner
        self._transport = transport
        self._budget = budget
        self._held: list[bytes] = []
        self.held_bytes = 0
        self._paused = False  # reading paused by us (not by the library)

    def data_received(self, data: bytes) -> None:
        if not self._held and self._budget.take(len(data)):
            self._inner.data_received(data)
            return
        if not self._held:
            self._budget.wait(self)
        self._held.append(data)
        self.held_bytes += len(data)
        if self.held_bytes > HOLD_BYTES_BEFORE_PAUSE and self._transport.is_reading():
            self._transport.pause_reading()
            self._paused = True

    def release(self) -> None:
        """Our turn: parse what was held, then read again unless the library paused.

        Never raises: it runs in the budget's callback, on behalf of every
        connection waiting behind this one. A parser that fails here gets what
        it would get from the transport's own read callback: the connection is
        aborted (its reader then fails its calls with the loss)."""
        try:
            self._deliver()
        except Exception:
            log.exception("parsing held data failed; aborting the connection")
            self._transport.abort()
            return
        if self._paused:
            self._paused = False
            recv_messages = getattr(self._inner, "recv_messages", None)
            if not getattr(recv_messages, "paused", False) and not self._transport.is_closing():
                self._transport.resume_reading()

    def _deliver(self) -> None:
        held, self._held, self.held_bytes = self._held, [], 0
        for data in held:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        self._deliver()  # everything before the end of the stream, in order
        result: bool | None = self._inner.eof_received()
        return result

    def connection_lost(self, exc: Exception | None) -> None:
        self._deliver()
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


_budgets: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ReadBudget] = weakref.WeakKeyDictionary()


def read_budget_for_loop(loop: asyncio.AbstractEventLoop) -> ReadBudget:
    """The :class:`ReadBudget` of ``loop``, created on first use."""
    budget = _budgets.get(loop)
    if budget is None:
        budget = _budgets[loop] = ReadBudget(loop)
    return budget


def pace(ws: Any) -> None:
    """Put a :class:`PacedProtocol` between a ``websockets`` connection and its
    transport (on the running loop). Does nothing when the transport cannot
    report or pause its reading (then the connection reads as before)."""
    transport = getattr(ws, "transport", None)
    if transport is None or not hasattr(transport, "is_reading") or transport.get_protocol() is not ws:
        return
    budget = read_budget_for_loop(asyncio.get_running_loop())
    transport.set_protocol(PacedProtocol(ws, transport, budget))
