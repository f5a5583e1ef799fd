"""A server process's end of boot makes every process-wide setting (``webapp.boot``)."""

from __future__ import annotations

import json

from tests.support import run_script


def test_boot_done_freezes_the_boot_objects_and_keeps_freed_memory() -> None:
    result = run_script("""
        import gc, json, logging, sys
        from webapp.allocator import _glibc
        from webapp.boot import boot_done

        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        boot = [[i] for i in range(10_000)]  # what a boot leaves (lists: tracked)
        boot_done("test")
        print(json.dumps({"frozen": gc.get_freeze_count(), "glibc": _glibc() is not None}))
    """)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    *logged, last = result.stdout.splitlines()
    got = json.loads(last)
    assert got["frozen"] >= 10_000
    assert any(line.startswith("test: ") and "boot objects frozen out of the cycle collector" in line
               for line in logged), logged
    if got["glibc"]:  # elsewhere the allocator setting does nothing (webapp.allocator)
        assert any(line.startswith("test: malloc keeps freed memory") and line.endswith(": set")
                   for line in logged), logged


def test_only_the_http_process_collects_its_young_generation_less_often() -> None:
    """A session worker keeps the interpreter's young threshold; the HTTP process (the router,
    or the whole server at --workers 0) raises it (webapp.gcboot.raise_young_threshold)."""
    result = run_script("""
        import gc, json
        from webapp.boot import boot_done
        from webapp.gcboot import YOUNG_THRESHOLD

        before = gc.get_threshold()
        boot_done("session worker")
        worker = gc.get_threshold()
        boot_done("http worker", serves_http=True)
        print(json.dumps({"before": before, "worker": worker, "http": gc.get_threshold(),
                          "young": YOUNG_THRESHOLD}))
    """)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.splitlines()[-1])
    assert got["worker"] == got["before"]
    assert got["http"] == [got["young"], *got["before"][1:]] and got["young"] > got["before"][0]
