"""The per-connection send queue: order, RTT holds, backpressure, frame dropping (no sockets)."""

from __future__ import annotations

import asyncio

from shinken_sync.daemon import outbox as outbox_mod
from shinken_sync.daemon.outbox import Outbox


class Recorder:
    def __init__(self):
        self.sent: list[tuple[float, object]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def send(self, message):
        await self.gate.wait()
        self.sent.append((asyncio.get_running_loop().time(), message))


def test_messages_leave_in_order_after_the_hold():
    async def main():
        rec = Recorder()
        box = Outbox(rec.send, delay_s=0.1)
        sender = asyncio.create_task(box.run())
        loop = asyncio.get_running_loop()
        queued_at = []
        for i in range(5):
            queued_at.append(loop.time())
            await box.put(f"m{i}")  # never held: the producer goes on at once
            await asyncio.sleep(0.01)
        assert loop.time() - queued_at[0] < 0.1  # all five queued before the first left
        while len(rec.sent) < 5:
            await asyncio.sleep(0.01)
        sender.cancel()
        assert [m for _, m in rec.sent] == [f"m{i}" for i in range(5)]
        assert all(t - q >= 0.1 - 1e-3 for (t, _), q in zip(rec.sent, queued_at))

    asyncio.run(main())


def test_frames_are_dropped_when_congested_and_replies_wait(monkeypatch):
    monkeypatch.setattr(outbox_mod, "FRAME_DROP_WATER", 10)
    monkeypatch.setattr(outbox_mod, "HIGH_WATER", 20)

    async def main():
        rec = Recorder()
        rec.gate.clear()  # the peer does not read
        box = Outbox(rec.send)
        sender = asyncio.create_task(box.run())
        assert box.offer(b"f" * 8)
        await asyncio.sleep(0)  # the sender takes it and blocks in send()
        assert box.offer(b"f" * 11)  # 11 queued bytes: over the drop mark from now on
        assert box.congested and not box.offer(b"f")
        await box.put("r" * 10)  # 21 queued: over the high-water mark
        waiter = asyncio.create_task(box.put("late"))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # held back
        rec.gate.set()
        await asyncio.wait_for(waiter, 5)
        while len(rec.sent) < 4:
            await asyncio.sleep(0.01)
        assert [m for _, m in rec.sent] == [b"f" * 8, b"f" * 11, "r" * 10, "late"]
        sender.cancel()

    asyncio.run(main())


def test_close_releases_waiting_producers():
    async def main():
        rec = Recorder()
        rec.gate.clear()
        box = Outbox(rec.send)
        outbox_big = "x" * (outbox_mod.HIGH_WATER + 1)
        await box.put(outbox_big)
        waiter = asyncio.create_task(box.put("y"))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        box.close()
        await asyncio.wait_for(waiter, 5)
        assert box.congested and not box.offer(b"z")

    asyncio.run(main())
