"""Bulk work goes last in its process: small requests sharing a gevent hub run first.

A session worker (and the single-process server) runs every request as a greenlet on one hub.
Bulk work -- a multi-MiB body's chunks, an image turn's image work and its engine body -- calls
:func:`bulk_turn` (or :func:`yield_to_chats`) before each heavy step, so a chat woken meanwhile
(its engine reply arrived, its frame came in) runs before it instead of queueing behind it,
while the bulk work still progresses at least every :data:`BULK_MAX_DEFER` seconds.

Imports nothing of the session server: the IPC channel, the router, the engine client and the
image checks all use it.
"""

from __future__ import annotations

import gevent
from gevent import monkey

__all__ = ["BULK_MAX_DEFER", "bulk_turn", "yield_to_chats"]

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


def yield_to_chats() -> None:
    """:func:`bulk_turn` before a large request's heavy step (an image turn's image work, its
    multi-MiB engine body), in a gevent-patched process (a session worker, the single-process
    server); elsewhere (a bare test client, plain threads) nothing.

    A small chat on a worker busy with image turns waited mostly while its engine call was in
    flight: woken by the engine's reply, it ran only after the image turns' CPU steps already
    queued on the hub. An image turn that lets the hub's pending work run first before each of
    those two steps moved that chat's p50 x0.59-0.87 (docs/benchmarks.md, screenshot turns).
    """
    if monkey.is_module_patched("socket"):
        bulk_turn()
