"""Shared measurement for the fleet bench: the plan's constants, /proc readers,
the click workload, per-step log, round pacing and the run report.

Used by the face runners (``fleet_faces.py``), the drills (``fleet_drills.py``),
the floor and memory runners, and the parent (``fleet.py``). Heavy imports
(the SDK, asyncio, gevent) happen inside functions: a child process must be
able to monkey-patch before they load.
"""

from __future__ import annotations

import random
import resource
import time
from collections.abc import Callable, Iterable
from typing import Any

import procfs
from fleet_gates import SUSTAINED_LATE_FRACTION
from procfs import cpu_seconds, fd_count, loadavg

from shinken_sync.stats import percentile

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


def summary(values: list[float], qs: Iterable[float] = (50, 95, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (shinken_sync.stats, the one definition), max and n; None for no data."""
    ordered = sorted(values)
    out: dict[str, float | None] = {f"p{q:g}": percentile(ordered, q) if ordered else None for q in qs}
    out["max"] = max(values) if values else None
    out["n"] = len(values)
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS/VmHWM (bytes) and Threads of a process, from /proc."""
    fields = procfs.status(pid)
    out = {key: int(fields[key].split()[0]) * KB for key in ("VmRSS", "VmHWM") if key in fields}
    out["Threads"] = int(fields["Threads"])
    return out


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



def raise_fd_limit() -> tuple[int, int]:
    """Soft nofile limit up to the hard limit; the fleet needs >= 4 x N."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def host_liveness(pid: int) -> Any:
    """A liveness probe over the fleet host process, as a provider would answer it."""
    from shinken_sync.providers.base import Liveness

    state = procfs.state(pid)
    if state is None:
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


def async_loop_name(spec: dict[str, Any]) -> str:
    """The async face's loop (``--async-loop``): ``asyncio``, ``uvloop`` or ``fair``;
    ``default`` is uvloop under ``--transport fast`` (what the [fast] extra's users
    run), else asyncio's own."""
    choice = spec.get("async_loop", "default")
    if choice == "default":
        return "uvloop" if spec.get("transport") == "fast" else "asyncio"
    return str(choice)


def loop_lag_probe(samples: list[float]):
    """A coroutine that records how late a short sleep wakes up (event-loop lag)."""
    import asyncio

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(LAG_PROBE_S)
            samples.append(max(0.0, loop.time() - t - LAG_PROBE_S))

    return probe()


def frame_counters(loop: Any) -> dict[str, Any]:
    import shinken_sync.client as client_mod

    b = client_mod.loop_frame_budget(loop)
    return {
        "frames_dropped": b.frames_dropped,
        "frames_evicted": b.frames_evicted,
        "budget_used_bytes": b.used_bytes,
        "budget_limit_bytes": b.limit,  # the loop's own limit
    }


def finish_report(
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
            "fair loop" if async_loop_name(spec) == "fair" else async_loop_name(spec)
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
        "async_loop": async_loop_name(spec) if spec["face"] == "async" else "sharedloop",
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
# Dialing and one timed step (both faces' async side, and the drills)


async def dial_all(urls: list[str], token: str, **options: Any):
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


async def timed_step(sb: Any, clicks: Clicks, log: StepLog, delay: float = 0.0, actions: int = 1) -> float:
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
