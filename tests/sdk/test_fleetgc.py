"""The opt-in GC setting for fleets: never applied on import, fully undoable.

Each check runs in a fresh interpreter: the collector's state is process-wide.
"""

from __future__ import annotations

import json
import subprocess
import sys

from shinken_sync.fleetgc import FLEET_GC_THRESHOLDS


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_importing_and_using_the_sdk_leaves_the_collector_alone():
    state = _run(
        "import gc, json\n"
        "before = [gc.get_threshold(), gc.get_freeze_count()]\n"
        "import shinken_sync, shinken_sync.sync, shinken_sync.client, shinken_sync.fleetgc\n"
        "from shinken_sync.sharedloop import SharedLoop\n"
        "loop = SharedLoop(); loop.loop; loop.close()\n"
        "print(json.dumps({'before': before, 'after': [gc.get_threshold(), gc.get_freeze_count()]}))\n"
    )
    # unchanged, not zero: some interpreters (3.12 in a venv) start with objects frozen already
    assert state["after"] == state["before"]


def test_tune_freezes_the_live_heap_raises_thresholds_and_undo_restores_both():
    state = _run(
        "import gc, json, shinken_sync\n"
        "keep = [[i] for i in range(5000)]  # a 'connected fleet' of long-lived objects\n"
        "default = gc.get_threshold()\n"
        "tuning = shinken_sync.tune_gc_for_fleet()\n"
        "tuned = [gc.get_threshold(), gc.get_freeze_count(), tuning.frozen_objects]\n"
        "tuning.undo()\n"
        "print(json.dumps({'default': default, 'tuned': tuned, 'undone': [gc.get_threshold(), gc.get_freeze_count()],\n"
        "                  'previous': tuning.previous_thresholds}))\n"
    )
    threshold, frozen, reported = state["tuned"]
    assert tuple(threshold) == FLEET_GC_THRESHOLDS
    assert frozen >= 5000 and reported == frozen
    assert state["undone"] == [state["default"], 0]
    assert state["previous"] == state["default"]


def test_thresholds_none_only_freezes():
    state = _run(
        "import gc, json\n"
        "from shinken_sync.fleetgc import tune_gc_for_fleet\n"
        "default = gc.get_threshold()\n"
        "tune_gc_for_fleet(thresholds=None)\n"
        "print(json.dumps({'default': default, 'now': gc.get_threshold(), 'frozen': gc.get_freeze_count()}))\n"
    )
    assert state["now"] == state["default"] and state["frozen"] > 0
