"""The drills on the async core: stall (frame budget), storm (reconnect + resume), keepalive.

Each runs in a fresh client process and returns its report; the verdicts are
``fleet_gates.py``'s. A drill round steps a chosen set of sandboxes and keeps
each one's latency, so "the others' round time" is the max over the others.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import Any

from fleet_gates import GATE_STORM_CONVERGENCE_S, keepalive_target, pings_per_tick
from fleet_measure import (
    FLEET_BUDGET_BYTES,
    KEEPALIVE_WINDOW_PERIODS,
    PING_JITTER_S,
    PING_TICK_S,
    RPC_TIMEOUT_S,
    SCREENCAST,
    STALL_FRACTION,
    STALL_ROUNDS,
    STORM_FRACTION,
    Clicks,
    FdHighWater,
    StepLog,
    backoff_delay,
    cpu_seconds,
    dial_all,
    host_liveness,
    loadavg,
    summary,
    timed_step,
)


async def drill_round(sandboxes: dict[int, Any], clicks: Clicks, log: StepLog) -> dict[int, float]:
    import asyncio

    keys = list(sandboxes)
    clicks.next_round()
    walls = await asyncio.gather(*(timed_step(sandboxes[i], clicks, log) for i in keys))
    return dict(zip(keys, walls))


def group_wall(per_round: list[dict[int, float]], members: set[int]) -> list[float]:
    """Each round's wall-clock as seen by ``members`` alone (the slowest of them)."""
    return [max(lat for i, lat in r.items() if i in members) for r in per_round if members & r.keys()]


async def paced_rounds(
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


async def drill_setup(spec: dict[str, Any], **dial_options: Any):
    import asyncio

    import shinken_sync.client as client_mod

    client_mod.GLOBAL_FRAME_BUDGET_BYTES = FLEET_BUDGET_BYTES
    sandboxes, errors = await dial_all(spec["urls"], spec["token"], **dial_options)
    fds = FdHighWater()
    if not sandboxes:
        raise RuntimeError(f"no sandbox connected: {errors}")
    width, height = await sandboxes[0].screen_size()
    clicks = Clicks(spec["clicks"], width, height)
    return asyncio.get_running_loop(), dict(enumerate(sandboxes)), errors, clicks, fds


def ratio(after: float | None, before: float | None) -> float | None:
    return None if not after or not before else after / before


async def drill_stall(spec: dict[str, Any]) -> dict[str, Any]:
    """Screencasts everywhere, 256 MiB budget on, 10% of consumers stop reading."""
    import asyncio

    from shinken_sync.client import loop_frame_budget
    from shinken_sync.errors import FrameTimeout

    loop, sandboxes, errors, clicks, fds = await drill_setup(spec, ping_jitter=PING_JITTER_S)
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
    settling = False  # the limit was lowered and no push has evicted down to it yet

    def sample_budget() -> None:
        nonlocal used_max, settling
        # A new limit evicts at the next frame push; until then the bytes
        # queued under the old one may exceed it.
        settling = settling and budget.limit is not None and budget.used_bytes > budget.limit
        if not settling:
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
            per_round.append(await drill_round(sandboxes, clicks, log))
            load.append(loadavg())

        await paced_rounds(rounds, spec["period"], body)
        evicted = {i: streams[i].counters.frames_evicted - evicted0[i] for i in sandboxes}
        phases[name] = {
            # the loop's whole cost (steps, frames consumed, evictions) per step:
            # unlike wall-clock, it does not move with the machine's other load
            "client_cpu_ms_per_step": 1000 * (cpu_seconds() - cpu0) / max(1, log.frames - steps0),
            "loadavg_max": max(load),
            "budget_limit_bytes": budget.limit,
            "budget_used_max_bytes": used_max,
            "used_within_budget": budget.limit is None or used_max <= budget.limit,
            "evicted_stalled": sum(evicted[i] for i in stalled),
            "evicted_others": sum(evicted[i] for i in others),
            "others_round_wall_s": summary(group_wall(per_round, others), (50, 95)),
        }

    await phase("baseline", max(5, spec["rounds"] // 2))
    for i in stalled:
        consumers[i].cancel()
    await phase("stalled_256MiB", STALL_ROUNDS)
    # 10% of N x 32-frame queues cannot fill 256 MiB at this N, so the budget
    # above never had to evict. Shrink the loop's budget (a limit change applies
    # at the next push) under what the stalled queues hold now, so eviction
    # really runs, and check that it still hits only the stalled streams.
    tight = max(4 * int(log.bytes / max(1, log.frames)), budget.used_bytes // 2)
    settling = True
    budget.limit = tight
    await phase("stalled_tight_budget", max(5, spec["rounds"] // 2))
    watcher.cancel()
    for task in consumers.values():
        task.cancel()
    base = phases["baseline"]["others_round_wall_s"]["p50"]
    for name in ("stalled_256MiB", "stalled_tight_budget"):
        phases[name]["others_round_p50_ratio"] = ratio(phases[name]["others_round_wall_s"]["p50"], base)
    report = {
        "n": spec["n"], "connected": n, "connect_errors": errors, "stalled": len(stalled),
        "screencast": SCREENCAST, "phases": phases,
        "frames_consumed_others": sum(consumed[i] for i in others),
        "frames_dropped_total": budget.frames_dropped, "step_outcomes": log.outcomes,
        "fd_high_water": fds.value,
    }  # fmt: skip
    await asyncio.gather(*(sb.close() for sb in sandboxes.values()), return_exceptions=True)
    return report


async def drill_storm(spec: dict[str, Any]) -> dict[str, Any]:
    """Abort 25% of the connections; reconnect with full-jitter backoff + resume."""
    import asyncio

    from shinken_sync.client import aconnect
    from shinken_sync.errors import FrameTimeout, ShinkenError, StreamLost, classify_exception
    from shinken_sync.transport import abort as abort_transport

    # The provider's view, as a real fleet would wire it: the host process is alive.
    probe = functools.partial(host_liveness, spec["host_pid"])
    _, sandboxes, errors, clicks, fds = await drill_setup(spec, ping_jitter=PING_JITTER_S, liveness_probe=probe)
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
        rows.append(await drill_round(dict(up), clicks, log))

    cpu = [(cpu_seconds(), log.frames)]
    await paced_rounds(max(5, spec["rounds"] // 2), spec["period"], lambda: round_into(before))
    cpu.append((cpu_seconds(), log.frames))
    t_kill = time.monotonic()
    for i in victims:
        # Abrupt loss without a closing handshake, as a network blip looks: the
        # TCP connection is reset under the WebSocket (a private attribute; the
        # SDK has no "break my connection" call, rightly).
        abort_transport(sandboxes[i]._ws)
    await paced_rounds(
        int(GATE_STORM_CONVERGENCE_S * 1.5 / spec["period"]), spec["period"], lambda: round_into(during),
        until=lambda: len(recovered_at) == len(victims) and len(during) >= max(5, spec["rounds"] // 2),
    )  # fmt: skip
    cpu.append((cpu_seconds(), log.frames))
    for task in consumers:
        task.cancel()
    (c0, f0), (c1, f1), (c2, f2) = cpu
    cpu_ms = [1000 * (c1 - c0) / max(1, f1 - f0), 1000 * (c2 - c1) / max(1, f2 - f1)]
    base = summary(group_wall(before, survivors), (50, 95))
    storm = summary(group_wall(during, survivors), (50, 95))
    converged = len(recovered_at) == len(victims)
    report = {
        "n": spec["n"], "connected": n, "connect_errors": errors, "killed": len(victims),
        "recovered": len(recovered_at), "convergence_s": max(recovered_at.values()) if converged else None,
        "recovery_s": summary(list(recovered_at.values())),
        "reconnect_attempts": summary([float(a) for a in attempts.values()], (50, 99)),
        "reconnect_failures": failures,
        "resumed_seq_gap": summary([float(g) for g in seq_gaps.values()], (50,)),
        "survivors_round_wall_before_s": base, "survivors_round_wall_during_s": storm,
        "survivors_round_p50_ratio": ratio(storm["p50"], base["p50"]),
        "client_cpu_ms_per_step_before": cpu_ms[0], "client_cpu_ms_per_step_during": cpu_ms[1],
        "step_outcomes": log.outcomes, "loss_outcomes": loss_outcomes, "fd_high_water": fds.value,
    }  # fmt: skip
    await asyncio.gather(*(sb.close() for sb in sandboxes.values()), return_exceptions=True)
    return report


async def drill_keepalive(spec: dict[str, Any]) -> dict[str, Any]:
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
        sandboxes, errors = await dial_all(spec["urls"], spec["token"], ping_jitter=jitter)
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


DRILLS = {"stall": drill_stall, "storm": drill_storm, "keepalive": drill_keepalive}
