"""Screencast streams: order, the count bound, end vs loss sentinels, resume with the seq gap."""

from __future__ import annotations

import asyncio

import pytest

from shinken_sync import client, transport
from shinken_sync.client import aconnect
from shinken_sync.daemon.screencast import MAX_STREAMS_PER_SANDBOX
from shinken_sync.errors import FrameTimeout, RPCTimeout, StreamLost
from shinken_sync.results import Frame

TOKEN = "test-token"


def start_then(*frames_then):
    """A peer script: answer screencast_start, then run each step (bytes are sent)."""

    async def script(ws):
        from shinken_sync import protocol

        (call,) = [protocol.decode_call(await ws.recv())]
        params = {"fps": 5.0, "format": "jpeg", "quality": 80, "max_long_edge": None}
        await ws.send(protocol.encode_reply(call.call_id, result={"stream_id": "s1", **params}))
        for step in frames_then:
            if isinstance(step, (bytes, str)):
                await ws.send(step)
            else:
                await step(ws)

    return script


async def abort(ws):
    ws.transport.abort()


async def linger(ws):
    await ws.wait_closed()


def test_queue_bound_keeps_the_newest_and_reports_the_gap(run, peer, helpers):
    from shinken_sync import protocol

    frames = [helpers.frame("s1", seq) for seq in range(1, 11)]
    script = start_then(*frames, protocol.encode_stream_end("s1", "stopped", 10), linger)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN, max_queue_frames=4) as sb:
            stream = await sb.screencast()
            while not stream.ended:  # let every frame and the end arrive unread
                await asyncio.sleep(0.01)
            got = [frame async for frame in stream]  # drains the 4 newest, then ends cleanly
            assert [f.seq for f in got] == [7, 8, 9, 10]
            assert [f.gap for f in got] == [6, 0, 0, 0] and stream.missed == 6
            assert stream.counters.frames_dropped == 6 and stream.end_reason == "stopped"
            assert await stream.next_frame() is None  # the end sentinel stays
            assert isinstance(got[0], Frame) and got[0].stream_id == "s1" and len(got[0].data) == 1000

    run(body())


def test_connection_loss_releases_frames_and_raises_stream_lost(run, peer, helpers):
    script = start_then(*(helpers.frame("s1", seq) for seq in (1, 2, 3)), abort)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            stream = await sb.screencast(fps=5)
            first = await stream.next_frame(timeout=5)
            assert first.seq == 1
            while sb.loss is None:
                await asyncio.sleep(0.01)
            assert sb.frame_counters.used_bytes == 0  # a dead connection's frames are released
            for _ in range(2):  # the loss sentinel is never consumed
                with pytest.raises(StreamLost) as info:
                    await stream.next_frame(timeout=5)
            lost = info.value
            assert (lost.stream_id, lost.last_seq, lost.params["fps"]) == ("s1", 1, 5.0)
            assert stream.end_reason == "lost"

    run(body())


def test_budget_below_one_frame_admits_nothing_but_the_loss_still_arrives(run, peer, helpers, monkeypatch):
    monkeypatch.setattr(client, "GLOBAL_FRAME_BUDGET_BYTES", 500)

    async def wait_then_abort(ws):
        await asyncio.sleep(0.3)
        ws.transport.abort()

    script = start_then(*(helpers.frame("s1", seq, size=1000) for seq in (1, 2, 3)), wait_then_abort)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            stream = await sb.screencast()
            with pytest.raises(FrameTimeout):
                await stream.next_frame(timeout=0.2)
            with pytest.raises(StreamLost):
                await stream.next_frame(timeout=5)
            assert stream.counters.frames_evicted == 3 and client.loop_frame_budget().used_bytes == 0

    run(body())


def test_concurrent_consumers_share_the_stream(run, peer, helpers):
    async def paced(ws):
        for seq in range(1, 7):
            await asyncio.sleep(0.02)
            await ws.send(helpers.frame("s1", seq))
        await ws.wait_closed()

    async def body():
        async with peer(start_then(paced)) as url, await aconnect(url, TOKEN) as sb:
            stream = await sb.screencast()

            async def take(n):
                return [(await stream.next_frame(timeout=5)).seq for _ in range(n)]

            a, b = await asyncio.gather(take(3), take(3))
            assert sorted(a + b) == [1, 2, 3, 4, 5, 6]

    run(body())


@pytest.mark.integration
def test_frames_in_order_and_stop_ends_iteration(run, daemon):
    provider, handle = daemon

    async def body():
        async with await aconnect(*provider.endpoint(handle)) as sb:
            stream = await sb.screencast(fps=20, max_long_edge=256, quality=60)
            assert stream.params == {"fps": 20.0, "format": "jpeg", "quality": 60, "max_long_edge": 256}
            seqs = []
            async for frame in stream:
                seqs.append(frame.seq)
                assert frame.width == 256 and frame.to_image().size == (256, 192)
                if len(seqs) == 3:
                    await stream.stop()
                else:
                    await sb.move(10 * len(seqs), 10)  # a changed screen makes the next frame
            assert seqs == [1, 2, 3]
            assert stream.end_reason == "stopped" and stream.counters.used_bytes == 0
            await stream.stop()  # idempotent

    run(body())


@pytest.mark.integration
def test_resume_across_a_dropped_connection_reports_the_gap(run, daemon):
    provider, handle = daemon
    url, token = provider.endpoint(handle)

    async def body():
        driver = await aconnect(url, token)  # changes the screen so the stream has frames to send
        first = await aconnect(url, token)
        stream = await first.screencast(fps=20, max_long_edge=128)
        await driver.move(1, 1)
        seen = (await stream.next_frame(timeout=5)).seq
        transport.abort(first._ws)  # the network drops this connection
        with pytest.raises(StreamLost) as info:
            # The loss reaches the client one loop turn after the abort: a frame that arrived
            # before it may still be read first (on picows one sometimes is).
            for _ in range(100):
                seen = max(seen, (await stream.next_frame(timeout=5)).seq)
        lost = info.value
        assert lost.stream_id == stream.stream_id and lost.last_seq >= seen
        for x in range(2, 12):  # the stream keeps counting while nobody is attached
            await driver.move(x * 7, x * 5)
            await asyncio.sleep(0.08)
        async with await aconnect(url, token) as second:
            resumed = await second.resume_screencast(lost.stream_id, lost.params, last_seq=lost.last_seq)
            frame = await resumed.next_frame(timeout=5)
            assert frame.stream_id == lost.stream_id and frame.seq > lost.last_seq
            assert frame.gap == frame.seq - lost.last_seq - 1 >= 5
            assert resumed.missed == frame.gap
            await resumed.stop()
        await driver.close()
        await first.close()

    run(body())


@pytest.mark.integration
def test_a_stream_whose_caller_stopped_waiting_is_stopped(run, slow_daemon):
    # Replies are held 300 ms, so each start below is abandoned (timed out or
    # cancelled) before its reply brings the stream. Unstopped, those streams
    # would fill the sandbox's stream limit and the last start would fail.
    provider, handle = slow_daemon

    async def body():
        async with await aconnect(*provider.endpoint(handle)) as sb:
            half = MAX_STREAMS_PER_SANDBOX // 2
            for _ in range(half):
                with pytest.raises(RPCTimeout):
                    await sb.screencast(fps=20, timeout=0.05)
            starts = [asyncio.ensure_future(sb.screencast(fps=20)) for _ in range(MAX_STREAMS_PER_SANDBOX - half)]
            await asyncio.sleep(0.05)
            for start in starts:
                start.cancel()
            await asyncio.gather(*starts, return_exceptions=True)
            # Replied after every start, so each unclaimed stream's stop went out before the next start.
            await sb.cursor()
            stream = await sb.screencast(fps=20)
            await stream.stop()

    run(body())
