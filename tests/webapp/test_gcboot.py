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
