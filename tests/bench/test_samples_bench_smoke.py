"""Smoke run of the samples benchmark: ``bench/samples.py --turns 3 --repeats 1 --workers 0 2``.

Checks that a tiny run completes in both server modes and reports both fetches with their
ratio, and that the GET is the larger body (it carries every turn's R3). Timings are printed
by the benchmark, never asserted here.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SAMPLES_BENCH = Path(__file__).resolve().parents[2] / "bench" / "samples.py"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_samples_bench_smoke() -> None:
    proc = subprocess.run([sys.executable, str(SAMPLES_BENCH), "--turns", "3", "--repeats", "1", "--r3-layers", "4",
                           "--workers", "0", "2"], capture_output=True, text=True, timeout=220, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for workers in (0, 2):
        assert f"--workers {workers}: 3 turns" in proc.stdout, proc.stdout
    sizes = {name: [int(m.replace(",", "")) for m in re.findall(rf"{name} +([\d,]+)", proc.stdout)]
             for name in ("GET records", "POST samples")}
    assert len(sizes["GET records"]) == len(sizes["POST samples"]) == 2
    assert all(g > s > 0 for g, s in zip(sizes["GET records"], sizes["POST samples"]))
    assert proc.stdout.count("ratio GET/samples") == 2
