"""Smoke run of the screenshot benchmark: ``bench/images.py --sessions 2 --turns 2 --workers 1 --hol``.

Checks that a tiny run completes and reports every figure, and that storing each screenshot
once keeps a session's stored bytes below what its bodies carried. Timings are printed by the
benchmark, never asserted here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

IMAGES_BENCH = Path(__file__).resolve().parents[2] / "bench" / "images.py"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_images_bench_smoke() -> None:
    proc = subprocess.run([sys.executable, str(IMAGES_BENCH), "--sessions", "2", "--turns", "3", "--workers", "1",
                           "--hol"], capture_output=True, text=True, timeout=220, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"workers=1: [\d.]+ turns/s \(6 turns", proc.stdout), proc.stdout
    sent, stored = map(float, re.search(r"sent ([\d.]+) MiB in request bodies, stored ([\d.]+) MiB",
                                        proc.stdout).groups())
    assert stored < sent, proc.stdout
    assert "text probe on shard 0" in proc.stdout and "on shard 1" in proc.stdout, proc.stdout
