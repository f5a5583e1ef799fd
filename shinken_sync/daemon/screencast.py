"""Screencast streams: pushed frames with an fps cap, idle suppression and resume.

A :class:`Stream` belongs to its sandbox, not to the connection that started
it. Each tick (``1/fps`` seconds) it reads ``display.change_token()``; when the
token is unchanged since the last frame the tick is idle and nothing happens.
Otherwise the stream takes the next ``seq`` and, if a connection is attached
and not congested, encodes and sends that frame. A frame that could not be
delivered (no connection attached, or the outbox over its drop mark) still
consumes its ``seq`` and counts as *missed*: ``seq`` advances on every frame
the stream would have sent, so after ``resume_screencast`` on another
connection the gap in ``seq`` equals the frames missed in the outage. After a
frame was dropped for congestion, the first tick with room sends the current
screen (with the next ``seq``) even if it did not change again, so a viewer is
never left with a stale picture of an idle screen.

When its connection drops, a stream is detached and kept for the grace period
(``--stream-grace``, default 60 s); unresumed by then, it ends. A resume sends
a fresh frame at once (the client's view is stale). Resuming a stream that is
still attached to another connection moves it: the old connection gets
``stream_end`` with reason ``moved`` (its client may not know yet that it is
half-dead).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any

from shinken_sync.protocol import ERR_FAILED, ERR_NOT_FOUND, MAX_MESSAGE_SIZE, encode_frame, encode_stream_end

from .display.base import Display
from .errors import VerbError
from .outbox import Outbox

log = logging.getLogger("shinkend.screencast")

#: Streams one sandbox may hold at once (attached or in their grace period).
MAX_STREAMS_PER_SANDBOX = 8
DEFAULT_GRACE_S = 60.0


@dataclass(frozen=True)
class StreamParams:
    fps: float
    format: str
    quality: int
    max_long_edge: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "fps": self.fps,
            "format": self.format,
            "quality": self.quality,
            "max_long_edge": self.max_long_edge,
        }


class Stream:
    def __init__(self, stream_id: str, params: StreamParams, display: Display, registry: StreamRegistry):
        self.id = stream_id
        self.params = params
        self.seq = 0
        #: Frames that took a seq but were not handed to a connection since the
        #: last start/resume.
        self.missed = 0
        self.outbox: Outbox | None = None
        self._display = display
        self._registry = registry
        self._task: asyncio.Task[None] | None = None
        self._expiry: asyncio.TimerHandle | None = None

    # -- lifecycle (called by the registry) --------------------------------

    def attach(self, outbox: Outbox, params: StreamParams) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        self.outbox = outbox
        self.params = params
        self.missed = 0
        self._restart()

    def detach(self, grace_s: float) -> None:
        self.outbox = None
        self._expiry = asyncio.get_running_loop().call_later(grace_s, self._registry.expire, self.id)

    def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self._task is not None:
            self._task.cancel()

    def _restart(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.ensure_future(self._run())

    # -- the frame loop -----------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = 1.0 / self.params.fps
        last_token: Any = object()  # the first tick always sends
        # A missed frame leaves the viewer's picture stale: once the connection
        # can take frames again, send the current screen even if unchanged.
        stale = False
        next_tick = loop.time()
        try:
            while True:
                token = await self._display.change_token()
                if token != last_token or (stale and self._can_deliver()):
                    last_token = token
                    self.seq += 1
                    stale = not await self._deliver()
                    if stale:
                        self.missed += 1
                next_tick += interval
                delay = next_tick - loop.time()
                if delay < 0:  # fell behind (slow encode): skip ticks, don't burst
                    next_tick, delay = loop.time(), 0.0
                await asyncio.sleep(delay)
        except Exception as exc:
            log.exception("stream %s failed", self.id)
            self._registry.end(self.id, "error", detail=str(exc))

    def _can_deliver(self) -> bool:
        return self.outbox is not None and not self.outbox.congested

    async def _deliver(self) -> bool:
        outbox = self.outbox
        if outbox is None or outbox.congested:
            return False
        p = self.params
        image = await self._display.screenshot(format=p.format, quality=p.quality, max_long_edge=p.max_long_edge)
        meta = {**image.meta(), "ts": time.time()}
        message = encode_frame(self.id, self.seq, meta, image.data)
        if len(message) > MAX_MESSAGE_SIZE:  # the client would close with 1009: a missed frame instead
            log.warning("stream %s: a %d-byte frame exceeds the message limit; lower max_long_edge", self.id,
                        len(message))  # fmt: skip
            return False
        # The outbox may have been swapped or closed while encoding.
        return self.outbox is outbox and outbox.offer(message)


class StreamRegistry:
    """The streams of one sandbox, keyed by stream id."""

    def __init__(self, display: Display, grace_s: float = DEFAULT_GRACE_S):
        self._display = display
        self._grace = grace_s
        self._streams: dict[str, Stream] = {}
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4).hex()

    def start(self, outbox: Outbox, params: dict[str, Any]) -> dict[str, Any]:
        if len(self._streams) >= MAX_STREAMS_PER_SANDBOX:
            raise VerbError(f"this sandbox already has {MAX_STREAMS_PER_SANDBOX} screencast streams", ERR_FAILED)
        stream_id = f"s{self._prefix}-{next(self._ids)}"
        stream = Stream(stream_id, StreamParams(**params), self._display, self)
        self._streams[stream_id] = stream
        stream.attach(outbox, stream.params)
        return {"stream_id": stream_id, **stream.params.as_dict()}

    def stop(self, stream_id: str) -> dict[str, Any]:
        stream = self._get(stream_id)
        last_seq = stream.seq
        self.end(stream_id, "stopped")
        return {"stream_id": stream_id, "last_seq": last_seq}

    def resume(self, outbox: Outbox, stream_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        stream = self._get(stream_id)
        previous = stream.outbox
        if previous is not None and previous is not outbox:
            previous.put_nowait(encode_stream_end(stream_id, "moved", stream.seq))
        last_seq, missed = stream.seq, stream.missed
        params = replace(stream.params, **{k: v for k, v in changes.items() if v is not None})
        stream.attach(outbox, params)
        return {"stream_id": stream_id, "last_seq": last_seq, "missed": missed, **params.as_dict()}

    def detach_outbox(self, outbox: Outbox) -> None:
        """The connection behind ``outbox`` closed: its streams wait for a resume."""
        for stream in self._streams.values():
            if stream.outbox is outbox:
                stream.detach(self._grace)

    def end(self, stream_id: str, reason: str, detail: str = "") -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        stream.stop()
        if stream.outbox is not None:
            stream.outbox.put_nowait(encode_stream_end(stream_id, reason, stream.seq))
        log.info("stream %s ended (%s%s) at seq %d", stream_id, reason, f": {detail}" if detail else "", stream.seq)

    def expire(self, stream_id: str) -> None:
        self.end(stream_id, "closed", detail="grace period over")

    def close(self) -> None:
        for stream_id in list(self._streams):
            self.end(stream_id, "closed")

    def _get(self, stream_id: str) -> Stream:
        try:
            return self._streams[stream_id]
        except KeyError:
            raise VerbError(f"no screencast stream {stream_id!r} (stopped, expired or never started)",
                            ERR_NOT_FOUND) from None
