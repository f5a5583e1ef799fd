"""The standard library's own functions, as they were before any gevent monkey-patching.

The blocking face runs inside users' gevent-patched processes, where some functions behave
differently from what this package's threads and child-process plumbing rely on:

- threads and locks become greenlets and greenlet locks (the SharedLoop thread must be a real
  thread, its cross-thread locks real locks);
- ``os.close`` (gevent 25.8.1 and later) defers closing a pipe or socket to the hub's next loop
  iteration. A provider that closes its end of a pipe so a child reads EOF, then waits for the
  child, can wait for as long as nothing else wakes the hub: the child never saw the EOF.
  :func:`close_now` closes at once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["close_now", "native"]


def native(module: str, name: str) -> Any:
    """``module.name`` as it was before any gevent monkey-patching."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None:
        return monkey.get_original(module, name)
    return getattr(importlib.import_module(module), name)


close_now: Callable[[int], None] = native("os", "close")
"""``os.close`` that closes now, under gevent too (a pipe's other end sees EOF at once)."""
