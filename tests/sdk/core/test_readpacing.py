"""Paced reading: received bytes parsed per loop turn are bounded, order is kept."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from shinken_sync import readpacing, transport
from shinken_sync.client import aconnect
from shinken_sync.readpacing import PacedProtocol, ReadBudget, read_budget_for_loop

TOKEN = "test-token"


class FakeTransport:
    def __init__(self) -> None:
        self.reading = True
        self.aborted = False

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True

    def is_reading(self) -> bool:
        return self.reading

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


class Inner:
    """Records what the library's protocol was handed, in order."""

    def __init__(self, name: str, log: list[tuple[str, object]]) -> None:
        self.name, self.log = name, log
        self.recv_messages = type("Assembler", (), {"paused": False})()

    def data_received(self, data: bytes) -> None:
        self.log.append((self.name, data))

    def eof_received(self) -> None:
        self.log.append((self.name, "eof"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.log.append((self.name, "lost"))


async def _next_turn() -> None:
    await asyncio.sleep(0)


@dataclass
class TwoConnections:
    budget: ReadBudget
    log: list[tuple[str, object]]
    a: PacedProtocol
    ta: FakeTransport
    b: PacedProtocol
    tb: FakeTransport


@pytest.fixture
def two_connections(monkeypatch) -> Callable[..., TwoConnections]:
    """Connections ``a`` and ``b`` paced by the running loop's budget: 100 bytes
    a turn, and any held byte pauses the socket. Call it inside the loop."""
    monkeypatch.setattr(readpacing, "MAX_READ_BYTES_PER_TURN", 100)
    monkeypatch.setattr(readpacing, "HOLD_BYTES_BEFORE_PAUSE", 0)

    def make(a_inner: type[Inner] = Inner) -> TwoConnections:
        budget = read_budget_for_loop(asyncio.get_running_loop())
        log: list[tuple[str, object]] = []
        ta, tb = FakeTransport(), FakeTransport()
        a = PacedProtocol(a_inner("a", log), ta, budget)
        b = PacedProtocol(Inner("b", log), tb, budget)
        return TwoConnections(budget, log, a, ta, b, tb)

    return make


def test_past_the_budget_data_waits_for_later_turns_in_order(two_connections, run):
    async def body():
        c = two_connections()
        c.a.data_received(b"1" * 80)  # within the turn's budget: parsed at once
        c.b.data_received(b"2" * 50)  # over it: held, the socket paused
        c.a.data_received(b"3" * 10)  # would fit, but b waits first: held behind it
        assert c.log == [("a", b"1" * 80)] and not c.ta.reading and not c.tb.reading
        assert c.budget.held_turns == 2
        await _next_turn()  # the next turn hands both over, in arrival order
        assert c.log[1:] == [("b", b"2" * 50), ("a", b"3" * 10)]
        assert c.ta.reading and c.tb.reading

    run(body())


def test_a_little_held_data_leaves_the_socket_reading(monkeypatch, run):
    """Pausing costs two system calls: only a connection holding more than
    HOLD_BYTES_BEFORE_PAUSE stops reading."""
    monkeypatch.setattr(readpacing, "MAX_READ_BYTES_PER_TURN", 100)
    monkeypatch.setattr(readpacing, "HOLD_BYTES_BEFORE_PAUSE", 60)

    async def body():
        budget = read_budget_for_loop(asyncio.get_running_loop())
        log: list[tuple[str, object]] = []
        t = FakeTransport()
        p = PacedProtocol(Inner("a", log), t, budget)
        budget.take(100)  # the turn's budget is spent
        p.data_received(b"1" * 50)
        assert t.reading  # 50 held: under the mark
        p.data_received(b"2" * 50)
        assert not t.reading  # 100 held: over it
        await _next_turn()
        assert log == [("a", b"1" * 50), ("a", b"2" * 50)] and t.reading

    run(body())


def test_a_big_read_goes_alone_and_the_end_comes_after_held_data(monkeypatch, run):
    monkeypatch.setattr(readpacing, "MAX_READ_BYTES_PER_TURN", 100)
    monkeypatch.setattr(readpacing, "HOLD_BYTES_BEFORE_PAUSE", 0)

    async def body():
        budget = read_budget_for_loop(asyncio.get_running_loop())
        log: list[tuple[str, object]] = []
        t = FakeTransport()
        inner = Inner("a", log)
        p = PacedProtocol(inner, t, budget)
        p.data_received(b"x" * 500)  # larger than the budget, first in its turn: delivered
        p.data_received(b"y")  # held
        inner.recv_messages.paused = True  # the library's own flow control paused meanwhile
        p.eof_received()  # the held data comes before the end
        assert log == [("a", b"x" * 500), ("a", b"y"), ("a", "eof")]
        await _next_turn()
        assert not t.reading  # the library paused it: it stays paused until the library resumes

    run(body())


def test_a_burst_of_replies_arrives_whole(monkeypatch, run, peer, helpers):
    """Through real websockets connections: 8 connections, 25 replies of ~8 KiB each
    sent at once, a 16 KiB budget per turn; every caller gets its own reply."""
    monkeypatch.setattr(readpacing, "MAX_READ_BYTES_PER_TURN", 16 * 1024)
    monkeypatch.setattr(transport, "TRANSPORT", transport.WEBSOCKETS)  # picows is not paced

    async def script(ws):
        calls = await helpers.calls(ws, 25)
        await asyncio.sleep(0.2)  # every connection's calls are in: the replies land together
        await asyncio.gather(*(helpers.reply(ws, c, {"n": c.args["ms"], "pad": "p" * 8192}) for c in calls))
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url:
            sandboxes = [await aconnect(url, TOKEN) for _ in range(8)]
            assert all(isinstance(sb._ws.transport.get_protocol(), PacedProtocol) for sb in sandboxes)
            results = await asyncio.gather(*(sb.wait(i) for sb in sandboxes for i in range(25)))
            assert [r["n"] for r in results] == list(range(25)) * 8
            assert read_budget_for_loop(asyncio.get_running_loop()).held_turns > 0  # really paced
            for sb in sandboxes:
                await sb.close()

    run(body())


def test_a_parser_failing_on_held_data_aborts_only_its_connection(two_connections, run):
    """The budget's callback serves every waiting connection: one parser raising
    aborts its own connection (as the transport's read callback would) and the
    others still get their turn."""

    class Broken(Inner):
        def data_received(self, data: bytes) -> None:
            raise ValueError("parser bug")

    async def body():
        c = two_connections(Broken)
        c.budget.take(100)
        c.a.data_received(b"1")
        c.b.data_received(b"2")
        await _next_turn()
        assert c.ta.aborted and not c.ta.reading  # not resumed either
        assert c.log == [("b", b"2")] and c.tb.reading and not c.tb.aborted

    run(body())


@pytest.mark.parametrize("limit", [None])
def test_no_bound_reads_as_before(monkeypatch, run, limit):
    monkeypatch.setattr(readpacing, "MAX_READ_BYTES_PER_TURN", limit)

    async def body():
        log: list[tuple[str, object]] = []
        t = FakeTransport()
        p = PacedProtocol(Inner("a", log), t, read_budget_for_loop(asyncio.get_running_loop()))
        for _ in range(5):
            p.data_received(b"z" * 10_000)
        assert len(log) == 5 and t.reading

    run(body())
