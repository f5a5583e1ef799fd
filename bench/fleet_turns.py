"""Where a loop's lag comes from: each turn of an asyncio loop, on and off the CPU.

``--trace-turns`` (bench/fleet.py) wraps one face's loop for the measured rounds:
each turn of ``BaseEventLoop._run_once`` is timed in wall-clock and in the
loop thread's own CPU time (``time.thread_time``), the select excluded, and each
select's overshoot past the timeout it was given is counted. A turn long in CPU
is work the loop did in one go (a burst of callbacks, a collection); a turn long
in wall-clock but short in CPU is the thread waiting while runnable: for the GIL
(the sync face's callers run in another thread) or for a core (a loaded
machine). A select that returns late with nothing ready is the same wait at the
turn's start. Both delay every timer due meanwhile, the lag probe's included.
To tell the two waits apart, the loop thread's run-queue delay (the kernel's
``/proc/<pid>/task/<tid>/schedstat``: time runnable but not on a core) over the
same rounds is reported beside the time its turns spent off the CPU: what is
off the CPU and not on the run queue is waiting for the GIL (or a lock).

Wraps asyncio's own loops only (the sync face's SharedLoop, the async face on
asyncio or the fair loop); uvloop's turns are C and are not traced. The wrapper
costs a few microseconds per turn, so a traced run's CPU figures are not the
untraced ones'.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

LONG_S = (0.005, 0.010, 0.020)


class TurnTracer:
    """Per-turn wall/CPU counters of one asyncio loop; only its thread writes them."""

    def __init__(self, loop: Any) -> None:
        self.traced = hasattr(loop, "_run_once") and hasattr(loop, "_selector")
        self._select_s = 0.0
        self.reset()
        if self.traced:
            run_once = loop._run_once
            select = loop._selector.select
            wall, cpu = time.perf_counter, time.thread_time

            def timed_select(timeout: float | None = None) -> Any:
                t0 = wall()
                ready = select(timeout)
                dt = wall() - t0
                self._select_s = dt
                if timeout and not ready and dt - timeout > LONG_S[0]:
                    self.late_selects += 1
                    self.late_select_s += dt - timeout
                return ready

            def timed_turn() -> None:
                if self._tid is None:
                    self._tid = threading.get_native_id()
                    self._run_delay0 = self._run_delay()
                self._select_s = 0.0
                w0, c0 = wall(), cpu()
                run_once()
                w, c = wall() - w0 - self._select_s, cpu() - c0
                self.turns += 1
                if w > c:
                    self.off_cpu_s += w - c
                for i, bound in enumerate(LONG_S):
                    if w > bound:
                        self.wall_over[i] += 1
                        if c < w / 2:
                            self.mostly_waiting[i] += 1
                    if c > bound:
                        self.cpu_over[i] += 1

            loop._selector.select = timed_select
            loop._run_once = timed_turn

    def _run_delay(self) -> float:
        """Seconds the loop thread spent runnable but waiting for a core, so far."""
        try:
            with open(f"/proc/{os.getpid()}/task/{self._tid}/schedstat") as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0

    def reset(self) -> None:
        self._tid: int | None = None  # the loop thread's, learnt at its next turn
        self._run_delay0 = 0.0
        self.turns = self.late_selects = 0
        self.late_select_s = self.off_cpu_s = 0.0
        self.wall_over = [0] * len(LONG_S)
        self.cpu_over = [0] * len(LONG_S)
        self.mostly_waiting = [0] * len(LONG_S)

    def report(self) -> dict[str, Any]:
        if not self.traced:
            return {"turns_traced": False}
        bounds = [f"{int(b * 1000)}ms" for b in LONG_S]
        return {
            "turns_traced": True,
            "turns": self.turns,
            "turns_wall_over": dict(zip(bounds, self.wall_over)),
            "turns_cpu_over": dict(zip(bounds, self.cpu_over)),
            "turns_over_mostly_waiting": dict(zip(bounds, self.mostly_waiting)),
            "turns_off_cpu_s": self.off_cpu_s,
            "run_queue_delay_s": self._run_delay() - self._run_delay0 if self._tid is not None else 0.0,
            "late_empty_selects": self.late_selects,
            "late_empty_select_s": self.late_select_s,
        }


def format_turns(r: dict[str, Any]) -> str:
    """One report line (empty when the run was not traced)."""
    if "turns_traced" not in r:
        return ""
    if not r["turns_traced"]:
        return "  loop turns               not traced (not an asyncio loop)"
    w, c, m = r["turns_wall_over"], r["turns_cpu_over"], r["turns_over_mostly_waiting"]
    return (f"  loop turns               {r['turns']}; over 5/10/20 ms wall {w['5ms']}/{w['10ms']}/{w['20ms']} "
            f"(of which < half on CPU {m['5ms']}/{m['10ms']}/{m['20ms']}), over 5/10/20 ms CPU "
            f"{c['5ms']}/{c['10ms']}/{c['20ms']}; selects > 5 ms late with nothing ready "
            f"{r['late_empty_selects']} ({r['late_empty_select_s'] * 1000:.0f} ms); turns off the CPU "
            f"{r['turns_off_cpu_s'] * 1000:.0f} ms, the thread's run-queue delay {r['run_queue_delay_s'] * 1000:.0f} ms")  # fmt: skip
