"""The end of a session server process's boot: every process-wide setting, made in one place.

Each server process that serves requests -- a session worker, and the HTTP worker (the router,
or the whole server at ``--workers 0``) -- calls :func:`boot_done` once, when it has booted and
before it serves, so a setting added here reaches every one of them.
"""

from __future__ import annotations

from webapp.allocator import keep_freed_memory
from webapp.gcboot import freeze_boot_objects

__all__ = ["boot_done"]


def boot_done(who: str) -> None:
    """The boot's objects out of the cycle collector (:mod:`webapp.gcboot`; what exists now is
    frozen, so a worker calls this before its sessions load), then the allocator's thresholds
    (:mod:`webapp.allocator`). ``who`` names the process in the log lines."""
    freeze_boot_objects(who)
    keep_freed_memory(who)
