"""One client connection: a reader, one worker, one sender.

The reader parses each incoming message and queues it; the worker runs the
queue strictly in order and hands each encoded reply to the :class:`Outbox`,
whose sender task writes them (after the emulated RTT, if any). A message that
is not a valid call is queued as its error reply, so even error replies keep
the order of the messages that caused them and a client may pipeline freely.

Once the connection is closing or gone, nothing more runs for it: the worker
looks at the connection's state before each call, the call in progress is
cancelled (a running ``exec`` is killed with its process group) and the calls
still queued are dropped. While the queue is full the reader stops reading, so
TCP pushes back on the client -- and asyncio, no longer reading, cannot see the
client leave. The reader therefore polls the socket's TCP state every
:data:`PEER_POLL_S` while it waits for room: a client that closed or reset is
noticed within that time, not after its whole backlog ran.

Per connection: three tasks, a call queue of at most :data:`MAX_PIPELINE`
entries and an outbox bounded in bytes -- small enough for thousands of
connections in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.protocol import State

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
from .verbs import SandboxState, execute

log = logging.getLogger("shinkend.connection")

#: Calls received but not yet run, per connection. When full, the reader stops
#: reading and TCP pushes back on the client.
MAX_PIPELINE = 64
#: How often a reader waiting for room in a full queue checks that its peer is
#: still there.
PEER_POLL_S = 0.2

_Queued = Call | str  # a call to run, or an error reply already encoded
_TCP_ESTABLISHED = 1  # tcp_info.tcpi_state (include/net/tcp_states.h)


async def serve_connection(ws: ServerConnection, sandbox: SandboxState, delay_s: float) -> None:
    outbox = Outbox(ws.send, delay_s)
    calls: asyncio.Queue[_Queued] = asyncio.Queue(MAX_PIPELINE)
    sender = asyncio.create_task(outbox.run())
    worker = asyncio.create_task(_work(ws, sandbox, outbox, calls))
    display = sandbox.display
    outbox.put_nowait(
        encode_hello(
            Hello(PROTOCOL_VERSION, sandbox.sandbox_id, display.width, display.height, tuple(VERBS), display.kind)
        )
    )
    try:
        async for message in ws:
            if not await _enqueue(ws, calls, _parse(message)):
                # Gone or closing while unread frames hold the transport paused:
                # no close handshake can complete, so do not wait for one.
                ws.transport.abort()
                break
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


async def _enqueue(ws: ServerConnection, calls: asyncio.Queue[_Queued], item: _Queued) -> bool:
    """Queue ``item``, waiting for room; False if the connection closed or its
    peer vanished meanwhile."""
    if not calls.full():
        calls.put_nowait(item)
        return True
    put = asyncio.ensure_future(calls.put(item))
    try:
        while True:
            done, _ = await asyncio.wait({put}, timeout=PEER_POLL_S)
            if done:
                return True
            if ws.state is not State.OPEN or _peer_gone(ws):
                return False
    finally:
        put.cancel()


def _peer_gone(ws: ServerConnection) -> bool:
    """True when the kernel says the TCP peer closed (FIN) or reset (RST) the
    connection, even though nobody read the data still buffered before that."""
    sock = ws.transport.get_extra_info("socket") if ws.transport is not None else None
    option = getattr(socket, "TCP_INFO", None)
    if sock is None or option is None:  # not Linux: rely on reads and writes failing
        return False
    with contextlib.suppress(OSError):
        return bool(sock.getsockopt(socket.IPPROTO_TCP, option, 1)[0] != _TCP_ESTABLISHED)
    return False


async def _work(ws: ServerConnection, sandbox: SandboxState, outbox: Outbox, calls: asyncio.Queue[_Queued]) -> None:
    while True:
        item = await calls.get()
        # Checked per call, not left to the reader's cancel alone: a cancel can
        # be lost inside a verb (see .deadline), and a closing connection can
        # deliver no reply anyway, so what is queued is dropped, not run.
        if ws.state is not State.OPEN or outbox.closed:
            return
        reply = item if isinstance(item, str) else await execute(sandbox, outbox, item)
        await outbox.put(reply)
