"""Blocking I/O off the gevent hub: a long syscall in a thread of a gevent thread pool.

Under gevent (the gunicorn worker, a session worker) a blocking call made by one greenlet
stops every other greenlet of the process until it returns: a 64 MiB journal append, an
``fsync``, a multi-GiB ``sendfile``. :func:`run_blocking` makes such a call in a thread instead,
so the calling greenlet waits while the others run (the syscall releases the GIL). Without
gevent it simply calls. Small calls should not use it: the hand-off costs tens of microseconds.

Each *lane* has a pool of its own, so one kind of work cannot starve another: records GETs to
slow clients (``send``) never hold up journal appends (``journal``) in the single-process app.
A lane's threads may also run at a lower CPU priority (a higher ``nice``): a bulk copy then takes
the CPU the turns leave over instead of an equal share of it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

__all__ = ["LANES", "Lane", "gevent_active", "run_blocking"]

T = TypeVar("T")


class Lane(NamedTuple):
    threads: int  # a lane's calls past this many wait for a thread
    nice: int  # added to the process's nice value in each of its threads (Linux: per thread)


LANES = {
    # Multi-GiB records GETs: on a busy host the turns come first; the copy uses what is left.
    "send": Lane(threads=32, nice=5),
    # A turn's own append waits on it: the same priority as the turn.
    "journal": Lane(threads=8, nice=0),
    # The viewer's timeline builds (webapp.viewer_data): CPU for a page view, after the turns.
    "viewer": Lane(threads=2, nice=5),
}
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

        pool = _pools[lane] = ThreadPool(LANES[lane].threads)
    nice = LANES[lane].nice
    call = pool.spawn(_in_lane_thread, nice, fn, args) if nice else pool.spawn(fn, *args)
    try:
        result: T = call.get()  # gevent: Any
    except BaseException:
        # The caller was interrupted (killed, a gevent.Timeout) while ``fn`` may still run in
        # the thread with the caller's descriptors: the caller's cleanup would close them under
        # it, and a closed descriptor's number goes to the next open, so the thread would read or
        # write another file or socket. The caller leaves only once the thread is done; every
        # lane's call is bounded (a send slice, one append).
        _join_uninterrupted(call)
        raise
    return result


def _join_uninterrupted(call: Any) -> None:
    """Wait for ``call`` (a thread pool's result) to finish, whatever is raised into the waiter."""
    while not call.ready():
        with contextlib.suppress(BaseException):  # a second interruption: the caller re-raises the first
            call.wait()


def _in_lane_thread(nice: int, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    # Two syscalls per call (the calls are multi-MiB copies): no per-thread state to keep right
    # across pool threads that come and go. The main thread's nice (the pid's) is the base.
    tid, want = threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice
    if os.getpriority(os.PRIO_PROCESS, tid) != want:
        os.setpriority(os.PRIO_PROCESS, tid, want)  # a thread may always lower its own priority
    return fn(*args)
