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

import _thread
import asyncio
import gc
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AUTO_GC_ENV",
    "FLEET_GC_ENGAGE_AT",
    "FLEET_GC_RELEASE_BELOW",
    "FLEET_GC_THRESHOLDS",
    "FleetGcPolicy",
    "GcTuning",
    "auto_policy",
    "host_connection",
    "release_connection",
    "tune_gc_for_fleet",
]

#: ``gc.set_threshold`` values used by :func:`tune_gc_for_fleet` and the automatic
#: policy: gen 0 after this many net allocations (default 700), gen 1 after this
#: many gen-0 collections (10), gen 2 after this many gen-1 collections (10).
#: Why 100000 for gen 0: a lockstep round at N=1024 holds ~20-60 tracked objects
#: per step in flight (tasks, futures, frames of the calls), so 20000 was crossed
#: 1-3 times in every round, each time walking everything in flight (5 ms on a
#: quiet core, 20-100 ms on a loaded one). A collection's cost is what is alive,
#: not the threshold, so a higher one means fewer collections of about the same
#: cost; the price is cyclic garbage waiting longer (at most this many objects).
FLEET_GC_THRESHOLDS: tuple[int, int, int] = (100_000, 20, 50)


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


# The SDK's own, default-on policy.
#
# While the process's SharedLoops together host at least FLEET_GC_ENGAGE_AT
# open connections, the young-generation thresholds are raised to
# FLEET_GC_THRESHOLDS; once the count falls below FLEET_GC_RELEASE_BELOW the
# interpreter's previous thresholds come back. The gap is hysteresis, so a
# fleet hovering around one number does not flip the collector back and forth.
#
# It deliberately does NOT freeze: gc.freeze() moves every object of the whole
# process (the user's too) into the permanent generation, and the only undo,
# gc.unfreeze(), would also thaw whatever the user froze themselves. Thresholds
# are one process-wide triple the policy can save and put back exactly; and if
# the user changed them meanwhile (or had raised them already, e.g. with
# tune_gc_for_fleet), the policy leaves theirs alone.

#: Environment variable switching the automatic policy: ``auto`` (default) or ``off``.
AUTO_GC_ENV = "SHINKEN_FLEET_GC"
#: Open connections (all SharedLoops of the process together) at which the policy engages.
FLEET_GC_ENGAGE_AT = 64
#: Below this many open connections an engaged policy restores the previous thresholds.
FLEET_GC_RELEASE_BELOW = 32


def _native_lock() -> _thread.LockType:
    """A lock of the native thread kind even under gevent: the loop threads report
    to the policy, and a gevent lock belongs to one hub's thread."""
    monkey = sys.modules.get("gevent.monkey")
    allocate = monkey.get_original("_thread", "allocate_lock") if monkey is not None else _thread.allocate_lock
    lock: _thread.LockType = allocate()
    return lock


class FleetGcPolicy:
    """Raise the collector's thresholds while the process hosts a fleet, restore after.

    Each SharedLoop reports how many open connections it hosts with
    :meth:`report`; the decision is on the process-wide sum. Thread-safe.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        engage_at: int = FLEET_GC_ENGAGE_AT,
        release_below: int = FLEET_GC_RELEASE_BELOW,
        thresholds: tuple[int, int, int] = FLEET_GC_THRESHOLDS,
    ) -> None:
        if not 0 <= release_below <= engage_at:
            raise ValueError(f"need 0 <= release_below <= engage_at, not {release_below}, {engage_at}")
        self.enabled = enabled
        self.engage_at = engage_at
        self.release_below = release_below
        self.thresholds = thresholds
        self._lock = _native_lock()
        self._counts: dict[int, int] = {}
        self._previous: tuple[int, int, int] | None = None  # set while engaged
        self._applied: tuple[int, int, int] | None = None

    @property
    def engaged(self) -> bool:
        return self._previous is not None

    @property
    def connections(self) -> int:
        return sum(self._counts.values())

    def report(self, owner: object, connections: int) -> None:
        """``owner`` (a loop) now hosts ``connections`` open connections; 0 forgets it."""
        with self._lock:
            if connections > 0:
                self._counts[id(owner)] = connections
            else:
                self._counts.pop(id(owner), None)
            for key, loop in list(_LOOPS.items()):  # a loop closed with connections open hosts none
                if loop.is_closed():
                    self._counts.pop(key, None)
                    _LOOPS.pop(key, None)
            total = sum(self._counts.values())
            if self._previous is None:
                if self.enabled and total >= self.engage_at:
                    self._engage()
            elif total < self.release_below or not self.enabled:
                self._release()

    def disable(self) -> None:
        """Switch off, restoring the thresholds at once if engaged."""
        with self._lock:
            self.enabled = False
            if self._previous is not None:
                self._release()

    def _engage(self) -> None:
        current = gc.get_threshold()
        if current[0] == 0 or current[0] >= self.thresholds[0]:
            return  # collection disabled, or the user's own setting is already as lax: leave it
        gc.set_threshold(*self.thresholds)
        self._previous, self._applied = current, gc.get_threshold()

    def _release(self) -> None:
        previous, applied = self._previous, self._applied
        self._previous = self._applied = None
        if previous is not None and gc.get_threshold() == applied:  # else the user has set their own since
            gc.set_threshold(*previous)


def _enabled_from_env() -> bool:
    setting = os.environ.get(AUTO_GC_ENV, "auto").strip().lower()
    if setting not in ("auto", "off", ""):
        raise ValueError(f"{AUTO_GC_ENV} must be auto or off, not {setting!r}")
    return setting != "off"


_AUTO = FleetGcPolicy(enabled=_enabled_from_env())


def auto_policy() -> FleetGcPolicy:
    """The process-wide policy the SharedLoops report to; ``auto_policy().disable()`` switches it off."""
    return _AUTO


_HOSTED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.WeakSet[Any]] = (
    weakref.WeakKeyDictionary()
)
_LOOPS: weakref.WeakValueDictionary[int, asyncio.AbstractEventLoop] = weakref.WeakValueDictionary()


def host_connection(connection: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Count ``connection`` as open on ``loop`` (default: the running loop) and report.

    Called by every new client connection, on its loop; :func:`release_connection`
    when it closes or is lost. Held weakly, so one collected without either drops
    out at the next report. Both are O(1): no timer and no scan of the fleet (a
    periodic recount walked all N connections on the loop every interval).
    """
    loop = loop or asyncio.get_running_loop()
    hosted = _HOSTED.get(loop)
    if hosted is None:
        hosted = _HOSTED[loop] = weakref.WeakSet()
        _LOOPS[id(loop)] = loop
    hosted.add(connection)
    _AUTO.report(loop, len(hosted))


def release_connection(connection: Any, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """``connection`` closed or was lost: stop counting it and report. Idempotent."""
    loop = loop or asyncio.get_running_loop()
    hosted = _HOSTED.get(loop)
    if hosted is None or connection not in hosted:
        return
    hosted.discard(connection)
    _AUTO.report(loop, len(hosted))
