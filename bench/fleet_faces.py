"""The two faces' round runners: the blocking facade on a SharedLoop, and the async core.

Each runs in a fresh client process (``fleet.py --child``) and returns the
run's report (``fleet_measure.finish_report``): dial all N sandboxes, run a
warm-up round plus the measured rounds on the 1 Hz grid, close.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from fleet_measure import (
    DIAL_CONCURRENCY,
    DIAL_JITTER_S,
    FLEET_BUDGET_BYTES,
    LAG_PROBE_S,
    OBSERVE,
    RPC_TIMEOUT_S,
    WARMUP_ROUNDS,
    Clicks,
    FdHighWater,
    GcPauses,
    RoundClock,
    StepLog,
    apply_gc_setting,
    dial_all,
    finish_report,
    frame_counters,
    loop_lag_probe,
    proc_status,
    summary,
    timed_step,
)

# ---------------------------------------------------------------------------
# The sync face: Sandbox on a SharedLoop, driven by greenlets or threads


class Callers:
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


def run_sync_face(spec: dict[str, Any]) -> dict[str, Any]:
    import threading

    import shinken_sync.client as client_mod
    from shinken_sync.errors import ShinkenError
    from shinken_sync.sharedloop import SharedLoop
    from shinken_sync.sync import connect

    client_mod.GLOBAL_FRAME_BUDGET_BYTES = FLEET_BUDGET_BYTES
    urls, token, n = spec["urls"], spec["token"], spec["n"]
    callers = Callers(spec["callers"], n)
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
    probe = shared.submit(loop_lag_probe(lag))
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
    frames = frame_counters(loop)
    probe.cancel()
    extra: dict[str, Any] = {}
    if spec["callers"] == "gevent":
        hub_probe_g.kill()
        extra["hub_lag_s"] = summary(hub_lag)
    report = finish_report(
        spec, log, clock, lag, rss, fds, connect_s, len(sandboxes), connect_errors, frames, gc_pauses, extra
    )
    try:
        callers.map(lambda sb: sb.close(), sandboxes)
        callers.close()
        shared.close()
    except Exception as exc:  # noqa: BLE001 - the measurement stands; the failed teardown is reported
        report["teardown_error"] = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return report


async def run_async_face(spec: dict[str, Any]) -> dict[str, Any]:
    import asyncio

    import shinken_sync.client as client_mod

    client_mod.GLOBAL_FRAME_BUDGET_BYTES = FLEET_BUDGET_BYTES
    loop = asyncio.get_running_loop()
    fds = FdHighWater()
    rss: dict[str, int] = {"before": proc_status()["VmRSS"]}
    t = time.monotonic()
    sandboxes, connect_errors = await dial_all(
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
    probe = asyncio.ensure_future(loop_lag_probe(lag))
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
            *(timed_step(sb, clicks, log, i * spread, spec["actions"]) for i, sb in enumerate(sandboxes))
        )
        clock.end(k, started)
        fds.sample()
    probe.cancel()
    frames = frame_counters(loop)
    report = finish_report(
        spec, log, clock, lag, rss, fds, connect_s, len(sandboxes), connect_errors, frames, gc_pauses
    )
    await asyncio.gather(*(sb.close() for sb in sandboxes), return_exceptions=True)
    return report
