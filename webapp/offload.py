"""Blocking I/O off the gevent hub: a long syscall in a thread of the hub's pool.

Under gevent (the gunicorn worker, a session worker) a blocking call made by one greenlet
stops every other greenlet of the process until it returns: a 64 MiB journal append, an
``fsync``, a multi-GiB ``sendfile``. :func:`run_blocking` makes such a call in a thread of the
hub's pool instead, so the calling greenlet waits while the others run (the syscall releases
the GIL). Without gevent it simply calls. Small calls should not use it: the hand-off to a
thread costs tens of microseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["hub_threadpool", "run_blocking"]

T = TypeVar("T")


def hub_threadpool() -> Any:
    """The gevent hub's thread pool when this process is gevent-patched, else None."""
    try:
        from gevent import monkey
    except ImportError:
        return None
    if not monkey.is_module_patched("socket"):
        return None
    import gevent

    return gevent.get_hub().threadpool


def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a thread of the hub's pool under gevent (exceptions re-raised here)."""
    pool = hub_threadpool()
    return fn(*args) if pool is None else pool.apply(fn, args)
