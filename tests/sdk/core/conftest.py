"""Fixtures for the async-core tests.

``peer``: a scripted ACI daemon inside the test process -- a ``websockets``
server that sends a hello and hands the connection to the test's script, so a
test can reorder, withhold, corrupt or drop replies on purpose (the real
shinkend never misbehaves that way). ``daemon``: a real shinkend process
through the local provider, for integration tests.

There is no pytest-asyncio here; tests call ``run(coro)`` (one fresh loop per
test, bounded so a bug hangs one test for seconds, not the suite).
"""

from __future__ import annotations

import asyncio
import contextlib
import http
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from shinken_sync import protocol

TOKEN = "test-token"
#: Upper bound on one test's event loop; a hang fails fast instead of at pytest's 120 s.
RUN_TIMEOUT_S = 30.0

Script = Callable[[ServerConnection], Awaitable[None]]


def _run(coro: Awaitable[Any], timeout: float = RUN_TIMEOUT_S) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


@pytest.fixture
def run() -> Callable[..., Any]:
    return _run


class Peer:
    """Helpers for scripts: read calls, send replies, images and frames."""

    @staticmethod
    async def calls(ws: ServerConnection, n: int) -> list[protocol.Call]:
        return [protocol.decode_call(await ws.recv()) for _ in range(n)]

    @staticmethod
    async def reply(ws: ServerConnection, call: protocol.Call, result: dict[str, Any] | None = None) -> None:
        await ws.send(protocol.encode_reply(call.call_id, result=result or {}))

    @staticmethod
    async def error(ws: ServerConnection, call: protocol.Call, kind: str = protocol.ERR_FAILED) -> None:
        await ws.send(protocol.encode_error(call.call_id, kind, f"scripted {kind}"))

    @staticmethod
    async def image(ws: ServerConnection, call: protocol.Call, data: bytes = b"\xff\xd8jpeg") -> None:
        meta = {"format": "jpeg", "width": 64, "height": 36, "scale": 2.0, "x0": 0, "y0": 0}
        await ws.send(protocol.encode_image_reply(call.call_id, meta, data))

    @staticmethod
    def frame(stream_id: str, seq: int, size: int = 1000) -> bytes:
        meta = {"format": "jpeg", "width": 32, "height": 18, "scale": 4.0, "x0": 0, "y0": 0, "ts": 0.0}
        return protocol.encode_frame(stream_id, seq, meta, b"\0" * size)

    @staticmethod
    async def answer(ws: ServerConnection, call: protocol.Call) -> None:
        """A plausible ok reply for any verb."""
        if call.verb == "screenshot":
            await Peer.image(ws, call)
        elif call.verb == "screencast_start":
            params = {"fps": 5.0, "format": "jpeg", "quality": 80, "max_long_edge": None}
            await Peer.reply(ws, call, {"stream_id": "s1", **params})
        else:
            await Peer.reply(ws, call, {"echo": call.call_id})

    @staticmethod
    async def serve_forever(ws: ServerConnection) -> None:
        """Answer every call in order until the client goes away."""
        with contextlib.suppress(Exception):
            async for message in ws:
                await Peer.answer(ws, protocol.decode_call(message))


def _check_token(connection: ServerConnection, request: Any) -> Any:
    if request.headers.get("Authorization") != f"Bearer {TOKEN}":
        return connection.respond(http.HTTPStatus.UNAUTHORIZED, "bad token\n")
    return None


@contextlib.asynccontextmanager
async def _scripted(script: Script, *, send_hello: bool = True, ssl: Any = None) -> AsyncIterator[str]:
    hello = protocol.Hello(
        protocol.PROTOCOL_VERSION, "scripted-1", 640, 360, tuple(sorted(protocol.VERBS)), "none"
    )

    async def handler(ws: ServerConnection) -> None:
        if send_hello:
            await ws.send(protocol.encode_hello(hello))
        await script(ws)

    async with serve(
        handler,
        "127.0.0.1",
        0,
        process_request=_check_token,
        compression=None,
        max_size=protocol.MAX_MESSAGE_SIZE,
        ssl=ssl,
    ) as server:
        port = server.sockets[0].getsockname()[1]
        yield f"{'wss' if ssl else 'ws'}://127.0.0.1:{port}/"


@pytest.fixture
def peer() -> Callable[..., contextlib.AbstractAsyncContextManager[str]]:
    """``async with peer(script) as url:`` serves ``script`` to each connection."""
    return _scripted


@pytest.fixture
def helpers() -> type[Peer]:
    return Peer


@pytest.fixture
def daemon():
    """A real virtual-display shinkend; yields ``(provider, handle)``."""
    from shinken_sync.providers.local import LocalProvider

    with LocalProvider(display="virtual", screen=(1024, 768)) as provider:
        yield provider, provider.create()


@pytest.fixture
def slow_daemon():
    """A real shinkend that holds every outgoing message 300 ms (emulated RTT)."""
    from shinken_sync.providers.local import LocalProvider

    with LocalProvider(display="virtual", screen=(1024, 768), rtt_ms=300) as provider:
        yield provider, provider.create()
