"""A server process's boot objects frozen out of the cycle collector (``webapp.gcboot``)."""

from __future__ import annotations

import json

from tests.support import clean_stdout, run_script


def test_boot_objects_leave_the_collector_and_later_cycles_are_still_collected() -> None:
    result = run_script("""
        import gc, json, weakref
        from webapp.gcboot import freeze_boot_objects

        boot = [[i] for i in range(50_000)]  # what a boot leaves: tables, modules (lists: tracked)
        tracked = len(gc.get_objects())
        frozen = freeze_boot_objects("test")

        class Node:
            pass
        later = Node()
        later.self = later  # a cycle made after boot: still the collector's
        alive = weakref.ref(later)
        del later
        gc.collect()
        print(json.dumps({"frozen": frozen, "tracked_before": tracked, "tracked_after": len(gc.get_objects()),
                          "later_collected": alive() is None}))
    """)
    assert result.returncode == 0, result.stderr
    got = json.loads(clean_stdout(result).splitlines()[-1])
    assert got["frozen"] >= 50_000
    assert got["tracked_after"] < got["tracked_before"] - 50_000  # a full collection walks none of them
    assert got["later_collected"]


def test_the_young_threshold_is_raised_never_lowered_and_a_disabled_collector_stays_off() -> None:
    result = run_script("""
        import gc, json
        from webapp.gcboot import YOUNG_THRESHOLD, raise_young_threshold

        got = {}
        gc.set_threshold(700, 11, 12)
        raise_young_threshold("test")
        got["default"] = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD * 10, 20, 50)  # already higher (an operator's own): kept
        raise_young_threshold("test")
        got["higher"] = gc.get_threshold()
        gc.set_threshold(0)
        raise_young_threshold("test")
        got["off"] = gc.get_threshold()[0]
        print(json.dumps({"got": got, "young": YOUNG_THRESHOLD}))
    """)
    assert result.returncode == 0, result.stderr
    out = json.loads(clean_stdout(result).splitlines()[-1])
    young = out["young"]
    assert young > 700
    assert out["got"] == {"default": [young, 11, 12], "higher": [young * 10, 20, 50], "off": 0}
