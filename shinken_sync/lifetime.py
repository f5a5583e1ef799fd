"""Dying with the parent: the one mechanism every process we start uses.

A process we start must not outlive the process that started it, however that
one dies (SIGKILL included: no ``finally`` runs then). Two layers, because each
alone has a hole:

* :func:`die_with_parent` sets ``PR_SET_PDEATHSIG``: the kernel signals the
  child the moment its parent goes. Linux only, and tied to the parent's
  *thread* that forked the child, so fork from a thread that lives as long as
  the parent (the main thread, or one long-lived spawner thread). It is safe as
  a ``preexec_fn`` (``prctl`` is resolved here at import, so nothing is loaded
  between fork and exec) and as the first call in a freshly started child
  (``webapp.worker``). The signal survives ``exec``.
* :func:`watch_parent` polls ``getppid()`` from a daemon thread: portable and
  independent of threads, at most ``interval`` late. For a child whose
  launcher may fork it from a short-lived thread (the reference backend).

Users: ``shinken_sync.providers.process`` (shinkend), ``shinken demo`` (the
session server), ``webapp.serve`` (gunicorn), ``webapp/gunicorn.conf.py`` (the
router worker), ``webapp.worker`` (session workers), ``webapp.reference_backend``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["PARENT_POLL_INTERVAL_S", "die_with_parent", "parent_death_preexec", "watch_parent"]

PARENT_POLL_INTERVAL_S = 1.0
_PR_SET_PDEATHSIG = 1

try:  # resolved in the parent: nothing may be loaded between fork and exec
    _prctl: Callable[..., int] | None = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: watch_parent still works
    _prctl = None


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when ``parent_pid`` (its parent) exits;
    exit at once if it already has (the parent died before ``prctl`` took effect)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def parent_death_preexec(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` making the child die with the calling process (see the module
    docstring for which thread may fork). SIGTERM by default: the child stops in order."""
    return functools.partial(die_with_parent, os.getpid(), sig)


def _watch(parent_pid: int, interval: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(interval)
    os._exit(0)


def watch_parent(parent_pid: int | None = None, interval: float = PARENT_POLL_INTERVAL_S) -> threading.Thread:
    """Start a daemon thread that ends this process once ``parent_pid`` (default: the
    current parent) is no longer its parent."""
    thread = threading.Thread(target=_watch, args=(parent_pid or os.getppid(), interval),
                              name="parent-watch", daemon=True)
    thread.start()
    return thread
