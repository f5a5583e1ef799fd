"""The I/O-free client protocol, driven without sockets (h11's ConnectionPair style).

``Pair`` wires a ClientProtocol to the daemon's own dispatch (``daemon.verbs.execute``
on a virtual display): the client's encoded calls go straight into the daemon,
its encoded replies and pushed frames straight back into ``receive``. The
scripted tests feed hand-made daemon messages to check the routing rules.
"""

from __future__ import annotations

import asyncio

import pytest

from shinken_sync import protocol
from shinken_sync.client_protocol import (
    ClientProtocol,
    FrameReceived,
    Replied,
    StreamClosed,
    StreamOpened,
    UnclaimedStream,
    check_hello,
    unwrap,
)
from shinken_sync.daemon.display import make_display
from shinken_sync.daemon.outbox import Outbox
from shinken_sync.daemon.screencast import StreamRegistry
from shinken_sync.daemon.verbs import SandboxState, execute
from shinken_sync.errors import ActionError, ProtocolMismatch, ProtocolViolation, RPCTimeout
from shinken_sync.results import ExecResult, Screenshot

HELLO = protocol.Hello(protocol.PROTOCOL_VERSION, "pair-1", 1024, 768, tuple(sorted(protocol.VERBS)), "virtual")


class Pair:
    """A client protocol object and a daemon sandbox, joined by function calls."""

    def __init__(self, sandbox: SandboxState, outbox: Outbox, pushed: list):
        self.client = ClientProtocol(HELLO, rpc_timeout=5.0)
        self.sandbox, self.outbox, self.pushed = sandbox, outbox, pushed

    async def call(self, verb, **args):
        """Send one call through the daemon; return the client's event for the reply."""
        call = self.client.prepare(verb, args)
        self.client.sent(call)
        reply = await execute(self.sandbox, self.outbox, protocol.decode_call(call.message))
        return self.client.receive(reply)

    async def pushed_events(self, n: int) -> list:
        """The client's events for the next ``n`` messages the daemon pushes."""
        while len(self.pushed) < n:
            await asyncio.sleep(0.01)
        messages, self.pushed[:n] = self.pushed[:n], []
        return [self.client.receive(m) for m in messages]


def with_pair(test):
    async def main():
        display = make_display("virtual", 1024, 768, seed=0)
        await display.start()
        sandbox = SandboxState("pair-1", display, StreamRegistry(display, 1.0))
        pushed: list = []

        async def send(message):
            pushed.append(message)

        outbox = Outbox(send)
        sender = asyncio.create_task(outbox.run())
        try:
            await asyncio.wait_for(test(Pair(sandbox, outbox, pushed)), 20)
        finally:
            sender.cancel()
            await sandbox.close()

    asyncio.run(main())


def test_calls_round_trip_through_the_daemons_dispatch():
    async def test(pair):
        event = await pair.call("click", x=3, y=4)
        assert isinstance(event, Replied) and event.call.verb == "click"
        assert unwrap("click", event.reply) is None
        assert unwrap("cursor", (await pair.call("cursor")).reply) == (3, 4)
        shot = unwrap("screenshot", (await pair.call("screenshot", format="png")).reply)
        assert isinstance(shot, Screenshot) and (shot.width, shot.height) == (1024, 768)
        result = unwrap("exec", (await pair.call("exec", cmd="printf hi", stdin=b"")).reply)
        assert isinstance(result, ExecResult) and result.stdout == "hi" and result.exit_code == 0
        with pytest.raises(ActionError) as err:
            unwrap("click", (await pair.call("click", x=10_000, y=0)).reply)
        assert err.value.kind == protocol.ERR_BAD_ARGS
        assert pair.client.pending_calls == 0

    with_pair(test)


def test_a_stream_opens_routes_its_frames_and_ends():
    async def test(pair):
        opened = await pair.call("screencast_start", fps=20.0, format="png")
        assert isinstance(opened, StreamOpened) and opened.delivered == 0
        consumer = object()
        assert pair.client.open_stream(opened.stream_id, consumer) is None
        [frame] = await pair.pushed_events(1)
        assert isinstance(frame, FrameReceived) and frame.stream is consumer and frame.frame.seq == 1
        stopped = await pair.call("screencast_stop", stream_id=opened.stream_id)
        assert isinstance(stopped, Replied)
        while True:  # frames pushed before the stop may come first
            [event] = await pair.pushed_events(1)
            if isinstance(event, StreamClosed):
                break
        assert event.stream is consumer and event.reason == "stopped"
        assert pair.client.open_streams == {}

    with_pair(test)


def _reply(call_id, result=None):
    return protocol.encode_reply(call_id, result=result or {})


def test_late_replies_are_dropped_and_unknown_ones_are_violations():
    client = ClientProtocol(HELLO, 5.0)
    call = client.prepare("click", {"x": 1, "y": 1})
    client.sent(call, waiter="w")
    pending, error = client.expire(call.call_id)
    assert pending.waiter == "w" and isinstance(error, RPCTimeout) and error.timeout == 5.0
    assert client.expire(call.call_id) is None  # already ended
    assert client.receive(_reply(call.call_id)) is None  # late: dropped
    with pytest.raises(ProtocolViolation, match="never sent"):
        client.receive(_reply(99))
    with pytest.raises(ProtocolViolation, match="undecodable"):
        client.receive("{not json")
    with pytest.raises(ProtocolViolation, match="Hello"):
        client.receive(protocol.encode_hello(HELLO))


def test_expire_due_ends_the_calls_past_their_time_and_names_the_next():
    """One timer per connection: the transport asks which calls are due at a time."""
    client = ClientProtocol(HELLO, 5.0)
    calls = [client.prepare("click", {"x": 1, "y": 1}) for _ in range(4)]
    client.sent(calls[0], waiter="a", expires_at=10.0)
    client.sent(calls[1], waiter="b", expires_at=None)  # no deadline: never due
    client.sent(calls[2], waiter="c", expires_at=12.0)
    client.sent(calls[3], waiter="d", expires_at=9.0)
    assert client.expire_due(8.9) == ([], 9.0)
    expired, next_at = client.expire_due(10.0)
    assert [p.waiter for p, _ in expired] == ["a", "d"] and next_at == 12.0  # in send order
    assert all(isinstance(error, RPCTimeout) and error.call_id == p.call_id for p, error in expired)
    assert client.receive(_reply(calls[0].call_id)) is None  # expired: its late reply is dropped
    assert isinstance(client.receive(_reply(calls[2].call_id)), Replied)
    assert client.expire_due(100.0) == ([], None)  # only the call without a deadline is left
    assert client.pending_calls == 1


def test_a_late_openers_stream_is_handed_back_to_be_stopped():
    client = ClientProtocol(HELLO, 5.0)
    call = client.prepare("screencast_start", {})
    client.sent(call)
    client.expire(call.call_id)
    assert client.receive(_reply(call.call_id, {"stream_id": "s9"})) == UnclaimedStream("s9")
    # A frame of a stream nobody opened is dropped, like its stream_end.
    meta = {"format": "jpeg", "width": 2, "height": 2, "scale": 1.0, "x0": 0, "y0": 0, "ts": 0.0}
    assert client.receive(protocol.encode_frame("s9", 1, meta, b"x")) is None
    assert client.receive(protocol.encode_stream_end("s9", "stopped", 1)) is None


def test_resume_on_the_same_connection_replaces_the_consumer_and_loss_clears_everything():
    client = ClientProtocol(HELLO, 5.0)
    first = client.prepare("screencast_start", {})
    client.sent(first, waiter="a")
    opened = client.receive(_reply(first.call_id, {"stream_id": "s1", "fps": 5.0}))
    assert isinstance(opened, StreamOpened) and opened.params["fps"] == 5.0
    client.open_stream("s1", "consumer-a")
    again = client.prepare("resume_screencast", {"stream_id": "s1"})
    client.sent(again, waiter="b")
    resumed = client.receive(_reply(again.call_id, {"stream_id": "s1", "last_seq": 7, "missed": 2}))
    assert resumed.delivered == 5
    assert client.open_stream("s1", "consumer-b") == "consumer-a"
    pending_call = client.prepare("wait", {"ms": 10})
    client.sent(pending_call, waiter="c")
    pending, streams = client.lose()
    assert [p.waiter for p in pending] == ["c"] and streams == ["consumer-b"]
    assert client.pending_calls == 0 and client.open_streams == {}


def test_the_hello_must_speak_this_protocol_version():
    assert check_hello(protocol.encode_hello(HELLO), "ws://x") == HELLO
    newer = protocol.Hello(protocol.PROTOCOL_VERSION + 1, "s", 1, 1, (), "")
    with pytest.raises(ProtocolMismatch) as err:
        check_hello(protocol.encode_hello(newer), "ws://x")
    assert (err.value.daemon, err.value.client) == (protocol.PROTOCOL_VERSION + 1, protocol.PROTOCOL_VERSION)
    with pytest.raises(ProtocolViolation, match="expected hello"):
        check_hello(_reply(1), "ws://x")


def test_a_lost_connection_is_a_death_only_when_the_provider_says_so():
    from shinken_sync.client_protocol import loss_error
    from shinken_sync.errors import ConnectionLost, SandboxDied
    from shinken_sync.liveness import Liveness

    dead = loss_error("sb-1", None, "", Liveness(alive=False, exit_code=None, signal=9), probed=True)
    assert isinstance(dead, SandboxDied) and dead.signal == 9
    alive = loss_error("sb-1", 1006, "gone", Liveness(alive=True, detail="unknown"), probed=True)
    assert type(alive) is ConnectionLost and (alive.code, alive.reason) == (1006, "gone")
    assert "provider says alive: unknown" in str(alive) and alive.liveness.detail == "unknown"
    silent = loss_error("sb-1", None, "", None, probed=True)
    assert type(silent) is ConnectionLost and "did not answer" in str(silent) and silent.liveness is None
    assert "no liveness probe" in str(loss_error("sb-1", None, "", None, probed=False))
