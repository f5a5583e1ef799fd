"""The end of a session server process's boot: every process-wide setting, made in one place.

Each server process that serves requests -- a session worker, and the HTTP worker (the router,
or the whole server at ``--workers 0``) -- calls :func:`boot_done` once, when it has booted and
before it serves, so a setting added here reaches every one of them.
"""

from __future__ import annotations

from webapp.allocator import keep_freed_memory
from webapp.gcboot import freeze_boot_objects, raise_young_threshold

__all__ = ["boot_done"]


def boot_done(who: str, *, serves_http: bool = False) -> None:
    """The boot's objects out of the cycle collector (:mod:`webapp.gcboot`; what exists now is
    frozen, so a worker calls this before its sessions load); in the HTTP process
    (``serves_http``: the router, or the whole server at ``--workers 0``) young-generation
    collections made rarer, where they were measured (:func:`webapp.gcboot.raise_young_threshold`);
    then the allocator's thresholds (:mod:`webapp.allocator`). ``who`` names the process in the
    log lines."""
    freeze_boot_objects(who)
    if serves_http:
        raise_young_threshold(who)
    keep_freed_memory(who)
