"""Scatter lists for the gathered writes (``sendmsg``, ``writev``, ``pwritev``): what the server
sends or writes as pieces goes out from the pieces themselves, never joined into one copy first.

Every gathered write can take fewer bytes than it was offered; :func:`advance` is the one place
that moves a scatter list past what a call took, so the five writers (the engine request's
pieces, the worker pipe's frames, a records body's batches, the journal's appends) resume alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = ["IOV_MAX", "advance", "views"]

#: buffers per gathered call (Linux's UIO_MAXIOV; a larger list is an EINVAL)
IOV_MAX: int = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def views(buffers: Iterable[Any]) -> list[memoryview]:
    """Byte views of ``buffers`` (anything with the buffer protocol), the empty ones left out:
    a gathered call that is offered only empty buffers takes 0 bytes, which reads as a stall."""
    return [memoryview(b).cast("B") for b in buffers if len(b)]


def advance(buffers: list[memoryview], first: int, taken: int) -> int:
    """The index of the first view still to send once a call took ``taken`` bytes from
    ``buffers[first:]``; a view taken in part is replaced, in place, by its rest."""
    while taken:
        size = len(buffers[first])
        if taken < size:
            buffers[first] = buffers[first][taken:]
            break
        taken -= size
        first += 1
    return first
