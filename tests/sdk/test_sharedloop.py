"""SharedLoop: the native loop thread behind every blocking Sandbox.

These run plain and (tox ``gevent`` env) inside a patched process, where the
"threads" below are greenlets and every wait takes the hub-callback path. The
scenarios that need a fresh interpreter (fork, exit, patching order) run in a
subprocess under ``-W error`` so both runs cover them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import socket
import threading
import time

import pytest

from shinken_sync.errors import ShinkenError
from shinken_sync.sharedloop import LoopClosed, LoopThreadDied, LoopTimeout, SharedLoop
from tests.support import clean_stdout, native_thread_count, run_script

#: Bound on the hub's 99th-percentile gap between 2 ms ticks while greenlets
#: wait on the loop: generous for a shared, noisy 2-core machine.
MAX_HUB_GAP_P99_MS = 250


@pytest.fixture
def shared():
    loop = SharedLoop("test-loop")
    yield loop
    loop.close()




async def echo(value, delay: float = 0.0):
    await asyncio.sleep(delay)
    return value


async def fail(exc: BaseException):
    await asyncio.sleep(0)
    raise exc


def test_run_returns_the_result_and_raises_the_coroutines_own_error(shared):
    assert shared.run(echo(42)) == 42
    with pytest.raises(KeyError, match="missing"):
        shared.run(fail(KeyError("missing")))


def test_the_loop_runs_in_its_own_native_thread(shared):
    async def where():
        return threading.get_native_id()

    assert shared.run(where()) != threading.get_native_id()
    assert shared.loop.is_running()


def test_run_timeout_cancels_the_coroutine(shared):
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(LoopTimeout) as info:
        shared.run(slow(), timeout=0.1)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, ShinkenError)
    assert info.value.timeout == 0.1
    assert shared.run(echo("after"), timeout=5) == "after"  # the cancellation has run by now
    assert cancelled == [True]


def test_submit_returns_a_future_that_can_be_cancelled(shared):
    fast = shared.submit(echo("fast"))
    slow = shared.submit(echo("slow", delay=60))
    assert fast.result(timeout=5) == "fast" and fast.done()
    with pytest.raises(LoopTimeout):
        slow.result(timeout=0.05)  # waiting out a deadline leaves the task running
    assert not slow.done()
    slow.cancel()
    with pytest.raises(concurrent.futures.CancelledError):
        slow.result(timeout=5)


def test_many_threads_share_one_loop_thread(shared):
    shared.run(echo(None))
    before = native_thread_count()
    results: dict[int, list[int]] = {}

    def worker(n: int) -> None:
        results[n] = [shared.run(echo(n * 1000 + i), timeout=10) for i in range(50)]

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {n: [n * 1000 + i for i in range(50)] for n in range(32)}
    # Only the callers' own threads came and went; the loop added none.
    assert native_thread_count(settle_to=before) == before


def test_a_blocking_call_from_the_loop_thread_is_refused(shared):
    async def reenter():
        with pytest.raises(RuntimeError, match="deadlock"):
            shared.run(echo(1))
        return "refused"

    assert shared.run(reenter()) == "refused"


def test_callers_own_asyncio_run_works_beside_it(shared):
    assert shared.run(echo("shared")) == "shared"
    assert asyncio.run(echo("own")) == "own"
    assert shared.run(echo("still")) == "still"


def test_loop_thread_death_fails_every_waiter(shared):
    shared.run(echo(None))
    errors: list[BaseException] = []
    started = threading.Barrier(9)

    def waiter() -> None:
        future = shared.submit(echo("never", delay=60))
        started.wait(10)
        try:
            future.result()  # no deadline: only the loop's death can end this
        except BaseException as exc:  # noqa: BLE001 -- collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait(10)

    def die() -> None:
        raise SystemExit("simulated crash of the loop thread")

    shared.loop.call_soon_threadsafe(die)
    for t in threads:
        t.join(30)
    assert len(errors) == 8
    assert all(isinstance(e, LoopThreadDied) for e in errors), errors
    assert isinstance(errors[0].__cause__, SystemExit)
    with pytest.raises(LoopThreadDied):
        shared.run(echo(1), timeout=5)


def test_close_fails_pending_calls_closes_tracked_resources_and_refuses_new_work(shared):
    closed = []

    class Resource:
        async def close(self):
            closed.append(True)

    resource = Resource()
    shared.track(resource)
    pending = shared.submit(echo("never", delay=60))
    shared.close()
    with pytest.raises(LoopClosed):
        pending.result(timeout=5)
    assert closed == [True]
    coro = echo(1)
    with pytest.raises(LoopClosed):
        shared.run(coro)
    assert coro.cr_frame is None  # closed, so no "never awaited" warning
    shared.close()  # idempotent


def test_default_is_shared_and_replaced_once_closed():
    first = SharedLoop.default()
    assert SharedLoop.default() is first
    first.close()
    second = SharedLoop.default()
    assert second is not first
    assert second.run(echo("fresh")) == "fresh"


def test_fork_child_gets_a_fresh_loop_and_parents_calls_fail_in_it():
    result = run_script(
        """
        import asyncio, os, warnings
        # Python >= 3.12 warns on fork() in a multi-threaded process; that is the point here.
        warnings.filterwarnings("ignore", ".*multi-threaded.*fork", DeprecationWarning)
        from shinken_sync.sharedloop import LoopThreadDied, SharedLoop

        async def echo(v, delay=0.0):
            await asyncio.sleep(delay)
            return v

        shared = SharedLoop.default()
        assert shared.run(echo("parent")) == "parent"
        inherited = shared.submit(echo("never", delay=60))
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                assert SharedLoop.default() is shared
                assert shared.run(echo("child"), timeout=10) == "child"
                try:
                    inherited.result(timeout=10)
                    code = 3
                except LoopThreadDied:
                    pass
            except BaseException:
                import traceback; traceback.print_exc()
                code = 2
            shared.close()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        inherited.cancel()
        assert shared.run(echo("parent again")) == "parent again"
        print("ok")
        """
    )
    assert clean_stdout(result).strip() == "ok"


EXIT_WITH_WORK_IN_FLIGHT = """
    import asyncio, sys, threading
    if sys.argv[1] == "patch-first":
        from gevent import monkey; monkey.patch_all()
    from shinken_sync.sharedloop import LoopClosed, SharedLoop
    if sys.argv[1] == "patch-after":
        from gevent import monkey; monkey.patch_all()

    class Resource:
        async def close(self):
            await asyncio.sleep(0.01)
            print("resource closed")

    SharedLoop("dropped").run(asyncio.sleep(0))  # started, never closed, no reference kept
    shared = SharedLoop.default()
    resource = Resource()                   # tracked weakly: the program holds it
    shared.track(resource)
    shared.submit(asyncio.sleep(3600))      # a task nobody waits for
    started = threading.Event()

    def blocked():                           # a non-daemon thread stuck in a call at exit
        started.set()
        try:
            shared.run(asyncio.sleep(3600))
        except LoopClosed:
            print("blocked call released")

    threading.Thread(target=blocked).start()
    started.wait(10)
    print("exiting")
"""


@pytest.mark.parametrize("patching", ["plain", "patch-first", "patch-after"])
def test_interpreter_exit_with_work_in_flight_is_clean(patching):
    if patching != "plain":
        pytest.importorskip("gevent")
    result = run_script(EXIT_WITH_WORK_IN_FLIGHT, patching)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "exiting"
    assert sorted(lines[1:]) == ["blocked call released", "resource closed"]
    assert result.stderr == ""


def test_a_dropped_loop_keeps_running_until_closed_at_exit():
    dropped = SharedLoop("dropped")
    dropped.run(echo(None))
    thread = dropped._thread
    del dropped
    import gc

    gc.collect()
    assert not thread.exited.done  # still serving: nothing closed it behind the program's back
    from shinken_sync import sharedloop

    (survivor,) = [loop for loop in sharedloop._STARTED if loop._thread is thread]
    survivor.close()
    assert thread.exited.done


def test_greenlets_wait_cooperatively_and_the_hub_keeps_running():
    """Patched before or after import, 200 greenlets blocked on the loop leave
    the hub free: a ticker greenlet keeps ticking, and the caller's own
    ``asyncio.run()`` in another greenlet works beside the shared loop.

    (Two greenlets of one thread cannot both be inside ``asyncio.run()``:
    asyncio keeps one running loop per OS thread.)"""
    pytest.importorskip("gevent")
    source = """
        import sys
        if sys.argv[1] == "patch-first":
            from gevent import monkey; monkey.patch_all()
        import asyncio, time
        from shinken_sync.sharedloop import SharedLoop
        if sys.argv[1] == "patch-after":
            from gevent import monkey; monkey.patch_all()
        import gevent

        async def echo(v):
            # Long enough that the run spans a few hundred ticks: the p99 below
            # then leaves out the few gaps a descheduled process makes.
            await asyncio.sleep(0.02)
            return v

        shared = SharedLoop.default()
        ticks = []

        def ticker():
            while True:
                gevent.sleep(0.002)
                ticks.append(time.perf_counter())

        def worker(n):
            got = [shared.run(echo(n * 100 + i), timeout=30) for i in range(20)]
            assert got == [n * 100 + i for i in range(20)]

        async def own(k):
            for _ in range(k):
                await asyncio.sleep(0.001)
            return k

        tick = gevent.spawn(ticker)
        gevent.sleep(0.01)
        start = len(ticks)
        workers = [gevent.spawn(worker, n) for n in range(200)]
        # The caller's own loop, in this greenlet, while the workers wait on the shared one.
        assert asyncio.run(own(20)) == 20
        gevent.joinall(workers, raise_error=True)
        during = len(ticks) - start
        tick.kill()
        gaps = sorted(b - a for a, b in zip(ticks, ticks[1:]))
        print(during, round(gaps[len(gaps) * 99 // 100] * 1000, 1), round(gaps[-1] * 1000, 1))
    """
    for patching in ("patch-first", "patch-after"):
        result = run_script(source, patching)
        ticks_during, gap_p99_ms, gap_max_ms = clean_stdout(result).split()
        # The ticker ran while the greenlets waited: a hub frozen by a blocking
        # wait could not tick.
        assert int(ticks_during) > 0
        # A hub frozen for each call shows up in most gaps, so the 99th percentile
        # catches it; the max is only reported, since on a loaded machine the OS
        # can deschedule the whole process for a while (bench/ measures the figures).
        assert float(gap_p99_ms) < MAX_HUB_GAP_P99_MS, result.stdout
        print(f"{patching}: {ticks_during} ticks, gap p99 {gap_p99_ms} ms, max {gap_max_ms} ms")


# -- fair scheduling: bounded starts per turn, bounded events per select ------


def _turn_counter(loop: asyncio.AbstractEventLoop) -> list[int]:
    """A one-element list holding the loop's iteration count (a call_soon ticker)."""
    turn = [0]

    def tick() -> None:
        turn[0] += 1
        loop.call_soon(tick)

    loop.call_soon_threadsafe(tick)
    return turn


def test_a_burst_of_submissions_starts_a_bounded_slice_per_turn(shared):
    from shinken_sync import sharedloop

    turn = _turn_counter(shared.loop)
    started: list[int] = []

    async def record() -> None:
        started.append(turn[0])

    async def block_the_loop() -> None:
        time.sleep(0.3)  # noqa: ASYNC251 -- on purpose: everything below is posted while the loop cannot drain

    blocker = shared.submit(block_the_loop())
    futures = [shared.submit(record()) for _ in range(5 * sharedloop.MAX_STARTS_PER_TURN)]
    blocker.result(timeout=10)
    for future in futures:
        future.result(timeout=10)
    per_turn = collections.Counter(started)
    assert sum(per_turn.values()) == 5 * sharedloop.MAX_STARTS_PER_TURN
    assert max(per_turn.values()) <= sharedloop.MAX_STARTS_PER_TURN, per_turn
    assert len(per_turn) >= 5


def test_a_fair_event_loop_of_your_own_bounds_ready_sockets_per_select_too():
    from shinken_sync import sharedloop

    n = 2 * sharedloop.MAX_EVENTS_PER_SELECT + 3
    pairs = [socket.socketpair() for _ in range(n)]
    loop = sharedloop.new_fair_event_loop()
    try:
        turn = [0]
        turns: collections.Counter[int] = collections.Counter()

        def tick() -> None:
            turn[0] += 1
            loop.call_soon(tick)

        def readable(sock: socket.socket) -> None:
            sock.recv(16)
            loop.remove_reader(sock)
            turns[turn[0]] += 1
            if sum(turns.values()) == n:
                loop.stop()

        for a, b in pairs:
            a.setblocking(False)
            b.send(b"x")
            loop.add_reader(a, readable, a)
        loop.call_soon(tick)
        loop.call_later(10, loop.stop)
        loop.run_forever()
        assert sum(turns.values()) == n
        assert max(turns.values()) <= sharedloop.MAX_EVENTS_PER_SELECT, turns
    finally:
        loop.close()
        for a, b in pairs:
            a.close()
            b.close()


def test_the_loop_handles_a_bounded_number_of_ready_sockets_per_select(shared):
    from shinken_sync import sharedloop, transport

    if transport.uses_uvloop():
        pytest.skip("the [fast] SharedLoop runs on uvloop, which polls on its own (documented)")

    n = 3 * sharedloop.MAX_EVENTS_PER_SELECT + 5
    pairs = [socket.socketpair() for _ in range(n)]
    try:

        async def read_all() -> collections.Counter[int]:
            loop = asyncio.get_running_loop()
            turn = [0]

            def tick() -> None:
                turn[0] += 1
                loop.call_soon(tick)

            tick()
            done = loop.create_future()
            turns: collections.Counter[int] = collections.Counter()

            def readable(sock: socket.socket) -> None:
                sock.recv(16)
                loop.remove_reader(sock)
                turns[turn[0]] += 1
                if sum(turns.values()) == n and not done.done():
                    done.set_result(None)

            for a, b in pairs:
                a.setblocking(False)
                b.send(b"x")  # every socket is readable before the loop selects once
            for a, _ in pairs:
                loop.add_reader(a, readable, a)
            await asyncio.wait_for(done, 10)
            return turns

        turns = shared.run(read_all(), timeout=20)
        assert sum(turns.values()) == n  # nothing lost: left-over sockets come back next select
        assert max(turns.values()) <= sharedloop.MAX_EVENTS_PER_SELECT, turns
    finally:
        for a, b in pairs:
            a.close()
            b.close()
