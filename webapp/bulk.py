"""Bulk work goes last in its process: small requests sharing a gevent hub run first.

A session worker (and the single-process server) runs every request as a greenlet on one hub.
Bulk work -- a multi-MiB body's chunks, an image turn's image work and its engine call -- calls
:func:`bulk_turn` before each heavy step, so a chat woken meanwhile (its engine reply arrived,
its frame came in) runs before it instead of queueing behind it, while the bulk work still
progresses at least every :data:`BULK_MAX_DEFER` seconds.

On a worker saturated by image turns the hub is never idle, so that wait alone gives a small
request no precedence: it became ready behind every image turn already queued. So a large
request's CPU work also runs in the process's one :func:`bulk_lane` (a handed-off body's whole
handler in a worker, an image turn's image work anywhere), which it leaves while it waits for
the engine (:func:`bulk_io`) and takes again for the answer's work: image turns queue for the
lane, not on the hub's run queue, and a small request waits for at most the one section
running (docs/benchmarks.md section 42).

Imports nothing of the session server: the IPC channel, the router, the engine client and the
image checks all use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import gevent
import gevent.lock
from gevent import monkey

__all__ = ["BULK_MAX_DEFER", "bulk_io", "bulk_lane", "bulk_turn"]

# Bulk work waits at most this long for the hub to go idle, so small requests sharing the
# process run first but bulk always progresses.
BULK_MAX_DEFER = 0.005


def bulk_turn(max_defer: float = BULK_MAX_DEFER) -> None:
    """Wait until the hub has nothing else to run (at most ``max_defer`` s).

    Called before each chunk of bulk work, it makes multi-GiB bodies the lowest priority in
    their process: a chat's greenlets never queue behind a run of body chunks.
    """
    with gevent.Timeout(max_defer, False):
        gevent.idle()


# A bulk section waits at most this long for the lane, so a section that hangs (or a bug that
# never leaves) costs the others this much, never a deadlock.
LANE_MAX_WAIT = 0.05


class _Lane:
    """The process's one bulk section (per hub): a FIFO semaphore and the greenlet holding it."""

    def __init__(self) -> None:
        self.semaphore = gevent.lock.Semaphore(1)
        self.owner: object | None = None

    def leave(self, greenlet: object) -> None:
        if self.owner is greenlet:
            self.owner = None
            self.semaphore.release()

    def join(self, greenlet: object) -> None:
        """Take the lane for ``greenlet``, waiting at most :data:`LANE_MAX_WAIT` (then go on without)."""
        if self.semaphore.acquire(timeout=LANE_MAX_WAIT):
            self.owner = greenlet


_lanes: dict[object, _Lane] = {}


def _lane() -> _Lane:
    hub = gevent.get_hub()
    lane = _lanes.get(hub)
    if lane is None:
        lane = _lanes[hub] = _Lane()
    return lane


@contextlib.contextmanager
def bulk_lane() -> Iterator[None]:
    """A large request's CPU work, one request's at a time in this process, from here until the
    section ends, except while the request waits on I/O (:func:`bulk_io`: its multi-MiB engine
    call). With several image turns ready at once, at most one of them is queued on the hub
    ahead of a small request that becomes ready; the others wait for the lane off the hub's run
    queue (at most :data:`LANE_MAX_WAIT`). Re-entrant; outside a gevent-patched process, nothing."""
    if not monkey.is_module_patched("socket"):
        yield
        return
    lane, me = _lane(), gevent.getcurrent()
    if lane.owner is me:
        yield
        return
    lane.join(me)
    try:
        bulk_turn()
        yield
    finally:
        lane.leave(me)


@contextlib.contextmanager
def bulk_io() -> Iterator[None]:
    """A large request's wait on I/O (its multi-MiB engine send and the engine's answer): the
    process's small requests first (:func:`bulk_turn`), and the request's :func:`bulk_lane`, if
    it holds it, left meanwhile and taken again after. Outside a gevent-patched process, nothing."""
    if not monkey.is_module_patched("socket"):
        yield
        return
    lane, me = _lane(), gevent.getcurrent()
    held = lane.owner is me
    lane.leave(me)
    bulk_turn()
    try:
        yield
    finally:
        if held:
            lane.join(me)
