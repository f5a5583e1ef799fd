"""A session server process keeps the memory of its large buffers for the next request.

A screenshot turn allocates a handful of multi-megabyte objects and frees them before the
next turn: the body's text, the data URLs cut out of it, their bytes for hashing, the engine
request joined from them (~3.6 MB each at a 20-screenshot history). glibc's ``malloc`` serves
an allocation that large with a fresh ``mmap`` (or grows the heap and gives the top back on
``free`` once more than a trim threshold is free), so every turn's buffers start as untouched
pages: the kernel zero-fills and maps each 4 KiB page on its first write, 0.4-0.9 ms of a
20-screenshot turn's ~5-6 ms of session-core CPU in page faults alone (docs/benchmarks.md
section 45).

:func:`keep_freed_memory` raises both thresholds (``mallopt``) once at boot: allocations up to
:data:`MMAP_THRESHOLD` come from the heap and a freed heap top is returned to the kernel only
past :data:`TRIM_THRESHOLD`, so the next turn's buffers reuse pages that are already mapped.
The price is memory: a process that served large turns keeps up to ``TRIM_THRESHOLD`` of freed
heap (plus what fragmentation holds anyway) instead of unmapping it. Larger allocations (a
100 MiB body) are mapped and unmapped as before.

glibc only (``mallopt`` is its interface); elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import logging

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

log = logging.getLogger(__name__)

# glibc's largest allowed mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, 4 * 1 MiB *
# sizeof(long)): a body's largest piece (a 16 MiB screenshot's URL, the whole ~4 MB body) stays
# under it.
MMAP_THRESHOLD = 32 << 20
# Freed heap kept mapped: a few turns' buffers at once (a w0 process runs several in flight).
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(who: str) -> bool:
    """Set the process's ``malloc`` thresholds (above); True if glibc took them. Call once at
    boot, before serving; ``who`` names the process in the log line."""
    libc = _glibc()
    if libc is None:
        return False
    applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.info("%s: malloc keeps freed memory up to %d MiB (allocations under %d MiB from the heap): %s",
             who, TRIM_THRESHOLD >> 20, MMAP_THRESHOLD >> 20, "set" if applied else "refused by libc")
    return applied


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library's among them
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: musl has mallopt as a stub)
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
