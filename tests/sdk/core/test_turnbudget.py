"""Fair scheduling in the async core: at most MAX_CALL_STARTS_PER_TURN call starts per loop turn.

A "turn" is observed with a ticker callback that re-schedules itself with
``call_soon``: it runs once per loop iteration, so the tick a coroutine sees
when it is admitted names the turn it was admitted in.
"""

from __future__ import annotations

import asyncio
import collections
import os

import pytest

from shinken_sync import actions as A
from shinken_sync import client
from shinken_sync.client import aconnect
from shinken_sync.turnbudget import TurnBudget, turn_budget_for_loop

TOKEN = "test-token"


class Ticker:
    """Counts loop iterations (one call_soon callback per iteration)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.turn = 0
        self._loop = loop
        self._handle = loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        self._handle = self._loop.call_soon(self._tick)

    def stop(self) -> None:
        self._handle.cancel()


def test_a_burst_is_admitted_at_most_limit_calls_per_turn_in_arrival_order(run):
    async def body():
        loop = asyncio.get_running_loop()
        budget = TurnBudget(loop)
        ticker = Ticker(loop)
        admitted: list[tuple[int, int, int]] = []  # (who, calls, turn)

        async def start(who: int, calls: int) -> None:
            await budget.admit(calls, 10)
            admitted.append((who, calls, ticker.turn))

        # 50 units of 2 or 3 calls, all in one turn, as a lockstep round would.
        await asyncio.gather(*(start(i, 2 + i % 2) for i in range(50)))
        ticker.stop()
        per_turn: collections.Counter[int] = collections.Counter()
        for _, calls, turn in admitted:
            per_turn[turn] += calls
        assert sum(per_turn.values()) == sum(2 + i % 2 for i in range(50))
        assert max(per_turn.values()) <= 10, per_turn
        assert len(per_turn) >= 13  # 125 calls, at most 10 per turn
        assert [who for who, _, _ in admitted] == list(range(50))  # nobody overtakes a waiter
        assert budget.admitted_late > 0 and budget.waiting == 0

    run(body())


def test_a_unit_larger_than_the_limit_runs_alone_in_its_turn(run):
    async def body():
        loop = asyncio.get_running_loop()
        budget = TurnBudget(loop)
        ticker = Ticker(loop)
        turns: dict[str, int] = {}

        async def start(name: str, calls: int) -> None:
            await budget.admit(calls, 4)
            turns[name] = ticker.turn

        await asyncio.gather(start("small", 1), start("big", 9), start("after", 1))
        ticker.stop()
        assert turns["small"] < turns["big"] < turns["after"]

    run(body())


def test_a_cancelled_waiter_gives_its_place_up(run):
    async def body():
        loop = asyncio.get_running_loop()
        budget = TurnBudget(loop)
        first = asyncio.ensure_future(budget.admit(4, 4))  # fills the turn
        cancelled = asyncio.ensure_future(budget.admit(4, 4))
        behind = asyncio.ensure_future(budget.admit(1, 4))
        await asyncio.sleep(0)  # the three ran once, in order, before this resumes
        assert first.done() and budget.waiting == 2
        cancelled.cancel()
        await asyncio.wait_for(behind, 5)
        assert cancelled.cancelled() and budget.waiting == 0

    run(body())


def test_no_limit_admits_everything_at_once(run):
    async def body():
        budget = TurnBudget(asyncio.get_running_loop())
        assert all(budget.try_admit(100, None) for _ in range(100))
        assert budget.used == 0 and budget.admitted_late == 0

    run(body())


@pytest.mark.integration
def test_steps_of_a_fleet_on_one_loop_are_spread_over_turns_and_all_succeed(run, daemon, monkeypatch):
    """Real shinkend: 24 concurrent steps of 2 calls with a limit of 6 calls per
    turn: every step succeeds and the loop's budget made most of them wait."""
    monkeypatch.setattr(client, "MAX_CALL_STARTS_PER_TURN", 6)
    provider, handle = daemon
    url, token = provider.endpoint(handle)

    async def body():
        sandboxes = [await aconnect(url, token) for _ in range(4)]
        budget = turn_budget_for_loop(asyncio.get_running_loop())
        late0 = budget.admitted_late
        results = await asyncio.gather(
            *(sb.step([A.move(10 + i, 10)], observe={"max_long_edge": 64}) for i in range(6) for sb in sandboxes)
        )
        assert all(r.ok and r.observation is not None for r in results)
        assert budget.admitted_late - late0 >= 24 - 3  # 3 steps fit the first turn
        await asyncio.gather(*(sb.close() for sb in sandboxes))

    run(body())


@pytest.mark.integration
@pytest.mark.parametrize("limit", [1, None])
def test_single_calls_and_act_batch_pass_the_budget_too(run, daemon, monkeypatch, limit):
    monkeypatch.setattr(client, "MAX_CALL_STARTS_PER_TURN", limit)
    provider, handle = daemon
    url, token = provider.endpoint(handle)

    async def body():
        async with await aconnect(url, token) as sb:
            sizes = await asyncio.gather(*(sb.screen_size() for _ in range(8)))
            assert len(set(sizes)) == 1
            batch = await sb.act_batch([A.move(1, 1), A.move(2, 2)])
            assert batch.ok

    run(body())


def test_a_burst_of_replies_wakes_at_most_limit_callers_per_turn(run, peer, helpers, monkeypatch):
    """40 replies sent back to back: the reader dispatches at most 4 per turn,
    so at most 4 waiting calls resume per turn (all of them, in order)."""
    monkeypatch.setattr(client, "MAX_REPLIES_PER_TURN", int(os.environ.get("T_LIMIT", "4")) or None)

    async def script(ws):
        calls = await helpers.calls(ws, 40)
        for call in calls:
            await helpers.reply(ws, call, {"x": call.call_id, "y": 0})
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            ticker = Ticker(asyncio.get_running_loop())
            resumed: list[int] = []

            async def one() -> tuple[int, int]:
                position = await sb.cursor()
                resumed.append(ticker.turn)
                return position

            positions = await asyncio.gather(*(one() for _ in range(40)))
            ticker.stop()
            assert sorted(x for x, _ in positions) == list(range(1, 41))
            per_turn = collections.Counter(resumed)
            assert max(per_turn.values()) <= 4, per_turn

    run(body())


def test_a_ticket_admits_now_without_a_future_or_hands_one_out(run):
    """The call start's hot path: room now is None (nothing to await, no coroutine made);
    past the bound, a future that resolves at the admission, in arrival order."""

    async def body():
        budget = TurnBudget(asyncio.get_running_loop())
        assert budget.ticket(2, 3) is None
        late = budget.ticket(2, 3)  # 2 + 2 > 3: the next turn
        later = budget.ticket(1, 3)  # someone waits already: behind it
        assert isinstance(late, asyncio.Future) and isinstance(later, asyncio.Future)
        assert not late.done() and budget.waiting == 2
        await late
        assert later.done() and budget.used == 3 and budget.admitted_late == 2
        assert budget.ticket(5, None) is None  # no bound

    run(body())
