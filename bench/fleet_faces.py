"""One round runner for both faces, over the shared measurement.

:func:`run_face` runs in a fresh client process (``fleet.py --child``) and
returns the run's report (``fleet_measure.finish_report``): dial all N
sandboxes, run a warm-up round plus the measured rounds on the 1 Hz grid,
close. What differs between the faces -- how to dial, sleep and run one round
of steps -- is a small driver: :class:`SyncFace` (the blocking facade on a
SharedLoop, greenlet or thread callers) or :class:`AsyncFace` (the async core
on the process's own loop). Both use a 256 MiB per-loop frame budget.
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
from fleet_turns import TurnTracer

# ---------------------------------------------------------------------------
# The sync face: Sandbox on a SharedLoop, driven by greenlets or threads


class Callers:
    """``map(fn, items)`` over one caller per item: gevent greenlets or OS threads.

    ``each_round`` is the rounds' map: with greenlets, the same long-lived greenlet
    per position every round (a fleet's env workers, as a training loop keeps
    them), not a new greenlet per step. A greenlet's start and end cost an
    ``mmap``/``munmap`` pair for its Python frame stack on 3.11+, which at
    N=1024 was ~20% of the callers' thread's CPU: the driver's cost, not the
    SDK's. ``--spawn-callers`` keeps the old driver (a greenlet per step).
    OS threads come from a pool, so they are reused either way."""

    def __init__(self, kind: str, n: int, spawn_each_round: bool = False) -> None:
        self.kind = kind
        self._spawn_each_round = spawn_each_round or kind != "gevent"
        self._inboxes: list[Any] = []
        self._workers: list[Any] = []
        self._left = 0
        self._done: Any = None
        self._error: BaseException | None = None
        if kind == "gevent":
            import gevent.pool

            self._pool = gevent.pool.Pool(n)
        else:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fleet-caller")

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return list(self._pool.map(fn, items))

    def each_round(self, fn: Callable[[Any], Any], items: list[Any]) -> None:
        """``fn(item)`` for every item at once, each on its position's own caller."""
        if self._spawn_each_round:
            self.map(fn, items)
            return
        import gevent
        import gevent.event
        import gevent.queue

        if len(self._workers) != len(items):
            self._stop_workers()
            self._inboxes = [gevent.queue.Queue() for _ in items]
            self._workers = [gevent.spawn(self._work, inbox) for inbox in self._inboxes]
        self._left, self._done, self._error = len(items), gevent.event.Event(), None
        for inbox, item in zip(self._inboxes, items):
            inbox.put((fn, item))
        self._done.wait()
        if self._error is not None:
            raise self._error

    def _work(self, inbox: Any) -> None:
        while True:
            fn, item = inbox.get()
            try:
                fn(item)
            except BaseException as exc:  # noqa: BLE001 - reported by each_round; the worker lives on
                self._error = self._error or exc
            self._left -= 1
            if not self._left:
                self._done.set()

    def _stop_workers(self) -> None:
        if self._workers:
            import gevent

            gevent.killall(self._workers)
        self._workers, self._inboxes = [], []

    def sleep(self, seconds: float) -> None:
        if self.kind == "gevent":
            import gevent

            gevent.sleep(seconds)
        else:
            time.sleep(seconds)

    def close(self) -> None:
        self._stop_workers()
        if self.kind == "threads":
            self._pool.shutdown(wait=True)


class SyncFace:
    """The blocking facade: ``Sandbox`` objects on one SharedLoop, one caller
    (greenlet or thread) per sandbox."""

    name = "sync"

    def __init__(self, spec: dict[str, Any]) -> None:
        from shinken_sync.sharedloop import SharedLoop

        self.spec = spec
        self.callers = Callers(spec["callers"], spec["n"], spec.get("spawn_callers", False))
        self.shared = SharedLoop(frame_budget_bytes=FLEET_BUDGET_BYTES)
        self.loop = self.shared.loop
        self.hub_lag: list[float] = []
        self._hub_probe: Any = None
        self._probe: Any = None

    def dial_all(self) -> tuple[list[Any], dict[str, int]]:
        import threading

        from shinken_sync.errors import ShinkenError
        from shinken_sync.sync import connect

        if self.spec["callers"] == "gevent":
            import gevent

            def hub_probe() -> None:
                while True:
                    t = time.monotonic()
                    gevent.sleep(LAG_PROBE_S)
                    self.hub_lag.append(max(0.0, time.monotonic() - t - LAG_PROBE_S))

            self._hub_probe = gevent.spawn(hub_probe)
        dial_gate = threading.BoundedSemaphore(DIAL_CONCURRENCY)
        errors: dict[str, int] = {}

        def dial(url: str) -> Any:
            self.callers.sleep(random.uniform(0, DIAL_JITTER_S))
            with dial_gate:
                try:
                    return connect(url, token=self.spec["token"], loop=self.shared,
                                   ping_jitter=self.spec["ping_jitter"], rpc_timeout=RPC_TIMEOUT_S)  # fmt: skip
                except ShinkenError as exc:  # counted and reported; the run goes on with the rest
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    return None

        return [sb for sb in self.callers.map(dial, self.spec["urls"]) if sb is not None], errors

    def screen_size(self, sb: Any) -> tuple[int, int]:
        return sb.screen_size()

    def start_lag_probe(self, lag: list[float]) -> None:
        self._probe = self.shared.submit(loop_lag_probe(lag))

    def sleep(self, seconds: float) -> None:
        self.callers.sleep(seconds)

    def step_round(self, sandboxes: list[Any], clicks: Clicks, log: StepLog, spread: float) -> None:
        from shinken_sync.errors import ShinkenError

        def one_step(indexed: tuple[int, Any]) -> None:
            i, sb = indexed
            if spread:
                self.callers.sleep(i * spread)
            t = time.monotonic()
            try:
                result = sb.step(clicks.actions(self.spec["actions"]), observe=OBSERVE)
            except ShinkenError as exc:  # one failing sandbox never ends the round
                log.record(time.monotonic() - t, error=exc)
            else:
                log.record(time.monotonic() - t, result)

        self.callers.each_round(one_step, list(enumerate(sandboxes)))

    def clear(self) -> None:
        self.hub_lag.clear()

    def finish(self) -> dict[str, Any]:
        self._probe.cancel()
        if self._hub_probe is None:
            return {}
        self._hub_probe.kill()
        return {"hub_lag_s": summary(self.hub_lag)}

    def close(self, sandboxes: list[Any]) -> None:
        self.callers.map(lambda sb: sb.close(), sandboxes)
        self.callers.close()
        self.shared.close()


class AsyncFace:
    """The async core: ``AsyncSandbox`` objects on this process's own loop
    (``runner`` runs one coroutine on it at a time; between two the loop is
    idle for a few microseconds of this driver's code)."""

    name = "async"

    def __init__(self, spec: dict[str, Any], runner: Any) -> None:
        import asyncio

        self.spec = spec
        self.run = runner.run
        self.loop = runner.get_loop()
        self._sleep = asyncio.sleep
        self._probe: Any = None

    def dial_all(self) -> tuple[list[Any], dict[str, int]]:
        return self.run(dial_all(self.spec["urls"], self.spec["token"], ping_jitter=self.spec["ping_jitter"],
                                 frame_budget_bytes=FLEET_BUDGET_BYTES))  # fmt: skip

    def screen_size(self, sb: Any) -> tuple[int, int]:
        return self.run(sb.screen_size())

    def start_lag_probe(self, lag: list[float]) -> None:
        self._probe = self.loop.create_task(loop_lag_probe(lag))

    def sleep(self, seconds: float) -> None:
        self.run(self._sleep(seconds))

    def step_round(self, sandboxes: list[Any], clicks: Clicks, log: StepLog, spread: float) -> None:
        actions = self.spec["actions"]
        self.run(_gather([timed_step(sb, clicks, log, i * spread, actions) for i, sb in enumerate(sandboxes)]))

    def clear(self) -> None:
        pass

    def finish(self) -> dict[str, Any]:
        self._probe.cancel()
        return {}

    def close(self, sandboxes: list[Any]) -> None:
        self.run(_gather([sb.close() for sb in sandboxes], return_exceptions=True))


async def _gather(coros: list[Any], return_exceptions: bool = False) -> list[Any]:
    """``asyncio.gather`` as a coroutine (``Runner.run`` takes coroutines only)."""
    import asyncio

    return await asyncio.gather(*coros, return_exceptions=return_exceptions)


def run_face(spec: dict[str, Any], face: SyncFace | AsyncFace) -> dict[str, Any]:
    """One run of either face over the shared measurement: dial, warm up, the
    measured rounds on the period grid, the report, close."""
    fds = FdHighWater()
    rss: dict[str, int] = {"before": proc_status()["VmRSS"]}
    t = time.monotonic()
    sandboxes, connect_errors = face.dial_all()
    connect_s = time.monotonic() - t
    status = proc_status()
    rss.update(connected=status["VmRSS"], threads=status["Threads"])
    fds.sample()
    apply_gc_setting(spec)
    width, height = face.screen_size(sandboxes[0]) if sandboxes else (1, 1)
    clicks = Clicks(spec["clicks"], width, height)
    lag: list[float] = []
    face.start_lag_probe(lag)
    turns = TurnTracer(face.loop) if spec.get("trace_turns") else None
    log = StepLog()
    gc_pauses = GcPauses()

    def measure() -> None:
        if turns is not None:
            turns.reset()
        log.reset()
        lag.clear()
        face.clear()
        gc_pauses.clear()

    clock = RoundClock(spec["period"], spec["host_pid"], measure)
    spread = spec["spread_ms"] / 1000 / max(1, len(sandboxes))
    for k in range(WARMUP_ROUNDS + spec["rounds"]):
        face.sleep(clock.delay(k))
        started = clock.begin(k)
        clicks.next_round()
        face.step_round(sandboxes, clicks, log, spread)
        clock.end(k, started)
        fds.sample()
    frames = frame_counters(face.loop)
    extra = face.finish()
    if turns is not None:
        extra.update(turns.report())
    report = finish_report(
        spec, log, clock, lag, rss, fds, connect_s, len(sandboxes), connect_errors, frames, gc_pauses, extra
    )
    try:
        face.close(sandboxes)
    except Exception as exc:  # noqa: BLE001 - the measurement stands; the failed teardown is reported
        report["teardown_error"] = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    return report
