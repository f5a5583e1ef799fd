"""The fleet gates: the seed's N=64/256/1024 staged validation plan, run for real.

One local process drives N sandboxes of a fleet host (``shinkend --fleet N``,
a separate process on loopback with emulated RTT) through the pull-based round
loop: every round, every sandbox runs one pipelined
``step([click], observe=JPEG q80 @1280)``, rounds paced at 1 Hz. Two faces:

* ``sync``  -- the blocking ``Sandbox`` facade on one ``SharedLoop``; the
  callers are gevent greenlets (one per sandbox, ``--callers gevent``, the
  headline idiom) or OS threads (``--callers threads``);
* ``async`` -- ``AsyncSandbox`` and ``asyncio.gather`` on one loop.

``--clicks shared`` (default) has every sandbox click the same empty spot,
moving each round, so the host's shared encode cache renders each round's
screen once and the client, not the one-process host emulator, is what is
measured; ``--clicks random`` makes the host encode every observation.

Each (N, face) measurement runs in a fresh client interpreter (this file with
``--child``): gevent's monkey-patching must precede every other import, and a
fresh process gives clean RSS, thread and fd baselines. The client of a
measurement is still one process driving all N sandboxes.

Drills (``--drills``, async core, on ``--drill-n``, default 256):

* stall: screencasts on every sandbox with the 256 MiB frame budget on; the
  consumers of 10% stop reading. Checks used <= budget, evictions confined to
  the stalled sandboxes, the others' round times unaffected. Because 10% of
  N=256 x 32-frame queues cannot fill 256 MiB, a third phase shrinks the
  budget until it bites, so confinement is tested with real evictions.
* storm: abort the TCP transports of 25% of the connections, reconnect them
  with full-jitter exponential backoff and ``resume_screencast``; convergence
  time and the survivors' round times.
* keepalive: pings per 100 ms tick across the fleet with ping jitter off and on.

Prints a table per run and PASS/FAIL per gate; ``--json OUT`` writes everything.
See docs/fleet-gates.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# bench/ is this script's directory: on sys.path when run as a script (parent and children).
from fleet_gates import (
    GATE_STORM_CONVERGENCE_S,
    SUSTAINED_LATE_FRACTION,
    evaluate_gates,
    exit_status,
    format_gates,
    keepalive_target,
    pings_per_tick,
)

# ---------------------------------------------------------------------------
# The plan's constants

DEFAULT_NS = (64, 256, 1024)
DEFAULT_RTT_MS = 150
DEFAULT_ROUNDS = 20
WARMUP_ROUNDS = 1  # the first round pays lazy allocations; it is run, not counted
ROUND_PERIOD_S = 1.0
OBSERVE = {"format": "jpeg", "quality": 80, "max_long_edge": 1280}
FLEET_BUDGET_BYTES = 256 << 20  # the seed's recommended GLOBAL_FRAME_BUDGET_BYTES
DIAL_CONCURRENCY = 64  # seed section 3.1: <= 64 dials in flight
DIAL_JITTER_S = 0.25
PING_JITTER_S = 10.0  # seed section 3.2, for N >= 256
RPC_TIMEOUT_S = 30.0
LAG_PROBE_S = 0.010  # the loop-lag probe sleeps this long and records the overshoot
STALL_FRACTION = 0.10
STORM_FRACTION = 0.25
#: Empty wallpaper right of the virtual desktop's windows, below its icons
#: (1920x1080 layout, docs/displays.md): clicking there changes only the cursor.
SHARED_CLICK_SPOTS = ((1500, 600), (1650, 700), (1800, 800), (1550, 900))
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
PING_TICK_S = 0.100
DRILL_MODES = ("stall", "storm", "keepalive")
KEEPALIVE_WINDOW_PERIODS = 2  # observe this many of the longest keepalive periods per phase
# Screencasts of the drills: idle-suppressed, so a sandbox pushes a frame when
# its screen changes -- once per round, after its click.
SCREENCAST = {"fps": 2.0, "format": "jpeg", "quality": 80, "max_long_edge": 1280}
# Rounds the stalled consumers stay stalled: enough for their 32-frame queues
# to fill at one frame per round and start dropping.
STALL_ROUNDS = 36

HOST_READY_TIMEOUT_S = 180.0
CHILD_TIMEOUT_S = 1800.0
KB = 1024
MB = 1024 * 1024


# ---------------------------------------------------------------------------
# Small measurement helpers (shared by the parent and the child)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile; None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100)
    return ordered[int(rank) - 1]


def summary(values: list[float], qs: Iterable[float] = (50, 95, 99)) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q:g}": percentile(values, q) for q in qs}
    out["max"] = max(values) if values else None
    out["n"] = len(values)
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS/VmHWM (bytes) and Threads of a process, from /proc."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * KB
            elif key == "Threads":
                out[key] = int(value)
    return out


def loadavg() -> float:
    """The machine's 1-minute load average: other work competing for the 2 cores."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def freeze_heap() -> None:
    """Collect, then move every surviving object out of the collector's reach.

    After a fleet is connected its long-lived objects (connections, tasks,
    buffers) dominate the heap; without this, every gen-2 collection walks all
    of them and stops the loop for that long (``--gc-freeze``).
    """
    import gc

    gc.collect()
    gc.freeze()


def apply_gc_setting(spec: dict[str, Any]) -> None:
    """Once the fleet is connected: ``--gc-fleet`` applies the SDK's opt-in
    helper (freeze + raised thresholds), ``--gc-freeze`` only freezes."""
    if spec.get("gc_fleet"):
        from shinken_sync.fleetgc import tune_gc_for_fleet

        tune_gc_for_fleet()
    elif spec["gc_freeze"]:
        freeze_heap()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of a process (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_fd_limit() -> tuple[int, int]:
    """Soft nofile limit up to the hard limit; the fleet needs >= 4 x N."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def host_liveness(pid: int) -> Any:
    """A liveness probe over the fleet host process, as a provider would answer it."""
    from shinken_sync.providers.base import Liveness

    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return Liveness(alive=False, detail="fleet host gone")
    return Liveness(alive=state != "Z", detail="" if state != "Z" else "fleet host exited")


def backoff_delay(attempt: int) -> float:
    """Full-jitter exponential backoff (seed section 3.3)."""
    return random.uniform(0.0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))


class GcPauses:
    """Garbage-collector pauses, from ``gc.callbacks``: every collection stops
    the event loop (and, under the GIL, everything else) for its duration."""

    def __init__(self) -> None:
        import gc

        self.pauses: list[tuple[int, float]] = []
        self._t = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t))

    def clear(self) -> None:
        self.pauses = []

    def report(self) -> dict[str, Any]:
        gen2 = [d for g, d in self.pauses if g == 2]
        return {
            "gc_collections": len(self.pauses),
            "gc_gen2_collections": len(gen2),
            "gc_pause_max_s": max((d for _, d in self.pauses), default=0.0),
            "gc_pause_total_s": sum(d for _, d in self.pauses),
        }


class FdHighWater:
    def __init__(self) -> None:
        self.value = fd_count()

    def sample(self) -> int:
        n = fd_count()
        self.value = max(self.value, n)
        return n


# ===========================================================================
# Child side: one client process, one measurement
# ===========================================================================


class Clicks:
    """Where a round's steps click.

    ``random``: anywhere on the screen, so every sandbox's desktop differs and
    the fleet host renders and encodes every observation. ``shared``: every
    sandbox clicks the same empty wallpaper spot, and the spot moves each
    round: every screen still changes every round (screencasts push frames),
    but sandboxes in one visual state share one encode in the host's frame
    cache, so the host no longer bounds the round. See docs/fleet-gates.md.
    """

    def __init__(self, mode: str, width: int, height: int) -> None:
        self.mode, self.width, self.height = mode, width, height
        self.round = 0

    def next_round(self) -> None:
        self.round += 1

    def action(self) -> dict[str, Any]:
        if self.mode == "random":
            x, y = random.randrange(self.width), random.randrange(self.height)
        else:
            x, y = SHARED_CLICK_SPOTS[self.round % len(SHARED_CLICK_SPOTS)]
        return {"verb": "click", "x": x, "y": y}

    def actions(self, count: int) -> list[dict[str, Any]]:
        """A step's actions: ``count - 1`` pointer moves towards the click, then the click."""
        click = self.action()
        moves = [{"verb": "move", "x": max(0, click["x"] - 10 * k), "y": click["y"]} for k in range(count - 1, 0, -1)]
        return [*moves, click]


class StepLog:
    """Per-step samples of one run, shared by both faces."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.latencies: list[float] = []
        self.bytes = 0
        self.frames = 0
        self.outcomes: dict[str, int] = {}

    def record(self, latency: float, result: Any = None, error: BaseException | None = None) -> None:
        from shinken_sync.errors import classify_exception

        if error is not None:
            kind = classify_exception(error)
        elif result.observation is None:
            kind = "observe_" + classify_exception(result.observation_error)
        elif not result.ok:
            kind = next(row.outcome for row in result.rows if not row.ok)
        else:
            kind = "ok"
        self.outcomes[kind] = self.outcomes.get(kind, 0) + 1
        if result is not None and result.observation is not None:
            self.latencies.append(latency)
            self.bytes += len(result.observation.data)
            self.frames += 1


class RoundClock:
    """Paces rounds on a fixed grid (round k starts at t0 + k * period, or late).

    Round :data:`WARMUP_ROUNDS` starts the measurement: ``on_measure`` clears
    what the warm-up recorded. Keeps each measured round's start and wall-clock,
    and the client's and fleet host's CPU seconds over the measured rounds.
    """

    def __init__(self, period: float, host_pid: int, on_measure: Callable[[], None]) -> None:
        self.period = period
        self.host_pid = host_pid
        self.on_measure = on_measure
        self.starts: list[float] = []
        self.walls: list[float] = []
        self.late = 0
        self.cpu0 = self.cpu1 = (0.0, 0.0)
        self.load: list[float] = []
        self.t_end = 0.0
        self.t0 = time.monotonic()

    def delay(self, k: int) -> float:
        return max(0.0, self.t0 + k * self.period - time.monotonic())

    def begin(self, k: int) -> float:
        if k == WARMUP_ROUNDS:
            self.on_measure()
            self.cpu0 = (cpu_seconds(), cpu_seconds(self.host_pid))
            self.load = [loadavg()]
        t = time.monotonic()
        if k >= WARMUP_ROUNDS:
            self.starts.append(t)
        return t

    def end(self, k: int, started: float) -> None:
        if k < WARMUP_ROUNDS:
            return
        self.t_end = time.monotonic()
        wall = self.t_end - started
        self.walls.append(wall)
        self.late += wall > self.period
        self.cpu1 = (cpu_seconds(), cpu_seconds(self.host_pid))
        self.load.append(loadavg())

    @property
    def window(self) -> float:
        """Wall-clock the measured rounds occupied (the last one's full slot included)."""
        if not self.starts:
            return 0.0
        return max(self.t_end, self.starts[-1] + self.period) - self.starts[0]

    @property
    def achieved_hz(self) -> float:
        if len(self.starts) < 2:
            return 0.0
        return (len(self.starts) - 1) / (self.starts[-1] - self.starts[0])


def _loop_lag_probe(samples: list[float]):
    """A coroutine that records how late a short sleep wakes up (event-loop lag)."""
    import asyncio

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            samples.append(max(0.0, loop.time() - t - LAG_PROBE_S))

    return probe()


def _frame_counters(loop: Any) -> dict[str, Any]:
    import shinken_sync.client as client_mod

    b = client_mod.loop_frame_budget(loop)
    return {
        "frames_dropped": b.frames_dropped,
        "frames_evicted": b.frames_evicted,
        "budget_used_bytes": b.used_bytes,
        # the knob, read at every frame push (the loop's own copy is set by the first push)
        "budget_limit_bytes": client_mod.GLOBAL_FRAME_BUDGET_BYTES,
    }


def _finish_report(
    spec: dict[str, Any],
    log: StepLog,
    clock: RoundClock,
    lag: list[float],
    rss: dict[str, int],
    fds: FdHighWater,
    connect_s: float,
    n_connected: int,
    connect_errors: dict[str, int],
    frames: dict[str, int],
    gc_pauses: GcPauses,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    status = proc_status()
    wall = max(1e-9, clock.window)
    n = max(1, n_connected)
    counted = len(clock.walls)
    report = {
        "n": spec["n"],
        "face": spec["face"],
        "callers": spec["callers"] if spec["face"] == "sync" else (
            "fair loop" if spec.get("async_loop") == "fair" and spec.get("transport") != "fast" else "asyncio"
        ),
        "rtt_ms": spec["rtt_ms"],
        "clicks": spec["clicks"],
        "rounds": counted,
        "connected": n_connected,
        "connect_errors": connect_errors,
        "connect_s": connect_s,
        "round_wall_s": summary(clock.walls, (50, 95)),
        "observe_latency_s": summary(log.latencies),
        "loop_lag_s": summary(lag),
        "rss_before_bytes": rss["before"],
        "rss_connected_bytes": rss["connected"],
        "rss_after_bytes": status["VmRSS"],
        "rss_peak_bytes": status["VmHWM"],
        "marginal_rss_connect_bytes": (rss["connected"] - rss["before"]) / n,
        "marginal_rss_steady_bytes": (status["VmRSS"] - rss["before"]) / n,
        "threads": max(rss["threads"], status["Threads"]),
        "fd_high_water": fds.value,
        "fd_soft_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        **frames,
        **gc_pauses.report(),
        "step_outcomes": log.outcomes,
        "observations": log.frames,
        "bytes_received": log.bytes,
        "frame_bytes_avg": log.bytes / log.frames if log.frames else 0,
        "rounds_wall_s": wall,
        "mbps": log.bytes * 8 / wall / 1e6,
        "late_rounds": clock.late,
        "achieved_hz": clock.achieved_hz,
        "client_cpu_pct": 100 * (clock.cpu1[0] - clock.cpu0[0]) / wall,
        "host_cpu_pct": 100 * (clock.cpu1[1] - clock.cpu0[1]) / wall,
        # CPU per step does not depend on how much of the machine the run got
        "client_cpu_ms_per_step": 1000 * (clock.cpu1[0] - clock.cpu0[0]) / max(1, log.frames),
        "host_cpu_ms_per_step": 1000 * (clock.cpu1[1] - clock.cpu0[1]) / max(1, log.frames),
        "host_rss_bytes": proc_status(spec["host_pid"])["VmRSS"],
        "actions_per_step": spec.get("actions", 1),
        "transport": spec.get("transport", "websockets"),
        "async_loop": spec.get("async_loop", "asyncio") if spec["face"] == "async" else "sharedloop",
        "gc_freeze": spec["gc_freeze"],
        "gc_fleet": spec.get("gc_fleet", False),
        "spread_ms": spec["spread_ms"],
        "loadavg_max": max(clock.load, default=0.0),
    }
    bad = sum(v for k, v in log.outcomes.items() if k != "ok")
    report["sustained_1hz"] = bool(
        counted and clock.late <= SUSTAINED_LATE_FRACTION * counted and bad == 0 and not connect_errors
    )
    if extra:
        report.update(extra)
    return report


# ---------------------------------------------------------------------------
# The sync face: Sandbox on a SharedLoop, driven by greenlets or threads


class _Callers:
    """``map(fn, items)`` over one caller per item: gevent greenlets or OS threads."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind = kind
        if kind == "gevent":
            import gevent.pool

            self._pool = gevent.pool.Pool(n)
        else:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fleet-caller")

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return list(self._pool.map(fn, items))

    def sleep(self, seconds: float) -> None:
        if self.kind == "gevent":
            import gevent

            gevent.sleep(seconds)
        else:
            time.sleep(seconds)

    def close(self) -> None:
        if self.kind == "threads":
            self._pool.shutdown(wait=True)


def _run_sync_face(spec: dict[str, Any]) -> dict[str, Any]:
    import threading

    import shinken_sync.client as client_mod
    from shinken_sync.errors import ShinkenError
    from shinken_sync.sharedloop import SharedLoop
    from shinken_sync.sync import connect

    client_mod.GLOBAL_FRAME_BUDGET_BYTES = FLEET_BUDGET_BYTES
    urls, token, n = spec["urls"], spec["token"], spec["n"]
    callers = _Callers(spec["callers"], n)
    shared = SharedLoop()
    loop = shared.loop
    fds = FdHighWater()
    hub_lag: list[float] = []
    if spec["callers"] == "gevent":
        import gevent

        def hub_probe() -> None:
            while True:
                t = time.monotonic()
                gevent.sleep(LAG_PROBE_S)
                hub_lag.append(max(0.0, time.monotonic() - t - LAG_PROBE_S))

        hub_probe_g = gevent.spawn(hub_probe)

    rss: dict[str, int] = {"before": proc_status()["VmRSS"]}
    dial_gate = threading.BoundedSemaphore(DIAL_CONCURRENCY)
    connect_errors: dict[str, int] = {}

    def dial(url: str) -> Any:
        callers.sleep(random.uniform(0, DIAL_JITTER_S))
        with dial_gate:
            try:
                return connect(
                    url, token=token, loop=shared, ping_jitter=spec["ping_jitter"], rpc_timeout=RPC_TIMEOUT_S
                )
            except ShinkenError as exc:  # counted and reported; the run goes on with the rest
                connect_errors[type(exc).__name__] = connect_errors.get(type(exc).__name__, 0) + 1
                return None

    t = time.monotonic()
    sandboxes = [sb for sb in callers.map(dial, urls) if sb is not None]
    connect_s = time.monotonic() - t
    status = proc_status()
    rss.update(connected=status["VmRSS"], threads=status["Threads"])
    fds.sample()
    apply_gc_setting(spec)
    width, height = sandboxes[0].screen_size() if sandboxes else (1, 1)
    clicks = Clicks(spec["clicks"], width, height)

    lag: list[float] = []
    probe = shared.submit(_loop_lag_probe(lag))
    log = StepLog()

    gc_pauses = GcPauses()

    def measure() -> None:
        log.reset()
        lag.clear()
        hub_lag.clear()
        gc_pauses.clear()

    clock = RoundClock(spec["period"], spec["host_pid"], measure)

    spread = spec["spread_ms"] / 1000 / max(1, len(sandboxes))

    def one_step(indexed: tuple[int, Any]) -> None:
        i, sb = indexed
        if spread:
            callers.sleep(i * spread)
        t = time.monotonic()
        try:
            result = sb.step(clicks.actions(spec["actions"]), observe=OBSERVE)
        except ShinkenError as exc:  # one failing sandbox never ends the round
            log.record(time.monotonic() - t, error=exc)
        else:
            log.record(time.monotonic() - t, result)

    for k in range(WARMUP_ROUNDS + spec["rounds"]):
        callers.sleep(clock.delay(k))
        started = clock.begin(k)
        clicks.next_round()
        callers.map(one_step, list(enumerate(sandboxes)))
        clock.end(k, started)
        fds.sample()
    frames = _frame_counters(loop)
    probe.cancel()
    extra: dict[str, Any] = {}
    if spec["callers"] == "gevent":
        hub_probe_g.kill()
        extra["hub_lag_s"] = summary(hub_lag)
    report = _finish_report(
        spec, log, clock, lag, rss, fds, connect_s, len(sandboxes), connect_errors, frames, gc_pauses, extra
    )
    try:
        callers.map(lambda sb: sb.close(), sandboxes)
        callers.close()
        shared.close()
    except Exception as exc:  # noqa: BLE001 - the measurement stands; the failed teardown is reported
        report["teardown_error"] = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return report


# ---------------------------------------------------------------------------
# The async face: AsyncSandbox + asyncio.gather on one loop


async def _dial_all(urls: list[str], token: str, **options: Any):
    """Jittered, bounded dialing (seed section 3.1). Returns (sandboxes, error counts)."""
    import asyncio

    from shinken_sync.client import aconnect

    gate = asyncio.Semaphore(DIAL_CONCURRENCY)

    async def dial(url: str) -> Any:
        await asyncio.sleep(random.uniform(0, DIAL_JITTER_S))
        async with gate:
            return await aconnect(url, token=token, rpc_timeout=RPC_TIMEOUT_S, **options)

    results = await asyncio.gather(*(dial(u) for u in urls), return_exceptions=True)
    errors: dict[str, int] = {}
    sandboxes = []
    for r in results:
        if isinstance(r, BaseException):
            errors[type(r).__name__] = errors.get(type(r).__name__, 0) + 1
        else:
            sandboxes.append(r)
    return sandboxes, errors


async def _timed_step(sb: Any, clicks: Clicks, log: StepLog, delay: float = 0.0, actions: int = 1) -> float:
    """One step; ``delay`` first (its start within a spread round), not timed."""
    import asyncio

    from shinken_sync.errors import ShinkenError

    if delay:
        await asyncio.sleep(delay)
    t = time.monotonic()
    try:
        result = await sb.step(clicks.actions(actions), observe=OBSERVE)
    except ShinkenError as exc:  # one failing sandbox never ends the round
        log.record(time.monotonic() - t, error=exc)
    else:
        log.record(time.monotonic() - t, result)
    return time.monotonic() - t


async def _run_async_face(spec: dict[str, Any]) -> dict[str, Any]:
    import asyncio

    import shinken_sync.client as client_mod

    client_mod.GLOBAL_FRAME_BUDGET_BYTES = FLEET_BUDGET_BYTES
    loop = asyncio.get_running_loop()
    fds = FdHighWater()
    rss: dict[str, int] = {"before": proc_status()["VmRSS"]}
    t = time.monotonic()
    sandboxes, connect_errors = await _dial_all(
        spec["urls"], spec["token"], ping_jitter=spec["ping_jitter"]
    )
    connect_s = time.monotonic() - t
    status = proc_status()
    rss.update(connected=status["VmRSS"], threads=status["Threads"])
    fds.sample()
    apply_gc_setting(spec)
    width, height = await sandboxes[0].screen_size() if sandboxes else (1, 1)
    clicks = Clicks(spec["clicks"], width, height)

    lag: list[float] = []
    probe = asyncio.ensure_future(_loop_lag_probe(lag))
    log = StepLog()

    gc_pauses = GcPauses()

    def measure() -> None:
        log.reset()
        lag.clear()
        gc_pauses.clear()

    clock = RoundClock(spec["period"], spec["host_pid"], measure)
    for k in range(WARMUP_ROUNDS + spec["rounds"]):
        await asyncio.sleep(clock.delay(k))
        started = clock.begin(k)
        clicks.next_round()
        spread = spec["spread_ms"] / 1000 / max(1, len(sandboxes))
        await asyncio.gather(
            *(_timed_step(sb, clicks, log, i * spread, spec["actions"]) for i, sb in enumerate(sandboxes))
        )
        clock.end(k, started)
        fds.sample()
    probe.cancel()
    frames = _frame_counters(loop)
    report = _finish_report(
        spec, log, clock, lag, rss, fds, connect_s, len(sandboxes), connect_errors, frames, gc_pauses
    )
    await asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True)
    return report


# ---------------------------------------------------------------------------
# Drills (async core). A drill round steps a chosen set of sandboxes and keeps
# each one's latency, so "the others' round time" is the max over the others.


async def _drill_round(sandboxes: dict[int, Any], clicks: Clicks, log: StepLog) -> dict[int, float]:
    import asyncio

    keys = list(sandboxes)
    clicks.next_round()
    walls = await asyncio.gather(*(_timed_step(sandboxes[i], clicks, log) for i in keys))
    return dict(zip(keys, walls))


def _group_wall(per_round: list[dict[int, float]], members: set[int]) -> list[float]:
    """Each round's wall-clock as seen by ``members`` alone (the slowest of them)."""
    return [max(lat for i, lat in r.items() if i in members) for r in per_round if members & r.keys()]


async def _paced_rounds(
    count: int, period: float, body: Callable[[], Any], until: Callable[[], bool] | None = None
) -> None:
    """Run ``body`` every ``period`` seconds, ``count`` times (or until ``until()``)."""
    import asyncio

    t0 = time.monotonic()
    for k in range(count):
        await asyncio.sleep(max(0.0, t0 + k * period - time.monotonic()))
        await body()
        if until is not None and until():
            return


async def _drill_setup(spec: dict[str, Any], **dial_options: Any):
    import asyncio

    import shinken_sync.client as client_mod

    client_mod.GLOBAL_FRAME_BUDGET_BYTES = FLEET_BUDGET_BYTES
    sandboxes, errors = await _dial_all(spec["urls"], spec["token"], **dial_options)
    fds = FdHighWater()
    if not sandboxes:
        raise RuntimeError(f"no sandbox connected: {errors}")
    width, height = await sandboxes[0].screen_size()
    clicks = Clicks(spec["clicks"], width, height)
    return asyncio.get_running_loop(), dict(enumerate(sandboxes)), errors, clicks, fds


def _ratio(after: float | None, before: float | None) -> float | None:
    return None if not after or not before else after / before


async def _drill_stall(spec: dict[str, Any]) -> dict[str, Any]:
    """Screencasts everywhere, 256 MiB budget on, 10% of consumers stop reading."""
    import asyncio

    import shinken_sync.client as client_mod
    from shinken_sync.client import loop_frame_budget
    from shinken_sync.errors import FrameTimeout

    loop, sandboxes, errors, clicks, fds = await _drill_setup(spec, ping_jitter=PING_JITTER_S)
    budget = loop_frame_budget(loop)
    n = len(sandboxes)
    stalled = set(random.sample(sorted(sandboxes), max(1, round(STALL_FRACTION * n))))
    others = set(sandboxes) - stalled
    streams = dict(zip(sandboxes, await asyncio.gather(
        *(sb.screencast(**SCREENCAST) for sb in sandboxes.values())
    )))  # fmt: skip
    consumed = dict.fromkeys(sandboxes, 0)

    async def consume(i: int) -> None:
        while True:
            try:
                await streams[i].next_frame(timeout=RPC_TIMEOUT_S)
            except FrameTimeout:  # an idle screen; keep reading
                continue
            consumed[i] += 1

    consumers = {i: asyncio.ensure_future(consume(i)) for i in sandboxes}
    used_max = 0

    def sample_budget() -> None:
        nonlocal used_max
        # A new knob value reaches the loop's budget (and evicts) at the next
        # frame push; until then the old limit is the one in force.
        if budget.limit == client_mod.GLOBAL_FRAME_BUDGET_BYTES:
            used_max = max(used_max, budget.used_bytes)

    async def watch_budget() -> None:
        while True:
            sample_budget()
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch_budget())
    phases: dict[str, Any] = {}
    log = StepLog()

    async def phase(name: str, rounds: int) -> None:
        nonlocal used_max
        used_max = 0
        sample_budget()
        evicted0 = {i: streams[i].counters.frames_evicted for i in sandboxes}
        per_round: list[dict[int, float]] = []
        cpu0, steps0, load = cpu_seconds(), log.frames, [loadavg()]

        async def body() -> None:
            per_round.append(await _drill_round(sandboxes, clicks, log))
            load.append(loadavg())

        await _paced_rounds(rounds, spec["period"], body)
        evicted = {i: streams[i].counters.frames_evicted - evicted0[i] for i in sandboxes}
        phases[name] = {
            # the loop's whole cost (steps, frames consumed, evictions) per step:
            # unlike wall-clock, it does not move with the machine's other load
            "client_cpu_ms_per_step": 1000 * (cpu_seconds() - cpu0) / max(1, log.frames - steps0),
            "loadavg_max": max(load),
            "budget_limit_bytes": client_mod.GLOBAL_FRAME_BUDGET_BYTES,
            "budget_used_max_bytes": used_max,
            "used_within_budget": budget.limit is None or used_max <= budget.limit,
            "evicted_stalled": sum(evicted[i] for i in stalled),
            "evicted_others": sum(evicted[i] for i in others),
            "others_round_wall_s": summary(_group_wall(per_round, others), (50, 95)),
        }

    await phase("baseline", max(5, spec["rounds"] // 2))
    for i in stalled:
        consumers[i].cancel()
    await phase("stalled_256MiB", STALL_ROUNDS)
    # 10% of N x 32-frame queues cannot fill 256 MiB at this N, so the budget
    # above never had to evict. Shrink it (the module knob is read at every
    # push) under what the stalled queues hold now, so eviction really runs,
    # and check that it still hits only the stalled streams.
    tight = max(4 * int(log.bytes / max(1, log.frames)), budget.used_bytes // 2)
    client_mod.GLOBAL_FRAME_BUDGET_BYTES = tight
    await phase("stalled_tight_budget", max(5, spec["rounds"] // 2))
    watcher.cancel()
    for task in consumers.values():
        task.cancel()
    base = phases["baseline"]["others_round_wall_s"]["p50"]
    for name in ("stalled_256MiB", "stalled_tight_budget"):
        phases[name]["others_round_p50_ratio"] = _ratio(phases[name]["others_round_wall_s"]["p50"], base)
    report = {
        "n": spec["n"], "connected": n, "connect_errors": errors, "stalled": len(stalled),
        "screencast": SCREENCAST, "phases": phases,
        "frames_consumed_others": sum(consumed[i] for i in others),
        "frames_dropped_total": budget.frames_dropped, "step_outcomes": log.outcomes,
        "fd_high_water": fds.value,
    }  # fmt: skip
    await asyncio.gather(*(sb.close() for sb in sandboxes.values()), return_exceptions=True)
    return report


async def _drill_storm(spec: dict[str, Any]) -> dict[str, Any]:
    """Abort 25% of the connections; reconnect with full-jitter backoff + resume."""
    import asyncio

    from shinken_sync.client import aconnect
    from shinken_sync.errors import FrameTimeout, ShinkenError, StreamLost, classify_exception
    from shinken_sync.transport import abort as abort_transport

    # The provider's view, as a real fleet would wire it: the host process is alive.
    probe = functools.partial(host_liveness, spec["host_pid"])
    _, sandboxes, errors, clicks, fds = await _drill_setup(spec, ping_jitter=PING_JITTER_S, liveness_probe=probe)
    n = len(sandboxes)
    victims = set(random.sample(sorted(sandboxes), max(1, round(STORM_FRACTION * n))))
    loss_outcomes: dict[str, int] = {}  # how each victim's StreamLost classified
    survivors = set(sandboxes) - victims
    streams = dict(zip(sandboxes, await asyncio.gather(
        *(sb.screencast(**SCREENCAST) for sb in sandboxes.values())
    )))  # fmt: skip
    up = dict(sandboxes)  # the sandboxes rounds may step right now
    log = StepLog()
    recovered_at: dict[int, float] = {}
    attempts: dict[int, int] = {}
    seq_gaps: dict[int, int] = {}
    failures: dict[str, int] = {}
    t_kill = 0.0

    async def consume(i: int) -> None:
        """Read frames; on a lost connection, reconnect with backoff and resume."""
        while True:
            try:
                await streams[i].next_frame(timeout=RPC_TIMEOUT_S)
                continue
            except FrameTimeout:  # an idle screen; keep reading
                continue
            except StreamLost as exc:  # carries what the resume needs
                lost = exc
            kind = classify_exception(lost.__cause__ or lost)  # the connection's loss, as the SDK judged it
            loss_outcomes[kind] = loss_outcomes.get(kind, 0) + 1
            up.pop(i, None)
            attempt = 0
            while True:
                await asyncio.sleep(backoff_delay(attempt))
                attempt += 1
                try:
                    sb = await aconnect(spec["urls"][i], token=spec["token"], ping_jitter=PING_JITTER_S,
                                        rpc_timeout=RPC_TIMEOUT_S, liveness_probe=probe)  # fmt: skip
                    stream = await sb.resume_screencast(lost.stream_id, lost.params, last_seq=lost.last_seq)
                    frame = await stream.next_frame(timeout=RPC_TIMEOUT_S)
                except ShinkenError as exc:  # counted; the loop retries with a longer backoff
                    failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                    continue
                break
            streams[i], sandboxes[i], up[i] = stream, sb, sb
            recovered_at[i] = time.monotonic() - t_kill
            attempts[i] = attempt
            seq_gaps[i] = frame.gap

    consumers = [asyncio.ensure_future(consume(i)) for i in sandboxes]
    before: list[dict[int, float]] = []
    during: list[dict[int, float]] = []

    async def round_into(rows: list[dict[int, float]]) -> None:
        rows.append(await _drill_round(dict(up), clicks, log))

    cpu = [(cpu_seconds(), log.frames)]
    await _paced_rounds(max(5, spec["rounds"] // 2), spec["period"], lambda: round_into(before))
    cpu.append((cpu_seconds(), log.frames))
    t_kill = time.monotonic()
    for i in victims:
        # Abrupt loss without a closing handshake, as a network blip looks: the
        # TCP connection is reset under the WebSocket (a private attribute; the
        # SDK has no "break my connection" call, rightly).
        abort_transport(sandboxes[i]._ws)
    await _paced_rounds(
        int(GATE_STORM_CONVERGENCE_S * 1.5 / spec["period"]), spec["period"], lambda: round_into(during),
        until=lambda: len(recovered_at) == len(victims) and len(during) >= max(5, spec["rounds"] // 2),
    )  # fmt: skip
    cpu.append((cpu_seconds(), log.frames))
    for task in consumers:
        task.cancel()
    (c0, f0), (c1, f1), (c2, f2) = cpu
    cpu_ms = [1000 * (c1 - c0) / max(1, f1 - f0), 1000 * (c2 - c1) / max(1, f2 - f1)]
    base = summary(_group_wall(before, survivors), (50, 95))
    storm = summary(_group_wall(during, survivors), (50, 95))
    converged = len(recovered_at) == len(victims)
    report = {
        "n": spec["n"], "connected": n, "connect_errors": errors, "killed": len(victims),
        "recovered": len(recovered_at), "convergence_s": max(recovered_at.values()) if converged else None,
        "recovery_s": summary(list(recovered_at.values())),
        "reconnect_attempts": summary([float(a) for a in attempts.values()], (50, 99)),
        "reconnect_failures": failures,
        "resumed_seq_gap": summary([float(g) for g in seq_gaps.values()], (50,)),
        "survivors_round_wall_before_s": base, "survivors_round_wall_during_s": storm,
        "survivors_round_p50_ratio": _ratio(storm["p50"], base["p50"]),
        "client_cpu_ms_per_step_before": cpu_ms[0], "client_cpu_ms_per_step_during": cpu_ms[1],
        "step_outcomes": log.outcomes, "loss_outcomes": loss_outcomes, "fd_high_water": fds.value,
    }  # fmt: skip
    await asyncio.gather(*(sb.close() for sb in sandboxes.values()), return_exceptions=True)
    return report


async def _drill_keepalive(spec: dict[str, Any]) -> dict[str, Any]:
    """Keepalive pings per 100 ms tick across the fleet, ping jitter off vs on."""
    import asyncio

    from websockets.asyncio.connection import Connection

    import shinken_sync.client as client_mod

    # --keepalive-interval/--keepalive-jitter shrink the periods (the CI run of this
    # drill); the SDK's keepalive reads the interval at every dial.
    if spec.get("keepalive_interval"):
        client_mod.DEFAULT_PING_INTERVAL = spec["keepalive_interval"]
    DEFAULT_PING_INTERVAL = client_mod.DEFAULT_PING_INTERVAL
    # A tick is 1/200 of the base period (100 ms of 20 s): a shortened period keeps the proportions.
    tick = PING_TICK_S * DEFAULT_PING_INTERVAL / 20.0
    jitter_on = spec.get("keepalive_jitter") or PING_JITTER_S
    sent: list[float] = []
    original_ping = Connection.ping

    async def counting_ping(self: Connection, data: Any = None) -> Any:
        sent.append(time.monotonic())
        return await original_ping(self, data)

    Connection.ping = counting_ping  # type: ignore[method-assign]
    report: dict[str, Any] = {"n": spec["n"], "ping_interval_s": DEFAULT_PING_INTERVAL, "tick_s": tick}
    # Long enough for every connection to ping KEEPALIVE_WINDOW_PERIODS times
    # even at the longest jittered period.
    window = KEEPALIVE_WINDOW_PERIODS * (DEFAULT_PING_INTERVAL + jitter_on) + 1.0
    for label, jitter in (("jitter_off", 0.0), ("jitter_on", jitter_on)):
        sandboxes, errors = await _dial_all(spec["urls"], spec["token"], ping_jitter=jitter)
        sent.clear()
        t0 = time.monotonic()
        await asyncio.sleep(window)
        ticks = pings_per_tick(sent, t0, tick)
        report[label] = {
            "ping_jitter_s": jitter, "connected": len(sandboxes), "connect_errors": errors,
            "window_s": window, "pings": len(sent), "max_pings_per_tick": max(ticks.values(), default=0),
            "busy_ticks": len(ticks), "target_max_per_tick": keepalive_target(len(sandboxes)),
            # the window spans KEEPALIVE_WINDOW_PERIODS of the longest period: each connection pings that often
            "min_periods": KEEPALIVE_WINDOW_PERIODS,
        }  # fmt: skip
        await asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True)
    Connection.ping = original_ping  # type: ignore[method-assign]
    return report


DRILLS = {"stall": _drill_stall, "storm": _drill_storm, "keepalive": _drill_keepalive}


# ---------------------------------------------------------------------------
# Child entry point


def _run_on_own_loop(spec: dict[str, Any], coro: Any) -> Any:
    """The async face's loop: uvloop under ``--transport fast`` (what the [fast]
    extra's users would run), else asyncio's own, or with ``--async-loop fair``
    the SDK's bounded-select loop (``sharedloop.new_fair_event_loop``)."""
    import asyncio

    if spec.get("transport") == "fast":
        import uvloop

        return uvloop.run(coro)
    if spec.get("async_loop") == "fair":
        from shinken_sync.sharedloop import new_fair_event_loop

        with asyncio.Runner(loop_factory=new_fair_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def _child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["face"] == "sync" and spec.get("callers") == "gevent":
        from gevent import monkey

        monkey.patch_all()
        import gevent

        gevent.get_hub()  # before the loop thread imports anything (gevent-notes)
        import asyncio  # pre-imported for the same reason
        import ssl

        import websockets

        del asyncio, ssl, websockets
    raise_fd_limit()
    random.seed(spec.get("seed"))
    import shinken_sync.transport

    shinken_sync.transport.TRANSPORT = spec.get("transport", "websockets")
    mode = spec["mode"]
    if mode == "rounds":
        if spec["face"] == "sync":
            report = _run_sync_face(spec)
        elif spec["face"] == "floor":
            import fleet_floor

            clicks = Clicks(spec["clicks"], 1920, 1080)

            def actions_of(k: int) -> list[dict[str, Any]]:
                clicks.next_round()
                return clicks.actions(spec["actions"])

            report = fleet_floor.run_floor(spec, actions_of, OBSERVE, cpu_seconds)
        else:
            report = _run_on_own_loop(spec, _run_async_face(spec))
    elif mode == "memory":
        import fleet_memory

        def rss() -> int:
            return proc_status()["VmRSS"]

        if spec["face"] == "sync":
            callers = _Callers(spec["callers"], spec["n"])
            report = fleet_memory.memory_sync(spec, rss, callers)
        elif spec["face"] == "wsclient":
            report = fleet_memory.memory_wsclient(spec, rss)
        else:
            report = _run_on_own_loop(spec, fleet_memory.memory_async(spec, rss))
    else:
        report = _run_on_own_loop(spec, DRILLS[mode](spec))
    Path(spec["out"]).write_text(json.dumps(report))


# ===========================================================================
# Parent side: fleet host, child runs, gates, the printed report
# ===========================================================================


class FleetHost:
    """A ``shinkend --fleet N`` process on loopback; ``urls`` once ready."""

    def __init__(self, n: int, rtt_ms: float, workdir: Path) -> None:
        self.n = n
        self.rtt_ms = rtt_ms
        self.workdir = workdir
        self.token = os.urandom(16).hex()
        self.token_file = workdir / f"token-{n}"
        self.token_file.write_text(self.token)
        self.stdout_path = workdir / f"host-{n}.out"
        self.stderr_path = workdir / f"host-{n}.err"
        self.proc: subprocess.Popen | None = None
        self.urls: list[str] = []
        self.ready_s = 0.0

    def __enter__(self) -> FleetHost:  # noqa: PYI034 (3.10 has no typing.Self)
        cmd = [
            sys.executable, "-m", "shinken_sync.daemon.server",
            "--display", "virtual", "--fleet", str(self.n), "--port", "0",
            "--token-file", str(self.token_file), "--rtt-ms", str(self.rtt_ms),
        ]  # fmt: skip
        t = time.monotonic()
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        deadline = t + HOST_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.stdout_path.read_text().partition("\n")
            if line[1]:
                ready = json.loads(line[0])
                self.urls = list(ready["urls"])
                self.ready_s = time.monotonic() - t
                if len(self.urls) != self.n:
                    raise RuntimeError(f"fleet host offers {len(self.urls)} sandboxes, asked for {self.n}")
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"fleet host exited with {self.proc.returncode}: {self._tail()}")
            time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"fleet host not ready after {HOST_READY_TIMEOUT_S}s: {self._tail()}")

    def _tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-2000:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def run_child(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Run one measurement in a fresh client interpreter; its report, or an error record."""
    tag = f"{spec['mode']}-{spec['n']}-{spec['face']}-{spec.get('transport', 'websockets')}"
    spec_path = workdir / f"{tag}.spec.json"
    spec = {**spec, "out": str(workdir / f"{tag}.out.json")}
    spec_path.write_text(json.dumps(spec))
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(spec_path)],
        capture_output=True, timeout=CHILD_TIMEOUT_S, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - t
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-3000:]
        return {"mode": spec["mode"], "n": spec["n"], "face": spec["face"], "error": tail,
                "elapsed_s": elapsed}  # fmt: skip
    report = json.loads(Path(spec["out"]).read_text())
    report["elapsed_s"] = elapsed
    return report


# ---------------------------------------------------------------------------
# Printing


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / MB:.0f}"


def format_round_report(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"N={r['n']} {r['face']}: FAILED TO RUN\n{r['error']}"
    rw, ol, lag = r["round_wall_s"], r["observe_latency_s"], r["loop_lag_s"]
    lines = [
        (f"N={r['n']} face={r['face']}({r['callers']}) transport={r.get('transport', 'websockets')} "
         f"actions={r.get('actions_per_step', 1)}+observe clicks={r['clicks']} rtt={r['rtt_ms']:g}ms "
         f"rounds={r['rounds']} connected={r['connected']} in {r['connect_s']:.1f}s "
         f"errors={r['connect_errors'] or 0}"),
        (f"  round wall p50/p95       {_ms(rw['p50'])} / {_ms(rw['p95'])} ms  (max {_ms(rw['max'])}, "
         f"late {r['late_rounds']}/{r['rounds']}, {r['achieved_hz']:.2f} Hz)"),
        f"  observe p50/p95/p99      {_ms(ol['p50'])} / {_ms(ol['p95'])} / {_ms(ol['p99'])} ms",
        (f"  loop lag p99             {_ms(lag['p99'])} ms (max {_ms(lag['max'])})"
         + (f"; gevent hub lag p99 {_ms(r['hub_lag_s']['p99'])} ms" if "hub_lag_s" in r else "")),
        (f"  RSS before/conn/after    {_mb(r['rss_before_bytes'])} / {_mb(r['rss_connected_bytes'])} / "
         f"{_mb(r['rss_after_bytes'])} MiB; marginal {r['marginal_rss_connect_bytes'] / KB:.0f} KiB/sb "
         f"at connect, {r['marginal_rss_steady_bytes'] / KB:.0f} KiB/sb steady"),
        f"  threads {r['threads']}, fd high-water {r['fd_high_water']} (soft limit {r['fd_soft_limit']})",
        (f"  frames dropped/evicted   {r['frames_dropped']} / {r['frames_evicted']} "
         f"(budget {_mb(r['budget_limit_bytes'])} MiB, used at end {r['budget_used_bytes']} B)"),
        (f"  throughput               {r['mbps']:.1f} Mbps ({r['observations']} frames, "
         f"avg {r['frame_bytes_avg'] / KB:.1f} KiB)"),
        (f"  cpu client/host          {r['client_cpu_pct']:.0f}% / {r['host_cpu_pct']:.0f}% of a core, "
         f"{r['client_cpu_ms_per_step']:.2f} / {r['host_cpu_ms_per_step']:.2f} ms per step "
         f"(host RSS {_mb(r['host_rss_bytes'])} MiB); machine load avg up to {r['loadavg_max']:.1f}"),
        (f"  gc during rounds         {r['gc_collections']} collections ({r['gc_gen2_collections']} gen2), "
         f"longest pause {_ms(r['gc_pause_max_s'])} ms"
         + (" (heap frozen after connect)" if r["gc_freeze"] else "")),
        f"  step outcomes            {r['step_outcomes']}",
        *([f"  TEARDOWN FAILED          {r['teardown_error']}"] if "teardown_error" in r else []),
        (f"  sustained 1 Hz           {'yes' if r['sustained_1hz'] else 'NO'}"
         + (f" (steps spread over {r['spread_ms']:g} ms of each round)" if r["spread_ms"] else "")),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Main


def git_revision() -> str:
    """The commit the measured code is at, "+dirty" when the tree differs (the
    SDK changes between runs; results are only comparable at one revision)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "shinken_sync"],
                               cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default=",".join(map(str, DEFAULT_NS)), help="fleet sizes, comma-separated")
    p.add_argument("--rtt-ms", type=float, default=DEFAULT_RTT_MS, help="emulated round-trip time")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="measured rounds per run")
    p.add_argument("--face", choices=("sync", "async", "both"), default="both")
    p.add_argument("--callers", choices=("gevent", "threads"), default="gevent",
                   help="what drives the sync facade's Sandboxes")  # fmt: skip
    p.add_argument("--clicks", choices=("shared", "random"), default="shared",
                   help="shared: one spot per round for all (the host encodes once); "
                   "random: the host encodes every observation")
    p.add_argument("--spread-ms", type=float, default=0.0,
                   help="start each round's steps evenly over this window instead of all at once")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.collect(); gc.freeze() once the fleet is connected (caller-side idiom)")
    p.add_argument("--actions", type=int, default=1,
                   help="actions per step before the observation (moves, then a click)")
    p.add_argument("--gc-fleet", action="store_true",
                   help="shinken_sync.tune_gc_for_fleet() once the fleet is connected (freeze + thresholds)")
    p.add_argument("--transport", choices=("websockets", "fast", "both"), default="websockets",
                   help="the SDK's transport: websockets, the [fast] extra (picows + uvloop), or both in turn")
    p.add_argument("--async-loop", choices=("asyncio", "fair"), default="asyncio",
                   help="the async face's loop under --transport websockets: asyncio.run's, or "
                   "shinken_sync.sharedloop.new_fair_event_loop (bounded ready sockets per select)")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the raw-recv floor run that follows each N's faces")
    p.add_argument("--memory", default="",
                   help="fleet sizes for the marginal-RSS comparison: sync, async, websocket-client threads")
    p.add_argument("--drills", nargs="?", const=",".join(DRILL_MODES), default="",
                   help=f"run drills: all, or a comma-separated subset of {','.join(DRILL_MODES)}")
    p.add_argument("--drill-n", type=int, default=256, help="fleet size for the drills")
    p.add_argument("--period", type=float, default=ROUND_PERIOD_S, help="round period, seconds")
    p.add_argument("--keepalive-interval", type=float, default=0.0,
                   help="keepalive drill: base ping interval instead of the SDK's 20 s (short CI runs)")
    p.add_argument("--keepalive-jitter", type=float, default=0.0,
                   help=f"keepalive drill: ping_jitter of the jitter-on phase (default {PING_JITTER_S:g} s)")
    p.add_argument("--json", dest="json_out", help="write the full report here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        _child_main(args.child)
        return 0
    soft, hard = raise_fd_limit()
    ns = [int(x) for x in args.n.split(",") if x.strip()]
    drill_modes = [m for m in args.drills.split(",") if m]
    unknown = set(drill_modes) - set(DRILL_MODES)
    if unknown:
        raise SystemExit(f"unknown drill(s) {sorted(unknown)}; choose from {', '.join(DRILL_MODES)}")
    faces = ["sync", "async"] if args.face == "both" else [args.face]
    transports = ["websockets", "fast"] if args.transport == "both" else [args.transport]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    revision = git_revision()
    print(f"fleet gates {started}: N={ns} faces={faces} clicks={args.clicks} rtt={args.rtt_ms:g}ms "
          f"rounds={args.rounds} period={args.period:g}s actions={args.actions} gc_freeze={args.gc_freeze} gc_fleet={args.gc_fleet} "
          f"spread={args.spread_ms:g}ms fd limit {soft}/{hard} code {revision}", flush=True)  # fmt: skip
    for n in ns:
        if soft < 4 * n:
            print(f"warning: nofile soft limit {soft} < 4 x N = {4 * n}", flush=True)
    runs: list[dict[str, Any]] = []
    floors: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    memory_ns = [int(x) for x in args.memory.split(",") if x.strip()]
    drills: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        workdir = Path(tmp)
        drill_ns = {args.drill_n} if drill_modes else set()
        for n in sorted(set(ns) | drill_ns | set(memory_ns)):
            with FleetHost(n, args.rtt_ms, workdir) as host:
                print(f"\nfleet host N={n} ready in {host.ready_s:.1f}s (pid {host.proc.pid})", flush=True)
                base = {
                    "mode": "rounds", "n": n, "urls": host.urls, "token": host.token, "rtt_ms": args.rtt_ms,
                    "rounds": args.rounds, "period": args.period, "host_pid": host.proc.pid,
                    "ping_jitter": PING_JITTER_S if n >= 256 else 0.0, "callers": args.callers, "seed": n,
                    "clicks": args.clicks, "gc_freeze": args.gc_freeze, "gc_fleet": args.gc_fleet,
                    "actions": args.actions, "keepalive_interval": args.keepalive_interval,
                    "async_loop": args.async_loop,
                    "keepalive_jitter": args.keepalive_jitter,
                    "spread_ms": args.spread_ms,
                }  # fmt: skip
                if n in ns:
                    for transport in transports:
                        for face in faces:
                            report = run_child({**base, "face": face, "transport": transport}, workdir)
                            runs.append(report)
                            print(format_round_report(report), flush=True)
                    if args.floor:
                        floor = run_child({**base, "face": "floor"}, workdir)
                        floors.append(floor)
                        print(format_floor(floor, runs), flush=True)
                if n in memory_ns:
                    for client in ("sync", "async", "wsclient"):
                        report = run_child({**base, "mode": "memory", "face": client}, workdir)
                        memory.append(report)
                    print(format_memory([m for m in memory if m["n"] == n]), flush=True)
                if n in drill_ns:
                    for mode in drill_modes:
                        report = run_child({**base, "mode": mode, "face": "async"}, workdir)
                        drills[mode] = report
                        print(format_drill(mode, report), flush=True)
    gates = evaluate_gates(runs, drills, args.rtt_ms, memory)
    print("\ngates (seed section 7 targets):")
    print(format_gates(gates))
    if args.json_out:
        out = {"started": started, "revision": revision, "argv": sys.argv, "rtt_ms": args.rtt_ms, "runs": runs,
               "floors": floors, "memory": memory, "drills": drills, "gates": gates}  # fmt: skip
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    status = exit_status(gates)
    if status:
        print("\nat least one gate FAILED (exit status 1)", flush=True)
    return status


def format_floor(floor: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    if "error" in floor:
        return f"raw-recv floor N={floor['n']}: FAILED TO RUN\n{floor['error']}"
    base = floor["client_cpu_ms_per_step"]
    same = [r for r in runs if r["n"] == floor["n"] and "error" not in r]
    # CPU time comes in 10 ms ticks: a tiny run can measure 0
    ratios = ", ".join(f"{r['face']} {r['client_cpu_ms_per_step'] / base:.1f}x" if base else f"{r['face']} -"
                       for r in same)  # fmt: skip
    return (f"raw-recv floor N={floor['n']}: {base * 1000:.0f} us CPU per step (plain sockets, recv_into, no "
            f"decoding), round p50 {_ms(floor['round_wall_p50_s'])} ms; the faces above: {ratios}")


def format_memory(rows: list[dict[str, Any]]) -> str:
    lines = [f"marginal RSS per sandbox, N={rows[0]['n']}, {rows[0].get('screenshots_per_sandbox')} screenshots each:"]
    for m in rows:
        if "error" in m:
            lines.append(f"  {m.get('face', '?'):<9} FAILED TO RUN: {m['error'][-300:]}")
            continue
        lines.append(f"  {m['client']:<9} {m['marginal_steady_bytes'] / KB:6.0f} KiB steady "
                     f"({m['marginal_connect_bytes'] / KB:.0f} KiB at connect), {m['threads']} threads")
    return "\n".join(lines)


def format_drill(mode: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{mode} drill N={r['n']}: FAILED TO RUN\n{r['error']}"
    if mode == "stall":
        lines = [(f"stall drill N={r['n']}: {r['stalled']} of {r['connected']} consumers stalled; "
                  f"screencast {r['screencast']}")]  # fmt: skip
        for name, ph in r["phases"].items():
            rw = ph["others_round_wall_s"]
            ratio = ph.get("others_round_p50_ratio")
            lines.append(
                f"  {name:<22} budget {ph['budget_limit_bytes'] / MB:7.1f} MiB, used max "
                f"{ph['budget_used_max_bytes'] / MB:6.1f} MiB; evicted stalled/others "
                f"{ph['evicted_stalled']}/{ph['evicted_others']}; others' round p50/p95 "
                f"{_ms(rw['p50'])}/{_ms(rw['p95'])} ms" + (f" ({ratio:.2f}x baseline)" if ratio else "")
                + f"; client cpu {ph['client_cpu_ms_per_step']:.2f} ms/step, load {ph['loadavg_max']:.1f}"
            )
        lines.append(f"  frames dropped by the 32-frame bound: {r['frames_dropped_total']}; "
                     f"step outcomes {r['step_outcomes']}")  # fmt: skip
        return "\n".join(lines)
    if mode == "storm":
        b, d = r["survivors_round_wall_before_s"], r["survivors_round_wall_during_s"]
        conv = r["convergence_s"]
        ratio = r["survivors_round_p50_ratio"]
        return "\n".join([
            (f"storm drill N={r['n']}: killed {r['killed']} of {r['connected']} connections, "
             f"recovered {r['recovered']}, convergence {'-' if conv is None else f'{conv:.1f} s'}"),
            (f"  recovery p50/max {_ms(r['recovery_s']['p50'])}/{_ms(r['recovery_s']['max'])} ms; attempts "
             f"p50/max {r['reconnect_attempts']['p50']}/{r['reconnect_attempts']['max']}; failed attempts "
             f"{r['reconnect_failures'] or 0}; resumed seq gap p50/max {r['resumed_seq_gap']['p50']}/"
             f"{r['resumed_seq_gap']['max']}"),
            (f"  survivors' round p50/p95 before {_ms(b['p50'])}/{_ms(b['p95'])} ms, during "
             f"{_ms(d['p50'])}/{_ms(d['p95'])} ms" + (f" ({ratio:.2f}x)" if ratio else "")
             + f"; client cpu {r['client_cpu_ms_per_step_before']:.2f} / "
             f"{r['client_cpu_ms_per_step_during']:.2f} ms/step (incl. reconnects)"),
            f"  step outcomes {r['step_outcomes']}; the victims' losses classified as {r.get('loss_outcomes')}",
        ])  # fmt: skip
    lines = [(f"keepalive drill N={r['n']}: base ping interval {r['ping_interval_s']:g} s, pings per "
              f"{r.get('tick_s', PING_TICK_S) * 1000:.0f} ms tick across the fleet")]  # fmt: skip
    for label in ("jitter_off", "jitter_on"):
        ph = r[label]
        lines.append(
            f"  ping_jitter={ph['ping_jitter_s']:<4g} {ph['pings']} pings in {ph['window_s']:.0f} s over "
            f"{ph['busy_ticks']} ticks; max {ph['max_pings_per_tick']} per tick (N/10 = "
            f"{ph['target_max_per_tick']:.0f})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
