"""Blocking I/O off the gevent hub: a long syscall in a thread of a gevent thread pool.

Under gevent (the gunicorn worker, a session worker) a blocking call made by one greenlet
stops every other greenlet of the process until it returns: a 64 MiB journal append, an
``fsync``, a multi-GiB ``sendfile``. :func:`run_blocking` makes such a call in a thread instead,
so the calling greenlet waits while the others run (the syscall releases the GIL). Without
gevent it simply calls. Small calls should not use it: the hand-off costs tens of microseconds.

Each *lane* has a pool of its own, so one kind of work cannot starve another: records GETs to
slow clients (``send``) never hold up journal appends (``journal``) in the single-process app.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["LANES", "gevent_active", "run_blocking"]

T = TypeVar("T")
LANES = {"send": 32, "journal": 8}  # lane -> threads; a lane's calls past that wait for a thread
_pools: dict[str, Any] = {}


def gevent_active() -> bool:
    """True when this process is gevent-patched (blocking calls would stop its hub)."""
    try:
        from gevent import monkey
    except ImportError:
        return False
    return bool(monkey.is_module_patched("socket"))


def run_blocking(lane: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a thread of ``lane``'s pool under gevent (exceptions re-raised here)."""
    if not gevent_active():
        return fn(*args)
    pool = _pools.get(lane)
    if pool is None:
        from gevent.threadpool import ThreadPool

        pool = _pools[lane] = ThreadPool(LANES[lane])
    return pool.apply(fn, args)
