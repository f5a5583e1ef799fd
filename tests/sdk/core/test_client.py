"""AsyncSandbox: dialing, reply demux, deadlines, connection death, close.

Most tests run against a scripted peer that misbehaves on purpose; the
``integration`` ones drive a real shinkend.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from shinken_sync import client, protocol, transport
from shinken_sync.client import aconnect
from shinken_sync.errors import (
    ActionError,
    AuthRefused,
    ConnectError,
    ConnectionLost,
    ProtocolMismatch,
    ProtocolViolation,
    RPCTimeout,
    SandboxClosed,
    SandboxDied,
    classify_exception,
)
from shinken_sync.providers.base import Liveness
from shinken_sync.results import ExecResult, Screenshot

TOKEN = "test-token"


def test_out_of_order_replies_reach_their_callers(run, peer, helpers):
    async def script(ws):
        calls = await helpers.calls(ws, 3)
        for call in reversed(calls):  # answer last call first
            await helpers.reply(ws, call, {"waited_ms": call.call_id * 100})
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            results = await asyncio.gather(sb.wait(1), sb.wait(2), sb.wait(3))
            ids = [r["waited_ms"] // 100 for r in results]
            assert ids == sorted(ids) and len(set(ids)) == 3  # each caller got its own reply
            assert sb.pending_calls == 0

    run(body())


def test_call_deadline_fails_only_that_call(run, peer, helpers):
    async def script(ws):
        (slow,) = await helpers.calls(ws, 1)  # never answered in time
        (fast,) = await helpers.calls(ws, 1)
        await helpers.reply(ws, fast, {"fast": True})
        await helpers.reply(ws, slow, {"late": True})  # late: must be dropped quietly
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN, rpc_timeout=60) as sb:
            with pytest.raises(RPCTimeout) as info:
                await sb.wait(1, timeout=0.2)
            assert info.value.verb == "wait" and info.value.timeout == 0.2
            assert classify_exception(info.value) == protocol.TIMEOUT
            assert await sb.wait_change(5) == {"fast": True}
            assert await sb.wait(2) == {"echo": 3}  # still usable after the late reply
            assert sb.loss is None

    run(body())


def test_one_deadline_timer_per_connection_however_many_calls(run, peer, helpers):
    """Calls in flight share the connection's one timer, armed for the earliest
    deadline: a short call sent after long ones still times out on time, and the
    long ones keep theirs."""

    async def script(ws):
        calls = await helpers.calls(ws, 21)
        for call in calls[:20]:
            await helpers.reply(ws, call, {"n": call.call_id})  # the 21st (timeout=0.2) never
        await helpers.serve_forever(ws)

    def timers(loop):
        # The SDK's own timers only: websockets and asyncio schedule others of their own, and
        # how many differs between Python versions (3.12+ added two here).
        return sum(1 for h in loop._scheduled  # type: ignore[attr-defined]
                   if not h.cancelled() and getattr(h._callback, "__module__", "").startswith("shinken_sync"))

    async def body():
        loop = asyncio.get_running_loop()
        async with peer(script) as url, await aconnect(url, TOKEN, rpc_timeout=60) as sb:
            before = timers(loop)
            slow = [asyncio.ensure_future(sb.wait(1)) for _ in range(20)]
            await asyncio.sleep(0)  # all 20 sent, each with a 60 s deadline
            assert timers(loop) - before <= 1  # not one per call
            started = loop.time()
            with pytest.raises(RPCTimeout) as info:
                await sb.wait(1, timeout=0.2)
            assert info.value.timeout == 0.2 and loop.time() - started < 30
            assert all(isinstance(r, dict) for r in await asyncio.gather(*slow))
            assert sb.pending_calls == 0

    run(body())


def test_connection_death_fails_every_pending_call_at_once(run, peer, helpers):
    async def script(ws):
        await helpers.calls(ws, 5)
        ws.transport.abort()  # no close frame: a crash as the client sees it

    async def body():
        async with peer(script) as url:
            sb = await aconnect(url, TOKEN, rpc_timeout=60)
            results = await asyncio.wait_for(
                asyncio.gather(*(sb.wait(i) for i in range(5)), return_exceptions=True), 5
            )
            assert all(type(r) is ConnectionLost for r in results), results
            # no probe: nobody says the sandbox is gone, so it is a lost connection, not a death
            assert [classify_exception(r) for r in results] == [protocol.CONNECTION_LOST] * 5
            assert all(r.liveness is None and "no liveness probe" in str(r) for r in results)
            assert sb.closed and isinstance(sb.loss, ConnectionLost)
            with pytest.raises(ConnectionLost):  # later calls fail the same way, at once
                await sb.click(1, 1)
            await sb.close()
            with pytest.raises(SandboxClosed):
                await sb.click(1, 1)

    run(body())


def test_liveness_probe_upgrades_the_loss_to_sandbox_died(run, peer, helpers):
    async def script(ws):
        await helpers.calls(ws, 1)
        ws.transport.abort()

    dead = Liveness(alive=False, signal=signal.SIGKILL, oom=True, detail="oom-killed")

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN, liveness_probe=lambda: dead) as sb:
            with pytest.raises(SandboxDied) as info:
                await sb.exec("true")
            assert (info.value.signal, info.value.oom, info.value.exit_code) == (signal.SIGKILL, True, None)
            assert isinstance(info.value, ConnectionLost)
            assert classify_exception(info.value) == protocol.SANDBOX_DIED and info.value.liveness is dead

    run(body())


@pytest.mark.parametrize("verdict", [Liveness(alive=True), Liveness(alive=True, detail="unknown")])
def test_a_probe_that_says_alive_keeps_the_loss_a_connection_loss(run, peer, helpers, verdict):
    async def script(ws):
        await helpers.calls(ws, 1)
        ws.transport.abort()

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN, liveness_probe=lambda: verdict) as sb:
            with pytest.raises(ConnectionLost) as info:
                await sb.wait(1)
            assert not isinstance(info.value, SandboxDied)
            assert classify_exception(info.value) == protocol.CONNECTION_LOST
            assert info.value.liveness == verdict and "the provider says alive" in str(info.value)

    run(body())


def test_hung_liveness_probe_is_bounded(run, peer, helpers, monkeypatch):
    monkeypatch.setattr(client, "LIVENESS_PROBE_TIMEOUT", 0.3)
    gate = asyncio.Event()

    async def script(ws):
        await helpers.calls(ws, 1)
        ws.transport.abort()

    def probe():
        import time

        time.sleep(3)  # a provider API that hangs
        return Liveness(alive=False)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN, liveness_probe=probe) as sb:
            with pytest.raises(ConnectionLost) as info:
                await asyncio.wait_for(sb.wait(1), 2.5)
            assert not isinstance(info.value, SandboxDied)
            assert info.value.liveness is None and "did not answer" in str(info.value)
            gate.set()

    run(body())
    assert gate.is_set()


def test_malformed_message_is_a_protocol_violation(run, peer, helpers):
    async def script(ws):
        await helpers.calls(ws, 1)
        await ws.send("{not json")
        await ws.wait_closed()
        assert ws.close_code == 1002

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            with pytest.raises(ProtocolViolation):
                await sb.wait(1)
            assert classify_exception(sb.loss) == protocol.ERROR

    run(body())


def test_reply_to_a_call_never_sent_is_a_protocol_violation(run, peer, helpers):
    async def script(ws):
        await helpers.calls(ws, 1)
        await ws.send(protocol.encode_reply(999, result={}))
        await ws.wait_closed()

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            with pytest.raises(ProtocolViolation):
                await sb.wait(1)

    run(body())


def test_error_reply_is_a_typed_action_error(run, peer, helpers):
    async def script(ws):
        (call,) = await helpers.calls(ws, 1)
        await helpers.error(ws, call, protocol.ERR_NOT_FOUND)
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            with pytest.raises(ActionError) as info:
                await sb.read_file("/nope")
            assert (info.value.kind, info.value.verb) == (protocol.ERR_NOT_FOUND, "read_file")
            assert sb.loss is None

    run(body())


def test_close_fails_pending_calls_and_refuses_new_ones(run, peer, helpers):
    async def script(ws):
        await helpers.calls(ws, 2)
        await ws.wait_closed()

    async def body():
        async with peer(script) as url:
            sb = await aconnect(url, TOKEN)
            pending = [asyncio.ensure_future(sb.wait(i)) for i in range(2)]
            await asyncio.sleep(0.1)
            await sb.close()
            await sb.close()  # idempotent
            for task in pending:
                with pytest.raises(SandboxClosed):
                    await task
            with pytest.raises(SandboxClosed):
                await sb.screenshot()

    run(body())


def test_ping_jitter_gives_each_connection_its_own_interval(run, peer, helpers):
    async def body():
        async with peer(helpers.serve_forever) as url:
            plain = await aconnect(url, TOKEN)
            jittered = [await aconnect(url, TOKEN, ping_jitter=10.0) for _ in range(6)]
            try:
                assert plain.ping_interval == client.DEFAULT_PING_INTERVAL
                intervals = [sb.ping_interval for sb in jittered]
                assert len(set(intervals)) == len(intervals)
                assert all(20.0 <= i <= 30.0 for i in intervals)
                if jittered[0].transport == "websockets":  # what the websockets keepalive uses
                    assert [sb._ws.ping_interval for sb in jittered] == intervals
            finally:
                for sb in [plain, *jittered]:
                    await sb.close()

    run(body())


def test_wrong_token_is_auth_refused(run, peer, helpers):
    async def body():
        async with peer(helpers.serve_forever) as url:
            with pytest.raises(AuthRefused) as info:
                await aconnect(url, "wrong")
            assert isinstance(info.value, ConnectError) and info.value.url == url
            assert isinstance(info.value.__cause__, transport.choose().invalid_status)

    run(body())


def test_unreachable_endpoint_is_connect_error(run):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def body():
        with pytest.raises(ConnectError) as info:
            await aconnect(f"ws://127.0.0.1:{port}/", TOKEN, open_timeout=2)
        assert isinstance(info.value.__cause__, OSError)

    run(body())


def test_missing_hello_times_out_as_connect_error(run, peer):
    async def body():
        async with peer(lambda ws: ws.wait_closed(), send_hello=False) as url:
            with pytest.raises(ConnectError, match="hello"):
                await aconnect(url, TOKEN, open_timeout=0.5)

    run(body())


@pytest.mark.integration
def test_every_verb_against_shinkend(run, daemon, tmp_path):
    provider, handle = daemon
    url, token = provider.endpoint(handle)

    async def body():
        async with await aconnect(url, token) as sb:
            assert sb.screen == (1024, 768) and sb.display == "virtual"
            shot = await sb.screenshot(max_long_edge=512)
            assert isinstance(shot, Screenshot) and (shot.width, shot.height) == (512, 384)
            assert shot.to_image().size == (512, 384) and shot.scale == 2.0
            assert shot.to_screen(10, 20) == (20, 40)
            png = await sb.screenshot(format="png", region=(10, 10, 100, 50))
            assert png.to_image().size == (100, 50) and png.to_screen(0, 0) == (10, 10)
            await sb.move(30, 40)
            assert await sb.cursor() == (30, 40)
            await sb.click(100, 100, button="left", count=2)
            await sb.drag(10, 10, 50, 50)
            await sb.scroll(0, 3, x=200, y=200)
            await sb.type("héllo ✓")
            await sb.key("ctrl+a")
            assert await sb.screen_size() == (1024, 768)
            assert (await sb.wait(5))["waited_ms"] == 5
            assert (await sb.wait_stable(stable_ms=50, timeout_ms=5000))["stable"] is True
            result = await sb.exec("printf out; printf err >&2; exit 3", timeout_ms=5000)
            assert isinstance(result, ExecResult)
            assert (result.exit_code, result.stdout, result.stderr) == (3, "out", "err")
            raw = await sb.exec("printf '\\377'", encoding="base64")
            assert raw.stdout == b"\xff"
            path = str(tmp_path / "blob.bin")
            data = os.urandom(3000) + b"\0"
            await sb.write_file(path, data)
            assert await sb.read_file(path) == data
            assert await sb.read_file(path, offset=10, max_bytes=5) == data[10:15]
            with pytest.raises(ActionError) as info:
                await sb.click(10_000, 5)
            assert info.value.kind == protocol.ERR_BAD_ARGS

    run(body())


@pytest.mark.integration
def test_killed_daemon_is_sandbox_died_with_its_signal(run, daemon):
    provider, handle = daemon
    url, token = provider.endpoint(handle)

    async def body():
        sb = await aconnect(url, token, liveness_probe=lambda: provider.check_alive(handle))
        pending = asyncio.ensure_future(sb.wait(10_000))
        await asyncio.sleep(0.2)
        os.kill(handle.pid, signal.SIGKILL)
        with pytest.raises(SandboxDied) as info:
            await asyncio.wait_for(pending, 5)
        assert info.value.signal == signal.SIGKILL
        await sb.close()

    run(body())


@pytest.mark.integration
def test_wrong_token_against_shinkend(run, daemon):
    provider, handle = daemon
    url, _ = provider.endpoint(handle)

    async def body():
        with pytest.raises(AuthRefused):
            await aconnect(url, "not-the-token")

    run(body())


@pytest.fixture
def tls_pair(tmp_path):
    """(server context, client context trusting it) from a throwaway self-signed certificate."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


def test_wss_is_dialed_by_the_sdk(run, peer, helpers, tls_pair):
    import ssl

    server_ctx, client_ctx = tls_pair

    async def body():
        async with peer(helpers.serve_forever, ssl=server_ctx) as url:
            assert url.startswith("wss://")
            async with await aconnect(url, TOKEN, ssl=client_ctx) as sb:
                assert await sb.wait(1) == {"echo": 1}
            with pytest.raises(ConnectError) as info:  # the system trust store does not know this cert
                await aconnect(url, TOKEN)
            assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)

    run(body())


def test_oversized_call_is_refused_before_sending(run, peer, helpers):
    from shinken_sync.errors import MessageTooBig

    async def body():
        async with peer(helpers.serve_forever) as url, await aconnect(url, TOKEN) as sb:
            with pytest.raises(MessageTooBig):
                await sb.write_file("/tmp/x", b"\0" * protocol.MAX_MESSAGE_SIZE)
            assert await sb.wait(1) == {"echo": 2}  # the connection was not touched

    run(body())


def test_protocol_version_mismatch_is_a_typed_connect_error(run, peer):
    async def script(ws):
        hello = protocol.Hello(protocol.PROTOCOL_VERSION + 1, "future", 10, 10, (), "none")
        await ws.send(protocol.encode_hello(hello))
        await ws.wait_closed()

    async def body():
        async with peer(script, send_hello=False) as url:
            with pytest.raises(ProtocolMismatch, match="protocol version") as err:
                await aconnect(url, TOKEN)
        assert isinstance(err.value, ConnectError) and err.value.url == url
        assert (err.value.daemon, err.value.client) == (protocol.PROTOCOL_VERSION + 1, protocol.PROTOCOL_VERSION)

    run(body())


@pytest.mark.integration
def test_hundreds_of_concurrent_calls_each_get_their_own_reply(run, daemon, tmp_path):
    provider, handle = daemon
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(256)))

    async def body():
        async with await aconnect(*provider.endpoint(handle)) as sb:
            got = await asyncio.gather(*(sb.read_file(str(path), offset=i, max_bytes=1) for i in range(256)))
            assert got == [bytes([i]) for i in range(256)]
            assert sb.pending_calls == 0

    run(body())


def test_large_messages_arriving_back_to_back_stay_intact(run, peer, helpers):
    """Releasing a read message's memory never touches a message still queued:
    four large image replies sent in one burst all arrive byte for byte."""
    images = [bytes([i]) * (64 * 1024 + i) for i in range(1, 5)]

    async def script(ws):
        calls = await helpers.calls(ws, 4)
        for call, image in zip(calls, images):
            await helpers.image(ws, call, image)
        await helpers.serve_forever(ws)

    async def body():
        async with peer(script) as url, await aconnect(url, TOKEN) as sb:
            shots = await asyncio.gather(*(sb.screenshot() for _ in images))
            assert [shot.data for shot in shots] == images

    run(body())
