"""A session server process's boot-time objects, out of the cycle collector's way.

A server process allocates most of its long-lived objects while it boots (modules, the
tokenizer's tables, the Flask app, the session core), and every full (generation 2) collection
then walks them all again: ~20 ms per collection in a session worker, a stall of every request
on its hub (a small chat at ~20 ms where it otherwise takes 2-3 ms; docs/benchmarks.md section
42). :func:`freeze_boot_objects` moves what exists at the end of boot into the collector's
permanent generation (``gc.freeze``): reference counting still frees those objects, only the
cycle collector stops scanning them. Objects made later -- sessions, their state, requests --
are collected as before, so a deleted session's cycles are never kept.
"""

from __future__ import annotations

import gc
import logging

__all__ = ["freeze_boot_objects"]

log = logging.getLogger(__name__)


def freeze_boot_objects(who: str) -> int:
    """Collect the boot's own garbage, then freeze every object left; returns how many are
    frozen. Call once, when ``who`` (a process's name, for the log line) has booted and before
    it serves."""
    gc.collect()  # what the boot left as garbage would otherwise be kept for good
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d boot objects frozen out of the cycle collector", who, frozen)
    return frozen
