"""A session server process's boot-time objects, out of the cycle collector's way.

A server process allocates most of its long-lived objects while it boots (modules, the
tokenizer's tables, the Flask app, the session core), and every full (generation 2) collection
then walks them all again: ~20 ms per collection in a session worker, a stall of every request
on its hub (a small chat at ~20 ms where it otherwise takes 2-3 ms; docs/benchmarks.md section
42). :func:`freeze_boot_objects` moves what exists at the end of boot into the collector's
permanent generation (``gc.freeze``): reference counting still frees those objects, only the
cycle collector stops scanning them. Objects made later -- sessions, their state, requests --
are collected as before, so a deleted session's cycles are never kept.

:func:`raise_young_threshold` makes the young-generation collections of the HTTP process (the
whole server at ``--workers 0``) rarer. At the interpreter's default (a collection every 700
net allocations) a small chat paid 44-65 us of its ~1.2 ms of CPU to the collector: a turn keeps
what it builds (the conversation's messages, ids and records live as long as the session), so
every collection walks the young turns' containers and the generation-1 ones walk them again,
and finds almost nothing (the load's only cyclic garbage is ~9 objects per request, werkzeug's
URL matcher's recursive closure). At 10,000 the same load pays 10-14 us per chat, in one
collection of ~5 ms every few hundred chats (docs/benchmarks.md section 47).
"""

from __future__ import annotations

import gc
import logging

__all__ = ["YOUNG_THRESHOLD", "freeze_boot_objects", "raise_young_threshold"]

log = logging.getLogger(__name__)

#: Net allocations between young-generation collections in a server's HTTP process (the
#: interpreter's default is 700); the older generations' thresholds stay the interpreter's.
YOUNG_THRESHOLD = 10_000


def freeze_boot_objects(who: str) -> int:
    """Collect the boot's own garbage, then freeze every object left; returns how many are
    frozen. Call once, when ``who`` (a process's name, for the log line) has booted and before
    it serves."""
    gc.collect()  # what the boot left as garbage would otherwise be kept for good
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d boot objects frozen out of the cycle collector", who, frozen)
    return frozen


def raise_young_threshold(who: str, threshold: int = YOUNG_THRESHOLD) -> None:
    """Collect the young generation after ``threshold`` net allocations instead of the
    interpreter's 700 (never lowers it); the other two thresholds are left as they are."""
    current = gc.get_threshold()
    if current[0] and current[0] < threshold:  # 0: the collector is off, and stays off
        gc.set_threshold(threshold, *current[1:])
        log.info("%s: young-generation collections every %d net allocations", who, threshold)
