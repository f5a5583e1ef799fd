"""The fleet bench's drivers: long-lived sync callers, the async face's loop, the per-turn tracer.

``Callers.each_round`` gives each position the same greenlet every round (as a
training loop keeps its env workers); ``--spawn-callers`` keeps a new greenlet
per step. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench imports its siblings as top-level modules

gevent = pytest.importorskip("gevent")

from fleet_faces import Callers


def _round(callers: Callers, n: int) -> list[object]:
    seen: list[object] = [None] * n

    def step(i: int) -> None:
        gevent.sleep(0)  # every caller is in flight at once, as in a round
        seen[i] = gevent.getcurrent()

    callers.each_round(step, list(range(n)))
    return seen


def test_each_position_keeps_its_greenlet_across_rounds() -> None:
    callers = Callers("gevent", 4)
    try:
        first, second = _round(callers, 4), _round(callers, 4)
        assert len(set(map(id, first))) == 4  # one caller per position
        assert first == second  # the same ones next round
    finally:
        callers.close()


def test_spawn_callers_starts_new_greenlets_every_round() -> None:
    callers = Callers("gevent", 4, spawn_each_round=True)
    try:
        first, second = _round(callers, 4), _round(callers, 4)
        assert not set(map(id, first)) & set(map(id, second))
    finally:
        callers.close()


def test_a_failing_step_is_raised_and_its_caller_serves_the_next_round() -> None:
    callers = Callers("gevent", 3)
    done: list[int] = []
    failures = [1]  # position 1 fails once

    def step(i: int) -> None:
        if i in failures:
            failures.remove(i)
            raise ValueError("step failed")
        done.append(i)

    try:
        with pytest.raises(ValueError, match="step failed"):
            callers.each_round(step, [0, 1, 2])
        callers.each_round(step, [0, 1, 2])
        assert sorted(done) == [0, 0, 1, 2, 2]
    finally:
        callers.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_trace_turns_reports_both_faces_loops(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "fleet.py"), "--n", "8", "--rounds", "2", "--face", "both",
         "--no-floor", "--trace-turns", "--json", str(out)],
        capture_output=True, text=True, timeout=80, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loop turns" in proc.stdout
    for run in json.loads(out.read_text())["runs"]:
        assert run["turns_traced"] is True and run["turns"] > 0, run["face"]
        assert set(run["turns_wall_over"]) == set(run["turns_cpu_over"]) == {"5ms", "10ms", "20ms"}
        assert run["run_queue_delay_s"] >= 0 and run["turns_off_cpu_s"] >= 0


@pytest.mark.parametrize(
    ("transport", "choice", "loop"),
    [("websockets", "default", "asyncio"), ("fast", "default", "uvloop"), ("fast", "asyncio", "asyncio"),
     ("websockets", "uvloop", "uvloop"), ("fast", "fair", "fair")],
)  # fmt: skip
def test_the_async_face_loop_is_chosen_whatever_the_transport(transport: str, choice: str, loop: str) -> None:
    from fleet_measure import async_loop_name

    assert async_loop_name({"transport": transport, "async_loop": choice}) == loop
