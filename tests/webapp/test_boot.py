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
