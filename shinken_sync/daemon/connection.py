"""One client connection: a reader, one worker, one sender.

The reader parses each incoming message and queues it; the worker runs the
queue strictly in order and hands each encoded reply to the :class:`Outbox`,
whose sender task writes them (after the emulated RTT, if any). A message that
is not a valid call is queued as its error reply, so even error replies keep
the order of the messages that caused them and a client may pipeline freely.

Per connection: three tasks, a call queue of at most :data:`MAX_PIPELINE`
entries and an outbox bounded in bytes -- small enough for thousands of
connections in one process.
"""

from __future__ import annotations

import asyncio
import logging

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from shinken_sync.protocol import (
    PROTOCOL_VERSION,
    VERBS,
    Call,
    Hello,
    ProtocolError,
    decode_call,
    encode_error,
    encode_hello,
)

from .outbox import Outbox
from .verbs import Sandbox, execute

log = logging.getLogger("shinkend.connection")

#: Calls received but not yet run, per connection. When full, the reader stops
#: reading and TCP pushes back on the client.
MAX_PIPELINE = 64

_Queued = Call | str  # a call to run, or an error reply already encoded


async def serve_connection(ws: ServerConnection, sandbox: Sandbox, delay_s: float) -> None:
    outbox = Outbox(ws.send, delay_s)
    calls: asyncio.Queue[_Queued] = asyncio.Queue(MAX_PIPELINE)
    sender = asyncio.create_task(outbox.run())
    worker = asyncio.create_task(_work(sandbox, outbox, calls))
    display = sandbox.display
    outbox.put_nowait(
        encode_hello(
            Hello(PROTOCOL_VERSION, sandbox.sandbox_id, display.width, display.height, tuple(VERBS), display.kind)
        )
    )
    try:
        async for message in ws:
            await calls.put(_parse(message))
    except ConnectionClosed:
        pass  # 1009 (message too big) and abrupt drops end up here; others carry on
    finally:
        worker.cancel()
        sandbox.streams.detach_outbox(outbox)
        await asyncio.gather(worker, return_exceptions=True)
        outbox.close()
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)


def _parse(message: str | bytes) -> _Queued:
    try:
        return decode_call(message)
    except ProtocolError as exc:
        return encode_error(exc.call_id, exc.kind, str(exc))


async def _work(sandbox: Sandbox, outbox: Outbox, calls: asyncio.Queue[_Queued]) -> None:
    while True:
        item = await calls.get()
        reply = item if isinstance(item, str) else await execute(sandbox, outbox, item)
        await outbox.put(reply)
