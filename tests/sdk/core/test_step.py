"""step (pipelined, one row per action + observation) and act_batch (serial, stop on error)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from shinken_sync import actions as A
from shinken_sync import protocol
from shinken_sync.client import aconnect
from shinken_sync.errors import ActionDenied, ActionError, ConnectionLost, RPCTimeout, SandboxDied, Skipped
from shinken_sync.results import Screenshot

TOKEN = "test-token"
FIVE = [A.click(1, 1), A.type("a"), A.key("Return"), A.move(2, 2), A.scroll(0, 1)]


def test_step_sends_every_call_before_awaiting_any(run, peer, helpers):
    seen = []

    async def script(ws):
        # Reads all six messages before answering one: a client that awaited
        # each reply before sending the next call would deadlock here.
        calls = await helpers.calls(ws, 6)
        seen.extend(call.verb for call in calls)
        for call in calls:
            await helpers.answer(ws, call)
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            result = await sb.step(FIVE, observe={"max_long_edge": 64})
            assert result.ok and result.outcomes == [protocol.OK] * 5
            assert [row.verb for row in result.rows] == [a["verb"] for a in FIVE]
            assert isinstance(result.observation, Screenshot) and result.observation.width == 64

    run(body())
    assert seen == ["click", "type", "key", "move", "scroll", "screenshot"]


def test_step_mid_error_keeps_real_outcomes_and_the_observation(run, peer, helpers):
    async def script(ws):
        calls = await helpers.calls(ws, 6)
        for call in calls:
            if call.verb == "key":
                await helpers.error(ws, call, protocol.ERR_BAD_ARGS)
            else:
                await helpers.answer(ws, call)
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            result = await sb.step(FIVE, observe={})
            assert result.outcomes == ["ok", "ok", "error", "ok", "ok"]  # no "skipped" in a step
            assert isinstance(result.rows[2].error, ActionError) and result.rows[2].error.kind == "bad_args"
            assert result.observation is not None and not result.ok

    run(body())


def test_step_row_timeout_is_per_action(run, peer, helpers):
    async def script(ws):
        calls = await helpers.calls(ws, 3)
        await helpers.answer(ws, calls[0])
        await helpers.answer(ws, calls[2])  # calls[1] never answered
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            result = await sb.step([A.click(1, 1), A.wait(1)], observe={}, timeout=0.3)
            assert result.outcomes == ["ok", "timeout"]
            assert isinstance(result.rows[1].error, RPCTimeout)
            assert result.observation is not None

    run(body())


def test_step_connection_drop_gives_connection_lost_rows(run, peer, helpers):
    async def script(ws):
        calls = await helpers.calls(ws, 6)
        await helpers.answer(ws, calls[0])
        ws.transport.abort()

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN, rpc_timeout=60) as sb:
            result = await asyncio.wait_for(sb.step(FIVE, observe={}), 5)
            # no probe said the sandbox is gone: the rows say the connection was lost, not a death
            assert result.outcomes == ["ok"] + ["connection_lost"] * 4
            assert isinstance(result.observation_error, ConnectionLost)
            assert not isinstance(result.observation_error, SandboxDied)
            # a step on the dead connection reports rows; it does not raise or hang
            again = await asyncio.wait_for(sb.step(FIVE[:2]), 5)
            assert again.outcomes == ["connection_lost"] * 2

    run(body())


def test_gateway_denies_without_sending(run, peer, helpers):
    seen = []

    async def script(ws):
        async for message in ws:
            call = protocol.decode_call(message)
            seen.append(call.verb)
            await helpers.answer(ws, call)

    def no_typing(action):
        return action["verb"] != "type"

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN, gateway=no_typing) as sb:
            result = await sb.step(FIVE, observe={})
            assert result.outcomes == ["ok", "denied", "ok", "ok", "ok"]
            assert isinstance(result.rows[1].error, ActionDenied)
            batch = await sb.act_batch(FIVE)
            assert batch.outcomes == ["ok", "denied", "skipped", "skipped", "skipped"]

    run(body())
    assert seen == ["click", "key", "move", "scroll", "screenshot", "click"]


def test_act_batch_stops_at_the_first_error(run, peer, helpers):
    seen = []

    async def script(ws):
        async for message in ws:
            call = protocol.decode_call(message)
            seen.append(call.verb)
            if call.verb == "type":
                await helpers.error(ws, call)
            else:
                await helpers.answer(ws, call)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            result = await sb.act_batch(FIVE)
            assert result.outcomes == ["ok", "error", "skipped", "skipped", "skipped"]
            skipped = result.rows[3].error
            assert isinstance(skipped, Skipped) and skipped.cause_index == 1
            assert result.observation is None and not result.ok

    run(body())
    assert seen == ["click", "type"]  # nothing after the failure was sent


def test_bad_actions_are_refused_before_anything_is_sent(run, peer, helpers):
    seen = []

    async def script(ws):
        async for message in ws:
            seen.append(protocol.decode_call(message).verb)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            with pytest.raises(ValueError, match=r"actions\[1\]"):
                await sb.step([A.click(1, 1), {"verb": "teleport"}])
            with pytest.raises(ValueError):
                await sb.step([A.click(1, 1), {"verb": "screencast_start"}])
            with pytest.raises(TypeError):
                await sb.act_batch([A.click(1, 1), "click"])
            with pytest.raises(TypeError):
                await sb.step([A.click(1, 1)], observe={"colour": True})
            for run_batch in (sb.step, sb.act_batch):  # not JSON: found before the click went out
                with pytest.raises(TypeError):
                    await run_batch([A.click(1, 1), {"verb": "type", "text": {1, 2}}])

    run(body())
    assert seen == []


@pytest.mark.integration
def test_step_against_shinkend_with_a_mid_step_error(run, daemon):
    provider, handle = daemon

    async def body():
        async with await aconnect(*provider.endpoint(handle)) as sb:
            result = await sb.step(
                [A.click(100, 100), A.type("x"), A.click(99_999, 0), A.key("Return"), A.move(5, 5)],
                observe={"max_long_edge": 256},
            )
            assert result.outcomes == ["ok", "ok", "error", "ok", "ok"]
            assert result.rows[2].error.kind == protocol.ERR_BAD_ARGS
            assert result.observation.to_image().size == (256, 192)
            assert await sb.cursor() == (5, 5)  # the actions after the error did run

    run(body())


@pytest.mark.integration
def test_daemon_killed_mid_step(run, slow_daemon):
    provider, handle = slow_daemon  # replies held 300 ms: the kill lands while they are in flight

    async def body():
        sb = await aconnect(*provider.endpoint(handle), liveness_probe=lambda: provider.check_alive(handle))
        step = asyncio.ensure_future(sb.step(FIVE, observe={}))
        await asyncio.sleep(0.1)
        os.kill(handle.pid, signal.SIGKILL)
        result = await asyncio.wait_for(step, 5)
        assert result.outcomes == ["sandbox_died"] * 5
        assert all(isinstance(row.error, SandboxDied) for row in result.rows)
        assert result.rows[0].error.signal == signal.SIGKILL
        assert isinstance(result.observation_error, SandboxDied) and result.observation is None
        await sb.close()

    run(body())


@pytest.mark.integration
def test_step_calls_queued_behind_a_wait_get_its_duration(run, daemon):
    # shinkend runs a step's calls one after another, so a call sent with the
    # others waits out the wait ahead of it before its own rpc_timeout matters.
    provider, handle = daemon

    async def body():
        async with await aconnect(*provider.endpoint(handle), rpc_timeout=1) as sb:
            result = await sb.step([A.wait(1500)], observe={"max_long_edge": 64})
            assert result.outcomes == ["ok"]
            assert result.observation_error is None and result.observation.width == 64
            result = await sb.step([A.wait(1500), A.move(7, 7)])
            assert result.outcomes == ["ok", "ok"]

    run(body())
