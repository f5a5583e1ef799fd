"""The fleet gates CI guards: every invariant verdict both ways, and the drills on a small fleet.

``bench/fleet_gates.py`` turns a fleet report into PASS/FAIL rows. The unit
tests below feed it made-up reports that pass and that fail each invariant
(so a gate that could never fail would fail here). The integration test runs
the three drills for real on a small fleet with short periods and checks that
every *invariant* gate passes on the real report; timing gates (loop lag,
round ratios, convergence time) are printed by the bench and not asserted.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import fleet_gates as fg

FLEET = Path(__file__).resolve().parents[2] / "bench" / "fleet.py"


def verdicts(gates: list[dict[str, Any]]) -> dict[str, str]:
    return {g["gate"]: g["verdict"] for g in gates}


def a_run(**over: Any) -> dict[str, Any]:
    run = {
        "n": 1024, "face": "async", "transport": "websockets", "actions_per_step": 1, "rounds": 20,
        "step_outcomes": {"ok": 20480}, "connect_errors": {}, "marginal_rss_connect_bytes": 20 << 10,
        "marginal_rss_steady_bytes": 90 << 10, "frames_evicted": 0, "round_wall_s": {"p50": 0.3, "p95": 0.4},
        "loop_lag_s": {"p99": 0.012}, "sustained_1hz": True, "late_rounds": 0, "client_cpu_ms_per_step": 0.12,
    }  # fmt: skip
    run.update(over)
    return run


def a_stall(**phase_over: Any) -> dict[str, Any]:
    phase = {
        "used_within_budget": True, "budget_used_max_bytes": 100 << 20, "budget_limit_bytes": 256 << 20,
        "evicted_stalled": 50, "evicted_others": 0, "others_round_p50_ratio": 1.0, "client_cpu_ms_per_step": 0.5,
    }  # fmt: skip
    tight = {**phase, **phase_over}
    return {"n": 256, "phases": {"baseline": dict(phase), "stalled_256MiB": dict(phase), "stalled_tight_budget": tight}}


def a_storm(**over: Any) -> dict[str, Any]:
    storm = {
        "n": 256, "killed": 64, "recovered": 64, "convergence_s": 1.5, "survivors_round_p50_ratio": 1.0,
        "step_outcomes": {"ok": 5000, "observe_connection_lost": 64}, "loss_outcomes": {"connection_lost": 64},
    }  # fmt: skip
    storm.update(over)
    return storm


def a_keepalive(max_on: int = 8, pings_on: int = 600) -> dict[str, Any]:
    def phase(jitter: float, max_per_tick: int, pings: int) -> dict[str, Any]:
        return {"ping_jitter_s": jitter, "connected": 256, "pings": pings, "max_pings_per_tick": max_per_tick,
                "target_max_per_tick": fg.keepalive_target(256), "min_periods": 2}  # fmt: skip

    return {"n": 256, "jitter_off": phase(0.0, 45, 768), "jitter_on": phase(10.0, max_on, pings_on)}


def test_a_good_report_passes_every_gate_and_exits_zero():
    gates = fg.evaluate_gates([a_run()], {"stall": a_stall(), "storm": a_storm(), "keepalive": a_keepalive()}, 150)
    assert {g["verdict"] for g in gates} == {"PASS"}, [g for g in gates if g["verdict"] != "PASS"]
    assert fg.exit_status(gates) == 0
    assert {g["kind"] for g in gates} == {fg.INVARIANT, fg.TIMING}


@pytest.mark.parametrize(
    ("drills", "gate"),
    [
        ({"stall": a_stall(used_within_budget=False)}, "stall[stalled_tight_budget]: used <= budget"),
        ({"stall": a_stall(evicted_others=3)}, "stall[stalled_tight_budget]: evictions confined to stalled"),
        ({"stall": a_stall(evicted_stalled=0, evicted_others=0)}, "stall: the tight budget evicted"),
        ({"storm": a_storm(recovered=63)}, "storm: every victim recovers"),
        ({"storm": a_storm(killed=0, recovered=0)}, "storm: every victim recovers"),
        ({"storm": a_storm(step_outcomes={"ok": 5000, "observe_sandbox_died": 1})},
         "storm: no disconnected sandbox reported dead"),
        ({"storm": a_storm(loss_outcomes={"connection_lost": 63, "sandbox_died": 1})},
         "storm: no disconnected sandbox reported dead"),
        ({"keepalive": a_keepalive(max_on=26)}, "keepalive burst <= N/10 per tick (jitter on)"),
        ({"keepalive": a_keepalive(pings_on=100)}, "keepalive[jitter on]: every connection pinged"),
    ],
)  # fmt: skip
def test_each_drill_invariant_fails_when_broken(drills, gate):
    gates = fg.evaluate_gates([], drills, 150)
    assert verdicts(gates)[gate] == "FAIL"
    assert fg.exit_status(gates) == 1
    # and only that invariant (plus what depends on it) turned
    assert all(g["verdict"] != "FAIL" or g["gate"] == gate for g in gates if g["kind"] == fg.INVARIANT)


def test_keepalive_at_the_bound_passes():
    assert verdicts(fg.evaluate_gates([], {"keepalive": a_keepalive(max_on=25)}, 150))[
        "keepalive burst <= N/10 per tick (jitter on)"
    ] == "PASS"


@pytest.mark.parametrize(
    ("over", "gate"),
    [
        ({"step_outcomes": {"ok": 20479, "observe_connection_lost": 1}}, "every step ok"),
        ({"connect_errors": {"ConnectError": 1}}, "every step ok"),
        ({"marginal_rss_steady_bytes": 2 << 20}, "marginal RSS <= 1 MiB/sandbox"),
        ({"frames_evicted": 1}, "zero evictions under pull"),
        ({"loop_lag_s": {"p99": 0.021}}, "loop lag p99 < 20 ms (1 action(s) + observe)"),
        ({"actions_per_step": 5, "loop_lag_s": {"p99": 0.051}}, "loop lag p99 < 50 ms (5 action(s) + observe)"),
        ({"client_cpu_ms_per_step": 0.151}, "client CPU per step"),
        ({"transport": "fast", "client_cpu_ms_per_step": 0.101}, "client CPU per step"),
        ({"sustained_1hz": False}, "sustained 1 Hz rounds"),
    ],
)  # fmt: skip
def test_each_run_gate_fails_when_broken(over, gate):
    gates = fg.evaluate_gates([a_run(**over)], {}, 150)
    assert verdicts(gates)[gate] == "FAIL"
    assert fg.exit_status(gates) == 1


def test_a_crashed_run_or_drill_fails():
    gates = fg.evaluate_gates([{"n": 64, "face": "sync", "error": "boom"}], {"storm": {"n": 8, "error": "x"}}, 150)
    assert [g["verdict"] for g in gates] == ["FAIL", "FAIL"]


def test_the_5_action_lag_target_is_looser_and_small_n_has_no_n1024_gates():
    gates = fg.evaluate_gates([a_run(actions_per_step=5, loop_lag_s={"p99": 0.030})], {}, 150)
    assert verdicts(gates)["loop lag p99 < 50 ms (5 action(s) + observe)"] == "PASS"
    assert "client CPU per step" not in verdicts(gates)  # the CPU target is for 1 action + observe
    small = verdicts(fg.evaluate_gates([a_run(n=8, loop_lag_s={"p99": 9.0})], {}, 150))
    assert not any(name.startswith("loop lag") for name in small)


def test_pings_per_tick_and_deaths_reported():
    assert fg.pings_per_tick([10.0, 10.05, 10.15, 10.99], 10.0, 0.1) == {0: 2, 1: 1, 9: 1}
    assert fg.deaths_reported({"ok": 3, "sandbox_died": 2, "observe_sandbox_died": 1, "connection_lost": 4}) == 3


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_drills_on_a_small_fleet_hold_every_invariant(tmp_path: Path) -> None:
    out = tmp_path / "drills.json"
    proc = subprocess.run(
        [sys.executable, str(FLEET), "--n", "", "--drills", "stall,storm,keepalive", "--drill-n", "40",
         "--rounds", "6", "--period", "0.3", "--rtt-ms", "20", "--keepalive-interval", "1",
         "--keepalive-jitter", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=220, check=False,
    )  # fmt: skip
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    drills = report["drills"]
    assert set(drills) == {"stall", "storm", "keepalive"}
    assert not any("error" in d for d in drills.values()), {k: d.get("error") for k, d in drills.items()}
    invariants = [g for g in report["gates"] if g["kind"] == fg.INVARIANT]
    assert len(invariants) >= 9
    assert all(g["verdict"] in ("PASS", "N/A") for g in invariants), [g for g in invariants if g["verdict"] != "PASS"]
    # the exit status reflects the gates, timing ones included
    assert proc.returncode == fg.exit_status(report["gates"]), proc.stdout[-2000:]
    # re-evaluating the stored report gives the stored verdicts (the bench printed what CI checks)
    assert fg.evaluate_gates([], copy.deepcopy(drills), report["rtt_ms"]) == report["gates"]
    storm = drills["storm"]
    assert storm["killed"] == storm["recovered"] == 10
    assert storm["loss_outcomes"] == {"connection_lost": 10}  # the host said alive: not one death
