"""``timeout=``: DEFAULT (inherit the connection's rpc_timeout), None (no limit), a number; the
same on both faces, on real shinkend whose replies are held back (``--rtt-ms``)."""

from __future__ import annotations

import asyncio
import copy
import inspect
import pickle

import pytest

from shinken_sync import client, client_protocol, sync
from shinken_sync.client_protocol import DEFAULT, call_deadline
from shinken_sync.errors import RPCTimeout

pytestmark = pytest.mark.integration

RTT_MS = 800  # every reply is held this long
RPC_TIMEOUT = 0.3  # shorter than that: a call on the default deadline times out


def test_the_sentinel_is_one_value_that_survives_copy_and_pickle():
    assert copy.copy(DEFAULT) is DEFAULT and copy.deepcopy(DEFAULT) is DEFAULT
    assert pickle.loads(pickle.dumps(DEFAULT)) is DEFAULT
    assert repr(DEFAULT) == "DEFAULT"


def test_the_deadline_arithmetic_of_the_three_meanings():
    assert call_deadline(10.0, "cursor", {}) == 10.0 == call_deadline(10.0, "cursor", {}, DEFAULT)
    assert call_deadline(10.0, "cursor", {}, None) is None
    assert call_deadline(10.0, "wait", {"ms": 2000}, 3) == 3.0
    assert call_deadline(10.0, "wait", {"ms": 2000}) > 12.0  # the wait is added to the default only
    rules = client_protocol.SANDBOX_DEADLINES
    assert rules["step"](1.0, {"actions": [{"verb": "cursor"}], "timeout": None}) is None
    assert rules["act_batch"](1.0, {"actions": [{"verb": "cursor"}], "timeout": None}) is None


def test_every_call_defaults_to_default_and_next_frame_to_waiting():
    for face in (client.AsyncSandbox, sync.Sandbox):
        for name, method in inspect.getmembers(face, callable):
            parameter = inspect.signature(method).parameters.get("timeout") if not name.startswith("_") else None
            if parameter is not None:
                assert parameter.default is DEFAULT, (face.__name__, name)
    for face in (client.ScreencastStream, sync.ScreencastStream):
        assert inspect.signature(face.next_frame).parameters["timeout"].default is None
        assert inspect.signature(face.stop).parameters["timeout"].default is DEFAULT


def test_none_waits_past_the_default_deadline_and_a_number_bounds_it(shinkend):
    daemon = shinkend(rtt_ms=RTT_MS)
    with sync.connect(daemon.url, daemon.token, rpc_timeout=RPC_TIMEOUT) as sandbox:
        with pytest.raises(RPCTimeout):
            sandbox.cursor()  # DEFAULT: rpc_timeout
        assert len(sandbox.cursor(timeout=None)) == 2  # no limit: the held reply arrives
        assert len(sandbox.cursor(timeout=5)) == 2
        with pytest.raises(RPCTimeout):
            sandbox.cursor(timeout=0.1)

    async def main() -> None:
        async with await client.aconnect(daemon.url, daemon.token, rpc_timeout=RPC_TIMEOUT) as sandbox:
            with pytest.raises(RPCTimeout):
                await sandbox.screen_size()
            assert len(await sandbox.screen_size(timeout=None)) == 2
            step = await sandbox.step([{"verb": "cursor"}], timeout=None)
            assert [row.outcome for row in step.rows] == ["ok"]

    asyncio.run(main())
