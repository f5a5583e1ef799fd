"""The frame queues and the per-loop byte budget, without sockets; then through the client."""

from __future__ import annotations

import asyncio
import random

import pytest

from shinken_sync import client
from shinken_sync.client import aconnect, loop_frame_budget
from shinken_sync.framebudget import (
    _MIN_SWEEP,
    EMPTY,
    FrameBudget,
    FrameCounters,
    FrameQueue,
    budget_for_loop,
)

LOST = object()


def drain(queue: FrameQueue) -> list:
    out = []
    while (item := queue.pop()) is not EMPTY and item is not queue.terminal:
        out.append(item)
    return out


def test_count_bound_drops_the_oldest():
    budget = FrameBudget()
    queue = FrameQueue(budget, max_frames=32)
    for seq in range(1, 41):
        assert queue.push(seq, 100)
    assert len(queue) == 32 and queue.counters.frames_dropped == 8
    assert budget.used_bytes == 3200 and budget.frames_dropped == 8 and budget.frames_evicted == 0
    assert drain(queue) == list(range(9, 41))
    assert budget.used_bytes == 0 and budget.queued_frames == 0


def test_used_bytes_never_exceed_the_budget():
    rng = random.Random(4)
    budget = FrameBudget(limit=50_000)
    queues = [FrameQueue(budget, max_frames=rng.randint(1, 40)) for _ in range(8)]
    for _ in range(20_000):
        queue = rng.choice(queues)
        if rng.random() < 0.6:
            queue.push(object(), rng.randint(1, 12_000))
        else:
            queue.pop()
        assert budget.used_bytes <= budget.limit
        assert budget.used_bytes == sum(q.counters.used_bytes for q in queues)
        assert budget.queued_frames == sum(len(q) for q in queues)
    assert budget.frames_evicted > 0  # the budget did bite
    assert budget.frames_evicted == sum(q.counters.frames_evicted for q in queues)


def test_eviction_hits_the_stalled_queue_first():
    budget = FrameBudget(limit=10_000)
    stalled, live = FrameQueue(budget), FrameQueue(budget)
    for seq in range(8):  # the stalled consumer's frames are the oldest anywhere
        stalled.push(("stalled", seq), 1000)
    for seq in range(100):  # a live consumer keeps up, its queue holds 1-5 frames
        live.push(("live", seq), 1000)
        if seq % 5 == 4:
            drain(live)
    assert live.counters.frames_evicted == 0
    # 5 live frames at the peak leave room for 5 stalled ones: its 3 oldest went
    assert stalled.counters.frames_evicted == 3 == budget.frames_evicted
    assert drain(stalled) == [("stalled", seq) for seq in range(3, 8)]


def test_sentinel_survives_eviction_and_ends_the_queue():
    budget = FrameBudget(limit=3000)
    dead, other = FrameQueue(budget), FrameQueue(budget)
    dead.push("d1", 1000)
    dead.end(LOST)
    assert not dead.push("late", 10)  # nothing after the sentinel
    for seq in range(10):
        other.push(seq, 1000)
    assert dead.counters.frames_evicted == 1 and len(dead) == 0
    assert dead.pop() is LOST and dead.pop() is LOST  # stays, never consumed or evicted
    dead.end(object())
    assert dead.terminal is LOST  # the first sentinel wins


def test_clear_releases_bytes_and_keeps_the_sentinel():
    budget = FrameBudget()
    group = FrameCounters()
    queue = FrameQueue(budget, group=group)
    for seq in range(5):
        queue.push(seq, 500)
    assert group.used_bytes == 2500 == budget.used_bytes
    queue.end(LOST)
    queue.clear()
    assert budget.used_bytes == 0 and group.used_bytes == 0 and group.queued_frames == 0
    assert queue.pop() is LOST


def test_budget_smaller_than_one_frame_admits_nothing():
    budget = FrameBudget(limit=5000)
    small, queue = FrameQueue(budget), FrameQueue(budget)
    small.push("kept", 4000)
    assert not queue.push("huge", 6000)
    assert len(queue) == 0 and queue.counters.frames_evicted == 1
    assert small.pop() == "kept"  # an oversize frame evicts nobody else
    tiny = FrameBudget(limit=0)
    assert not FrameQueue(tiny).push("any", 1) and tiny.used_bytes == 0


def test_lowering_the_limit_applies_at_the_next_push():
    budget = FrameBudget()
    queue = FrameQueue(budget)
    for seq in range(10):
        queue.push(seq, 1000)
    budget.limit = 3000
    assert budget.used_bytes == 10_000  # nothing evicted until a push
    queue.push(10, 1000)
    assert budget.used_bytes == 3000 and drain(queue) == [8, 9, 10]


def test_stale_entries_are_swept():
    budget = FrameBudget(limit=10**9)
    stalled, live = FrameQueue(budget), FrameQueue(budget)
    stalled.push("head", 1)  # pins the FIFO head: head-drain alone could not clean behind it
    for seq in range(10_000):
        live.push(seq, 1)
        live.pop()
    assert len(budget._order) <= 2 * budget.queued_frames + _MIN_SWEEP


def test_one_budget_per_loop():
    loops = [asyncio.new_event_loop() for _ in range(2)]
    try:
        assert budget_for_loop(loops[0]) is budget_for_loop(loops[0])
        assert budget_for_loop(loops[0]) is not budget_for_loop(loops[1])
    finally:
        for loop in loops:
            loop.close()


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        FrameBudget(limit=-1)
    with pytest.raises(ValueError):
        FrameQueue(FrameBudget(), max_frames=0)


def test_client_budget_spans_connections_and_spares_the_live_consumer(run, peer, helpers, monkeypatch):
    """Two connections on one loop: one never reads its stream, one keeps up."""
    frame_size = len(helpers.frame("s1", 1, size=10_000))
    monkeypatch.setattr(client, "GLOBAL_FRAME_BUDGET_BYTES", 6 * frame_size)

    async def script(ws):
        (call,) = await helpers.calls(ws, 1)
        await helpers.answer(ws, call)  # screencast_start -> stream "s1"
        for seq in range(1, 41):
            await ws.send(helpers.frame("s1", seq, size=10_000))
            await asyncio.sleep(0.002)
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url:
            stalled_sb = await aconnect(url, "test-token")
            live_sb = await aconnect(url, "test-token")
            stalled = await stalled_sb.screencast()
            live = await live_sb.screencast()
            budget = loop_frame_budget()
            got = []
            while len(got) < 40:
                frame = await live.next_frame(timeout=5)
                got.append(frame.seq)
                assert budget.used_bytes <= client.GLOBAL_FRAME_BUDGET_BYTES
            assert got == list(range(1, 41))  # the live consumer lost nothing
            assert live.counters.frames_evicted == 0
            assert stalled.counters.frames_evicted > 0
            assert stalled_sb.frame_counters.frames_evicted == stalled.counters.frames_evicted
            assert budget.frames_evicted == stalled.counters.frames_evicted
            await stalled_sb.close()  # closing releases the stalled connection's bytes
            assert stalled_sb.frame_counters.used_bytes == 0
            assert budget.used_bytes == live_sb.frame_counters.used_bytes
            await live_sb.close()
            assert budget.used_bytes == 0

    run(body())


def _pushing_script(helpers, frames: int = 20):
    async def script(ws):
        (call,) = await helpers.calls(ws, 1)
        await helpers.answer(ws, call)  # screencast_start -> stream "s1"
        for seq in range(1, frames + 1):
            await ws.send(helpers.frame("s1", seq, size=10_000))
        await helpers.serve_forever(ws)

    return script


async def _stalled_stream(url, frames: int = 20, **options):
    """A connection whose stream gets ``frames`` frames that nobody reads."""
    sb = await aconnect(url, "test-token", **options)
    stream = await sb.screencast()
    while stream.counters.queued_frames + stream.counters.frames_evicted + stream.counters.frames_dropped < frames:
        await asyncio.sleep(0.01)
    return sb, stream


def test_a_per_loop_budget_is_not_overridden_by_the_global_default(run, peer, helpers, monkeypatch):
    """The global used to be copied into the loop's budget at every frame."""
    frame_size = len(helpers.frame("s1", 1, size=10_000))
    monkeypatch.setattr(client, "GLOBAL_FRAME_BUDGET_BYTES", None)

    async def body():
        async with peer(_pushing_script(helpers)) as url:
            budget = loop_frame_budget()
            budget.limit = 3 * frame_size  # this loop's own limit
            sb, stream = await _stalled_stream(url)
            assert budget.limit == 3 * frame_size
            assert stream.counters.frames_evicted > 0 and budget.used_bytes <= 3 * frame_size
            await sb.close()

    run(body())


def test_aconnect_sets_its_loops_budget_and_the_global_is_only_a_default(run, peer, helpers, monkeypatch):
    frame_size = len(helpers.frame("s1", 1, size=10_000))
    monkeypatch.setattr(client, "GLOBAL_FRAME_BUDGET_BYTES", 4 * frame_size)

    async def body():
        async with peer(_pushing_script(helpers)) as url:
            sb, _ = await _stalled_stream(url, frame_budget_bytes=2 * frame_size)
            budget = loop_frame_budget()
            assert budget.limit == 2 * frame_size and budget.used_bytes <= 2 * frame_size
            client.GLOBAL_FRAME_BUDGET_BYTES = None  # read at creation only: this loop keeps its limit
            other, _ = await _stalled_stream(url)
            assert budget.limit == 2 * frame_size and budget.used_bytes <= 2 * frame_size
            await asyncio.gather(sb.close(), other.close())
        with pytest.raises(ValueError, match="frame_budget_bytes"):
            await aconnect(url, "test-token", frame_budget_bytes=-1)

    run(body())


def test_a_shared_loop_has_its_own_budget(peer, helpers, monkeypatch):
    from shinken_sync.sharedloop import SharedLoop
    from shinken_sync.sync import connect

    frame_size = len(helpers.frame("s1", 1, size=10_000))
    monkeypatch.setattr(client, "GLOBAL_FRAME_BUDGET_BYTES", 50 * frame_size)

    async def serve(ready, stop):
        async with peer(_pushing_script(helpers)) as url:
            ready.set_result(url)
            await stop

    import threading

    server_loop = asyncio.new_event_loop()
    ready, stop = server_loop.create_future(), server_loop.create_future()
    thread = threading.Thread(target=server_loop.run_until_complete, args=(serve(ready, stop),))
    thread.start()
    try:
        url = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(ready), 10), server_loop).result()
        shared = SharedLoop("own-budget", frame_budget_bytes=2 * frame_size)
        with shared, connect(url, "test-token", loop=shared) as sb:
            stream = sb.screencast()
            budget = shared.run(_budget())
            assert budget.limit == 2 * frame_size
            for _ in range(500):
                if stream.counters.frames_evicted:
                    break
                shared.run(asyncio.sleep(0.01))
            assert stream.counters.frames_evicted > 0 and budget.limit == 2 * frame_size
    finally:
        server_loop.call_soon_threadsafe(stop.set_result, None)
        thread.join(10)
        server_loop.close()
    with pytest.raises(ValueError, match="frame_budget_bytes"):
        SharedLoop("bad", frame_budget_bytes=-5)


async def _budget():
    return loop_frame_budget()
