"""A server process keeps its large buffers' memory mapped for the next request (``webapp.allocator``)."""

from __future__ import annotations

import json

import pytest

from tests.support import clean_stdout, run_script

# A screenshot turn's pattern: a few multi-MiB buffers (a body, its text, the URLs' bytes, the
# engine request), all freed before the next turn; page faults per turn after a warm-up.
TURNS = """
    import json, resource, sys
    from webapp.allocator import keep_freed_memory

    applied = keep_freed_memory("test") if sys.argv[1] == "keep" else None

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    for turn in range(10):
        if turn == 5:
            before = faults()
        body = [b"x" * (4 << 20) for _ in range(6)]
        text = body[0].decode("ascii")
        data = text.encode()
        del body, text, data
    print(json.dumps({"applied": applied, "faults_per_turn": (faults() - before) / 5}))
"""


def _turns(mode: str) -> dict[str, object]:
    result = run_script(TURNS, mode)
    assert result.returncode == 0, result.stderr
    got: dict[str, object] = json.loads(clean_stdout(result).splitlines()[-1])
    return got


def test_large_buffers_reuse_mapped_pages_once_kept() -> None:
    default, kept = _turns("default"), _turns("keep")
    if kept["applied"] is not True:
        pytest.skip("not glibc: mallopt is not available")
    pages = (4 << 20) // 4096
    assert isinstance(default["faults_per_turn"], float) and default["faults_per_turn"] > pages  # fresh pages
    assert isinstance(kept["faults_per_turn"], float) and kept["faults_per_turn"] < pages / 8  # reused pages
