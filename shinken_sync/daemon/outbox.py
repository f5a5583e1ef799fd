"""One connection's send queue: ordering, RTT emulation and backpressure.

Everything the daemon sends on a connection (hello, replies, frames,
stream_end) goes through its :class:`Outbox`. One sender task drains it in FIFO
order, so replies keep the order of their calls whatever produced them.

``--rtt-ms`` is emulated here: each message is stamped ``due = enqueue time +
delay`` and the sender holds it until then. The worker that produced it is not
held, so calls queued behind it keep being processed while earlier replies are
"in flight" -- pipelining gains what it would gain over a WAN.

Two kinds of producers, two backpressure rules:

* replies (:meth:`Outbox.put`) wait while more than :data:`HIGH_WATER` bytes
  are queued, which in turn stops the worker and then the reader: a client
  that does not read its replies slows itself down and nobody else;
* screencast frames (:meth:`Outbox.offer`) are dropped instead while more than
  :data:`FRAME_DROP_WATER` bytes are queued: a stalled viewer misses frames
  (and sees the ``seq`` gap) rather than growing the daemon's memory.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable

from websockets.exceptions import ConnectionClosed

log = logging.getLogger("shinkend.outbox")

Message = str | bytes

#: Queued bytes above which a reply producer waits.
HIGH_WATER = 8 * 2**20
#: Queued bytes above which a screencast frame is dropped instead of queued.
FRAME_DROP_WATER = 1 * 2**20


class Outbox:
    def __init__(self, send: Callable[[Message], Awaitable[None]], delay_s: float = 0.0) -> None:
        """``send`` is the connection's ``async send(message)``."""
        self._send = send
        self._delay = delay_s
        self._queue: collections.deque[tuple[float, Message]] = collections.deque()
        self._bytes = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._loop = asyncio.get_running_loop()
        self.closed = False

    @property
    def congested(self) -> bool:
        return self.closed or self._bytes > FRAME_DROP_WATER

    async def put(self, message: Message) -> None:
        """Queue a message; wait while the queue is over its high-water mark.
        Returns at once (dropping the message) once the connection is closed."""
        while self._bytes > HIGH_WATER and not self.closed:
            self._room.clear()
            await self._room.wait()
        self._append(message)

    def put_nowait(self, message: Message) -> None:
        """Queue a small control message (``stream_end``) without waiting."""
        self._append(message)

    def offer(self, message: Message) -> bool:
        """Queue a droppable message (a frame) unless the connection is congested."""
        if self.congested:
            return False
        self._append(message)
        return True

    def _append(self, message: Message) -> None:
        if self.closed:
            return
        self._queue.append((self._loop.time() + self._delay, message))
        self._bytes += len(message)
        self._wake.set()

    async def run(self) -> None:
        """The sender task: send each message once it is due, in order."""
        try:
            while True:
                while not self._queue:
                    self._wake.clear()
                    await self._wake.wait()
                due, message = self._queue[0]
                hold = due - self._loop.time()
                if hold > 0:
                    await asyncio.sleep(hold)
                self._queue.popleft()
                self._bytes -= len(message)
                if self._bytes <= HIGH_WATER:
                    self._room.set()
                await self._send(message)
        except ConnectionClosed:
            pass
        finally:
            self.close()

    def close(self) -> None:
        """Drop what is queued and release waiting producers."""
        self.closed = True
        self._queue.clear()
        self._bytes = 0
        self._room.set()
