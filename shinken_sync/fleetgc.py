"""An opt-in garbage-collector setting for processes that drive a fleet.

Never applied on import: the collector is the whole program's, and only the
program knows when its long-lived objects are in place. Call
:func:`tune_gc_for_fleet` once the fleet is connected::

    sandboxes = [connect(url, token=token) for url, token in endpoints]
    tuning = shinken_sync.fleetgc.tune_gc_for_fleet()
    ...                     # the rounds
    tuning.undo()           # optional: back to the interpreter's settings

Why (measured at N=1024, ``bench/fleet.py``): the connections, tasks and
buffers of 1024 sandboxes are ~100k objects the cycle collector tracks. Every
gen-2 collection walks all of them -- 80-130 ms with the loop stopped, several
times per 10 rounds, often inside the send burst -- and finds nothing: they
are alive for the fleet's life. ``gc.freeze()`` moves everything alive now
into the permanent generation, which collections skip; raised thresholds
make the young-generation collections that remain rarer (each step allocates
a few hundred short-lived objects, and the default gen-0 threshold of 700
collects every couple of steps). Cyclic garbage still gets collected, later.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

__all__ = ["FLEET_GC_THRESHOLDS", "GcTuning", "tune_gc_for_fleet"]

#: ``gc.set_threshold`` values used by :func:`tune_gc_for_fleet`: gen 0 after
#: this many net allocations (default 700), gen 1 after this many gen-0
#: collections (10), gen 2 after this many gen-1 collections (10).
FLEET_GC_THRESHOLDS: tuple[int, int, int] = (20_000, 20, 50)


@dataclass(frozen=True)
class GcTuning:
    """What :func:`tune_gc_for_fleet` changed, so :meth:`undo` can put it back."""

    previous_thresholds: tuple[int, int, int]
    frozen_objects: int

    def undo(self) -> None:
        """Restore the thresholds and move the frozen objects back under collection."""
        gc.unfreeze()
        gc.set_threshold(*self.previous_thresholds)


def tune_gc_for_fleet(thresholds: tuple[int, int, int] | None = FLEET_GC_THRESHOLDS) -> GcTuning:
    """Collect once, freeze every surviving object, then raise the thresholds.

    Call it after connecting the fleet (and again after a large reconnect, if
    you like: freezing is cumulative). ``thresholds=None`` only freezes.
    Returns a :class:`GcTuning` whose ``undo()`` reverts both changes.
    """
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    return GcTuning(previous_thresholds=previous, frozen_objects=gc.get_freeze_count())
