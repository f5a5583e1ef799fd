"""A deadline on an awaitable that never swallows a cancellation.

``asyncio.wait_for`` on Python 3.10 and 3.11 returns the awaited result and
drops the ``CancelledError`` when the cancel arrives in the same loop iteration
as the result (CPython gh-86296, fixed in 3.12). In the daemon that meant a
connection's worker survived its cancel and ran the calls queued behind it
after the client had gone. :func:`within` uses ``asyncio.wait``,
which always lets the cancel through, and cancels the inner work with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout: float) -> T:
    """``await aw``, or cancel it and raise ``asyncio.TimeoutError`` after ``timeout`` s."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise asyncio.TimeoutError  # noqa: UP041 (not TimeoutError on 3.10)
    return task.result()
