"""Smoke run of the fleet-gates harness: ``bench/fleet.py --n 8 --rounds 3``.

Checks that a tiny fleet run produces a complete, self-consistent report for
both faces. Timings are printed by the harness, never asserted here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

FLEET = Path(__file__).resolve().parents[2] / "bench" / "fleet.py"
N = 8
ROUNDS = 3

ROUND_FIELDS = {
    "round_wall_s", "observe_latency_s", "loop_lag_s", "rss_before_bytes", "rss_connected_bytes",
    "rss_after_bytes", "marginal_rss_connect_bytes", "marginal_rss_steady_bytes", "threads",
    "fd_high_water", "frames_dropped", "frames_evicted", "budget_limit_bytes", "bytes_received",
    "mbps", "late_rounds", "sustained_1hz", "step_outcomes", "client_cpu_pct", "host_cpu_pct",
    "gc_pause_max_s", "achieved_hz",
}  # fmt: skip


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_fleet_smoke_report(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, str(FLEET), "--n", str(N), "--rounds", str(ROUNDS), "--face", "both",
         "--json", str(out)],
        capture_output=True, text=True, timeout=80, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gates (seed section 7 targets)" in proc.stdout
    report = json.loads(out.read_text())

    runs = report["runs"]
    assert [(r["n"], r["face"]) for r in runs] == [(N, "sync"), (N, "async")], runs
    for run in runs:
        assert "error" not in run, run.get("error")
        assert ROUND_FIELDS <= run.keys(), ROUND_FIELDS - run.keys()
        assert run["connected"] == N and not run["connect_errors"]
        assert run["rounds"] == ROUNDS
        # every sandbox observed once per measured round, every step fully ok
        assert run["step_outcomes"] == {"ok": N * ROUNDS}
        assert run["observations"] == N * ROUNDS
        assert run["observe_latency_s"]["n"] == N * ROUNDS
        assert run["round_wall_s"]["n"] == ROUNDS
        assert 0 < run["round_wall_s"]["p50"] <= run["round_wall_s"]["p95"] <= run["round_wall_s"]["max"]
        assert 0 < run["observe_latency_s"]["p50"] <= run["observe_latency_s"]["p99"]
        assert run["loop_lag_s"]["n"] > 0 and run["loop_lag_s"]["p99"] >= 0
        # a JPEG q80 frame of a 1920x1080 desktop downscaled to 1280: kilobytes, not bytes or megabytes
        assert 1024 < run["frame_bytes_avg"] < 4 * 2**20
        assert run["bytes_received"] == pytest.approx(run["frame_bytes_avg"] * N * ROUNDS)
        assert run["mbps"] > 0
        assert run["rss_before_bytes"] > 0 and run["rss_after_bytes"] > 0
        assert all(math.isfinite(run[k]) for k in ("marginal_rss_connect_bytes", "marginal_rss_steady_bytes"))
        assert run["fd_high_water"] >= N  # one socket per sandbox at least
        assert run["threads"] >= 1
        # pull-based rounds never queue screencast frames, so the budget never acts
        assert run["frames_evicted"] == 0 and run["frames_dropped"] == 0
        assert run["budget_limit_bytes"] == 256 << 20
    assert runs[0]["callers"] == "gevent" and "hub_lag_s" in runs[0]
    assert runs[0]["threads"] >= 2  # the caller's thread and the SharedLoop's

    gates = report["gates"]
    # N=8 is under every N-specific gate; the per-run gates apply to both faces
    per_run = ["every step ok", "marginal RSS <= 1 MiB/sandbox", "zero evictions under pull"]
    assert sorted(g["gate"] for g in gates) == sorted(per_run * 2)
    assert all(g["verdict"] in ("PASS", "FAIL") for g in gates)
    assert {g["run"] for g in gates} == {f"N={N} sync", f"N={N} async"}
