"""The IPC channel over one socketpair end, cooperative with gevent.

One :class:`FrameTransport` per socket end: a reader greenlet that ``recv_into``\\ s the
:class:`~webapp.ipc.FrameDecoder`'s buffers and a writer greenlet that writes whole frames
from two queues (control frames first, then streamed-body chunks), so a frame is never
interleaved with another even though a write may yield half-way. The socket is a plain
``_socket.socket`` in non-blocking mode waited on with ``wait_read``/``wait_write``, so it
never blocks the hub whether or not the process is monkey-patched.

:class:`IpcClient` (router side) multiplexes requests by id; :class:`IpcServer` (worker
side) runs each request in its own greenlet. See ``docs/ipc.md``.
"""

from __future__ import annotations

import _socket
import itertools
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gevent
import gevent.event
import gevent.queue
import gevent.socket
from gevent.socket import wait_read, wait_write

from webapp import body_handoff, iovec
from webapp.body_handoff import HandedBody
from webapp.bulk import bulk_lane, bulk_turn
from webapp.http_limits import BodyError, read_socket_body
from webapp.ipc import (
    INLINE_BODY_MAX,
    MAX_BODY_CHUNK,
    MAX_FRAME_BYTES,
    WORKER_BUSY,
    Buffer,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    IpcChannelClosed,
    IpcError,
    IpcProtocolError,
    IpcRemoteError,
    IpcTimeout,
    ReceiveBufferPool,
    body_length,
    decode_credit,
    decode_envelope,
    decode_error,
    encode_credit,
    encode_envelope_frame,
    encode_error_frame,
    encode_frame,
    iter_frames,
    split_body,
)

__all__ = [
    "BodyStream", "FrameTransport", "IpcClient", "IpcReply", "IpcServer", "ReplyLike", "ReplyStream", "open_socket",
]

log = logging.getLogger(__name__)

# Unconsumed bytes of one streamed body the worker may have in flight; bounds the router's
# memory per records GET to this, whatever the HTTP client's speed.
STREAM_WINDOW = 8 * MAX_BODY_CHUNK
# Consumed bytes are granted back in batches this big: one CREDIT frame per chunk would wake
# the worker a thousand times per GiB.
_CREDIT_BATCH = STREAM_WINDOW // 4
# A peer that accepts no bytes for this long is considered gone.
WRITE_STALL_TIMEOUT = 120.0
# A worker stream whose consumer grants no credit for this long gives up.
STREAM_CREDIT_TIMEOUT = 120.0
# Requests a worker runs at once; beyond this it answers ERROR WorkerBusy at once.
MAX_INFLIGHT_REQUESTS = 4096
# The reader yields to other greenlets after this many bytes without an EAGAIN.
_READ_YIELD_BYTES = 4 * MAX_BODY_CHUNK
_SOCKET_BUFFER_BYTES = 4 * 1024 * 1024


def open_socket(fd: int) -> _socket.socket:
    """Take ownership of a socketpair end ``fd`` as a non-blocking plain socket."""
    sock = _socket.socket(fileno=fd)
    sock.setblocking(False)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
        except OSError:  # capped by the kernel: the default still works, only slower
            pass
    return sock


class FrameTransport:
    """Reader and writer greenlets over one socket end.

    ``on_frame`` runs in the reader greenlet for every decoded frame and must not block.
    ``on_close`` runs once, with the :class:`IpcChannelClosed` that ended the channel.
    ``allocate(size)`` gives the buffer a large payload is received into (see
    :class:`~webapp.ipc.FrameDecoder`). ``body_sink(request_id, size)``, if given, names where
    the next at most ``size`` bytes of a BODY payload belong (a writable view, or None: a new
    ``bytes``); the piece is received straight into it and handed to ``on_frame`` as a view of
    it, released after ``on_frame`` returns (``on_frame`` keeps none of it).
    """

    def __init__(
        self,
        sock: _socket.socket,
        on_frame: Callable[[Frame], None],
        on_close: Callable[[IpcChannelClosed], None],
        name: str = "ipc",
        allocate: Callable[[int], Any] = bytearray,
        body_sink: Callable[[int, int], memoryview | None] | None = None,
    ) -> None:
        self.name = name
        self._allocate = allocate
        self._body_sink = body_sink
        self._sock = sock
        self._fd = sock.fileno()
        self._on_frame = on_frame
        self._on_close = on_close
        self._control: deque[Sequence[Buffer]] = deque()  # frames, or the rest of one (views)
        self._bulk: deque[list[Buffer]] = deque()
        self._wake = gevent.event.Event()
        self.bulk_bytes = 0  # bytes of queued bulk frames not yet written
        self._bulk_drained = gevent.event.Event()
        self._writing = False  # the writer is inside a frame (it may be waiting to write more)
        self.closed: IpcChannelClosed | None = None
        self._reader = gevent.spawn(self._read_loop)
        self._writer = gevent.spawn(self._write_loop)

    def send(self, frame: list[Buffer], *, bulk: bool = False) -> None:
        """Queue one whole frame; control frames overtake queued bulk frames.

        A control frame finding the writer idle and nothing queued is written at once from
        the caller (one non-blocking ``sendmsg``), saving a greenlet hop per message; whatever
        the socket did not take is left to the writer, ahead of anything queued later.
        """
        closed = self.closed
        if closed is not None:
            raise IpcChannelClosed(closed.reason) from closed
        if bulk:
            self._bulk.append(frame)
            self.bulk_bytes += sum(len(b) for b in frame)
        elif self._writing or self._control or self._bulk:
            self._control.append(frame)
        else:
            views = iovec.views(frame)
            try:
                first = _send_some(self._sock, views, 0)
            except OSError as exc:
                self.close(f"write failed: {exc!r}", exc)
                assert self.closed is not None  # close() set it
                raise IpcChannelClosed(self.closed.reason) from exc
            if first == len(views):
                return
            self._control.append(views[first:])
        self._wake.set()

    def wait_bulk_below(self, limit: int, timeout: float) -> None:
        """Block until at most ``limit`` bytes of bulk frames are queued (the producer's
        backpressure), the channel closed, or ``timeout`` passed (:class:`IpcTimeout`)."""
        with gevent.Timeout(timeout, False):
            while self.bulk_bytes > limit and self.closed is None:
                self._bulk_drained.clear()
                self._bulk_drained.wait()
            if self.closed is not None:
                raise IpcChannelClosed(self.closed.reason) from self.closed
            return
        raise IpcTimeout(f"{self.name}: the channel took no bulk bytes for {timeout} s")

    def close(self, reason: str = "closed locally", cause: BaseException | None = None) -> None:
        if self.closed is not None:
            return
        exc = IpcChannelClosed(f"{self.name}: {reason}")
        exc.__cause__ = cause
        self.closed = exc
        current = gevent.getcurrent()
        # Wait for them to die before closing the fd: a watcher must not outlive its fd.
        gevent.killall([g for g in (self._reader, self._writer) if g is not current], timeout=1.0)
        self._control.clear()
        self._bulk.clear()
        self.bulk_bytes = 0
        self._bulk_drained.set()
        try:
            self._sock.close()
        finally:
            self._on_close(exc)

    def _read_loop(self) -> None:
        decoder = FrameDecoder(allocate=self._allocate)
        sock, fd, sink = self._sock, self._fd, self._body_sink
        since_yield = 0
        try:
            while True:
                wanted = decoder.piece_wanted()
                target = sink(decoder.piece_request_id, min(wanted, MAX_BODY_CHUNK)) if wanted and sink else None
                piece: Buffer = b""
                try:
                    if target is not None:
                        n = sock.recv_into(target)
                        piece = target[:n]
                    elif wanted:
                        piece = sock.recv(min(wanted, MAX_BODY_CHUNK))
                        n = len(piece)
                    else:
                        n = sock.recv_into(decoder.buffer())
                except BlockingIOError:
                    since_yield = 0
                    wait_read(fd)
                    continue
                finally:
                    if target is not None:
                        target.release()
                if n == 0:
                    self.close("peer closed the channel (EOF)")
                    return
                for frame in decoder.piece_received(piece) if wanted else decoder.advance(n):
                    self._on_frame(frame)
                if isinstance(piece, memoryview):  # the consumer's buffer: no view of it outlives the piece
                    piece.release()
                since_yield += n
                if since_yield >= _READ_YIELD_BYTES:
                    since_yield = 0
                    gevent.sleep(0)
        except IpcProtocolError as exc:
            self.close(f"protocol error: {exc}", exc)
        except OSError as exc:
            self.close(f"read failed: {exc!r}", exc)
        except gevent.GreenletExit:
            raise
        except BaseException as exc:  # a crash must still fail every pending request
            self.close(f"reader crashed: {exc!r}", exc)
            raise

    def _write_loop(self) -> None:
        try:
            while True:
                if self._control:
                    frame, size = self._control.popleft(), 0
                elif self._bulk:
                    bulk_turn()
                    if self._control or not self._bulk:  # something small arrived meanwhile: it goes first
                        continue
                    frame = self._bulk.popleft()
                    size = sum(len(b) for b in frame)
                else:
                    self._wake.clear()
                    self._wake.wait()
                    continue
                self._writing = True
                self._write_frame(frame)
                self._writing = False
                if size:
                    self.bulk_bytes -= size
                    self._bulk_drained.set()
        except OSError as exc:
            self.close(f"write failed: {exc!r}", exc)
        except gevent.GreenletExit:
            raise
        except BaseException as exc:
            self.close(f"writer crashed: {exc!r}", exc)
            raise

    def _write_frame(self, buffers: Sequence[Buffer]) -> None:
        views = iovec.views(buffers)
        first = 0
        while True:
            first = _send_some(self._sock, views, first)
            if first == len(views):
                return
            # socket.timeout is an OSError: a peer that stopped reading closes the channel
            wait_write(self._fd, timeout=WRITE_STALL_TIMEOUT)


def _send_some(sock: _socket.socket, views: list[memoryview], first: int) -> int:
    """One non-blocking scatter send from ``views[first]`` on; returns the new ``first``
    (``len(views)`` when everything went). A partly sent view is replaced by its rest."""
    try:
        sent = sock.sendmsg(views[first : first + iovec.IOV_MAX])
    except BlockingIOError:
        return first
    return iovec.advance(views, first, sent)


@dataclass
class IpcReply:
    """A worker's reply as the router sees it: opaque body, or a stream of chunks."""

    status: int
    content_type: str
    headers: list[tuple[str, str]]
    length: int
    body: bytes = b""
    stream: ReplyStream | None = None
    # The body is ``body`` spliced with ranges of a file the router reads itself (a records
    # GET: ``webapp.filebody.encode_layout``); None: ``body`` / ``stream`` is the whole body.
    file_layout: dict[str, Any] | None = None


class ReplyStream(Protocol):
    """What the router reads of a streamed reply body: the chunks once, in order, then close
    (a worker's :class:`BodyStream`, or an in-process shard's chunk list)."""

    length: int
    consumed: int

    def __iter__(self) -> Iterator[bytes]: ...

    def close(self) -> None: ...


class BodyStream:
    """The chunks of one streamed reply body, in order; iterate once, then close."""

    def __init__(self, client: IpcClient, request_id: int, length: int, chunk_timeout: float) -> None:
        self._client = client
        self.request_id = request_id
        self.length = length
        self.chunk_timeout = chunk_timeout
        self.received = 0
        self.consumed = 0
        self._ungranted = 0
        self._queue: gevent.queue.Queue = gevent.queue.Queue()
        self._done = False

    def _feed(self, chunk: Buffer) -> bool:
        """Called by the reader; returns True once the whole body arrived."""
        self.received += len(chunk)
        self._queue.put(chunk)
        return self.received >= self.length

    def _fail(self, exc: IpcError) -> None:
        self._queue.put(exc)

    def __iter__(self) -> Iterator[bytes]:
        try:
            while self.consumed < self.length:
                try:
                    item = self._queue.get(timeout=self.chunk_timeout)
                except gevent.queue.Empty:
                    raise IpcTimeout(
                        f"no body chunk of request {self.request_id} within {self.chunk_timeout} s"
                    ) from None
                if isinstance(item, IpcError):
                    raise item
                yield item  # bytes: the decoder hands BODY payloads over as bytes pieces
                self.consumed += len(item)
                self._ungranted += len(item)
                if self._ungranted >= _CREDIT_BATCH and self.consumed < self.length:
                    self._client._grant(self.request_id, self._ungranted)
                    self._ungranted = 0
            self._done = True
        finally:
            self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._client._abandon_stream(self.request_id)


@dataclass
class _Pending:
    result: gevent.event.AsyncResult = field(default_factory=gevent.event.AsyncResult)
    chunk_timeout: float = 60.0


class IpcClient:
    """Router side of a channel: many concurrent :meth:`request` calls from many greenlets.

    Request ids are never reused, and a request forgets its id when it ends (reply, error,
    timeout or greenlet kill), so a late reply finds nobody and is dropped.
    """

    def __init__(
        self,
        sock: _socket.socket,
        name: str = "ipc-client",
        on_close: Callable[[IpcChannelClosed], None] | None = None,
        handoff: _socket.socket | None = None,
    ) -> None:
        self._ids = itertools.count(1)
        # The router's end of the worker's handoff channel (webapp.body_handoff), if it has one.
        self._handoff = handoff
        self._pending: dict[int, _Pending] = {}
        self._streams: dict[int, BodyStream] = {}
        self._user_on_close = on_close
        self._transport = FrameTransport(sock, self._on_frame, self._on_close, name)

    @property
    def closed(self) -> IpcChannelClosed | None:
        return self._transport.closed

    def close(self, reason: str = "closed locally") -> None:
        self._transport.close(reason)

    @property
    def takes_body_sockets(self) -> bool:
        """Whether :meth:`request` takes ``body_socket`` (the worker has a handoff channel)."""
        return self._handoff is not None

    def request(
        self,
        meta: dict[str, Any],
        body: Buffer | Sequence[Buffer] = b"",
        *,
        timeout: float,
        chunk_timeout: float = 60.0,
        body_stream: Iterable[Buffer] | None = None,
        body_length: int | None = None,
        body_socket: HandedBody | None = None,
        body_timeout: float = 60.0,
    ) -> IpcReply:
        """Send one REQUEST and wait up to ``timeout`` s for its REPLY (head).

        With ``body_stream`` (instead of ``body``) the request body is streamed: its pieces
        go out as BODY frames as the iterator yields them, at most :data:`STREAM_WINDOW`
        bytes queued at a time, so the caller never holds the whole body; ``body_length``
        (if known) lets the worker receive it into one buffer of that size. An exception from
        the iterator cancels the request and propagates. ``timeout`` starts once the body is sent.

        With ``body_socket`` (instead of both; :attr:`takes_body_sockets`) the worker receives
        the body from the client's connection itself, within ``body_timeout`` seconds
        (``webapp.body_handoff``); ``timeout`` then counts from the hand-off, plus
        ``body_timeout``. The body is marked consumed when a REPLY arrives, else abandoned.

        A streamed reply's :attr:`IpcReply.stream` must be iterated or closed by the caller.

        Raises:
            FrameTooLarge: the request is over the frame cap (nothing was sent).
            IpcTimeout: no reply within ``timeout``, or the channel took no body bytes for
                ``chunk_timeout``; the request is cancelled.
            IpcChannelClosed: the channel is or went down.
            IpcRemoteError: the worker answered with an ERROR frame.
        """
        request_id = next(self._ids)
        if body_stream is not None:
            meta = {**meta, "body": "streamed", "length": body_length}
        elif body_socket is not None:
            if self._handoff is None:
                raise ValueError(f"{self._transport.name}: no handoff channel for a body_socket")
            meta = {**meta, "body": "socket", "length": body_socket.length, "body_timeout": body_timeout}
            body, timeout = body_socket.ahead, timeout + body_timeout
        frame = encode_envelope_frame(request_id, FrameType.REQUEST, meta, body)
        pending = _Pending(chunk_timeout=chunk_timeout)
        self._pending[request_id] = pending
        answered = replied = False
        try:
            if body_socket is not None:
                self._hand_off(frame, body_socket, chunk_timeout)
            else:
                self._transport.send(frame)
            if body_stream is not None:
                self._send_body(request_id, pending, body_stream, chunk_timeout)
            try:
                reply: IpcReply = pending.result.get(timeout=timeout)  # gevent is Any; _reply_from set it
            except gevent.Timeout:
                raise IpcTimeout(f"no reply to {meta.get('op')!r} within {timeout} s") from None
            except IpcRemoteError:
                answered = True  # the worker is done with it: nothing to cancel
                raise
            answered = replied = True
            return reply
        finally:
            self._pending.pop(request_id, None)
            if not answered:
                self._cancel(request_id, pending)
            if body_socket is not None and replied:
                body_socket.consumed()
            elif body_socket is not None:
                body_socket.abandon()

    def _hand_off(self, frame: list[Buffer], body: HandedBody, stall: float) -> None:
        assert self._handoff is not None  # request() checked
        closed = self.closed
        if closed is not None:
            raise IpcChannelClosed(closed.reason) from closed
        try:
            body_handoff.send(self._handoff, frame, body.fileno(), stall)
        except OSError as exc:  # the worker's end is gone: so is the worker
            raise IpcChannelClosed(f"{self._transport.name}: handoff failed: {exc!r}") from exc

    def _send_body(self, request_id: int, pending: _Pending, pieces: Iterable[Buffer], stall: float) -> None:
        for piece in pieces:
            if pending.result.ready():  # the worker answered already (an error): stop reading
                return
            for chunk in split_body(piece):
                self._transport.send(encode_frame(request_id, FrameType.BODY, [chunk]), bulk=True)
            self._transport.wait_bulk_below(STREAM_WINDOW, stall)
        self._transport.send(encode_frame(request_id, FrameType.BODY), bulk=True)  # empty: the end

    def _cancel(self, request_id: int, pending: _Pending) -> None:
        if pending.result.ready() and pending.result.successful():
            stream = pending.result.value.stream
            if stream is not None:  # the head arrived just as we gave up
                stream.close()
                return
        self._send_quietly(encode_frame(request_id, FrameType.CANCEL))

    def _grant(self, request_id: int, nbytes: int) -> None:
        self._send_quietly(encode_credit(request_id, nbytes))

    def _abandon_stream(self, request_id: int) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._send_quietly(encode_frame(request_id, FrameType.CANCEL))

    def _send_quietly(self, frame: list[Buffer]) -> None:
        if self.closed is None:
            self._transport.send(frame)

    def _on_frame(self, frame: Frame) -> None:
        rid = frame.request_id
        if frame.type is FrameType.BODY:
            stream = self._streams.get(rid)
            if stream is not None and stream._feed(frame.payload):
                del self._streams[rid]
            return
        if frame.type is FrameType.REPLY:
            meta, body = decode_envelope(frame.payload)
            pending = self._pending.pop(rid, None)
            if pending is None:
                if meta.get("streamed"):  # nobody waits: stop the worker's stream
                    self._send_quietly(encode_frame(rid, FrameType.CANCEL))
                return
            pending.result.set(self._reply_from(rid, meta, body, pending.chunk_timeout))
            return
        if frame.type is FrameType.ERROR:
            error = decode_error(frame.payload)
            pending = self._pending.pop(rid, None)
            if pending is not None:
                pending.result.set_exception(error)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._fail(error)
            return
        raise IpcProtocolError(f"unexpected {frame.type.name} frame from the worker")

    def _reply_from(self, rid: int, meta: dict[str, Any], body: memoryview, chunk_timeout: float) -> IpcReply:
        try:
            reply = IpcReply(
                status=int(meta["status"]),
                content_type=str(meta.get("content_type", "application/json")),
                headers=[(str(k), str(v)) for k, v in meta.get("headers", ())],
                length=int(meta.get("length", len(body))),
                file_layout=meta.get("file_layout"),
            )
            if reply.file_layout is not None and not isinstance(reply.file_layout, dict):
                raise TypeError("file_layout must be an object")
        except (KeyError, TypeError, ValueError) as exc:
            raise IpcProtocolError(f"malformed reply meta {meta!r}") from exc
        if meta.get("streamed"):
            reply.stream = BodyStream(self, rid, reply.length, chunk_timeout)
            if reply.length:
                self._streams[rid] = reply.stream
        else:
            reply.body = bytes(body)
        return reply

    def _on_close(self, exc: IpcChannelClosed) -> None:
        if self._handoff is not None:
            self._handoff.close()  # descriptors still in it are closed by the kernel
        pending, self._pending = self._pending, {}
        streams, self._streams = self._streams, {}
        for item in pending.values():
            item.result.set_exception(exc)
        for stream in streams.values():
            stream._fail(exc)
        if self._user_on_close is not None:
            self._user_on_close(exc)


class ReplyLike(Protocol):
    """What a server handler returns (``webapp.core.Reply`` fits)."""

    status: int
    body: bytes | list[bytes]
    content_type: str
    headers: tuple[tuple[str, str], ...]
    # Optional (``getattr``): sent as the reply's ``file_layout`` (see ``IpcReply``).
    # file_layout: dict[str, Any] | None


class _OutStream:
    def __init__(self) -> None:
        self.inflight = 0
        self.cancelled = False
        self.changed = gevent.event.Event()


class _InBody:
    """A streamed request body being received: into one pool buffer when its length is
    known, else a growing bytearray."""

    def __init__(self, meta: dict[str, Any], length: Any, pool: ReceiveBufferPool) -> None:
        self.meta = meta
        valid = isinstance(length, int) and not isinstance(length, bool) and 0 <= length <= MAX_FRAME_BYTES
        self.length = length if valid else None
        self.buffer: Any = pool.acquire(self.length) if self.length else bytearray()
        self.received = 0

    def room(self, size: int) -> memoryview | None:
        """A view of the buffer's next at most ``size`` bytes to receive into (None: no room, or
        a growing buffer); a piece received into it is given back to :meth:`add` as such."""
        left = self.length - self.received if self.length is not None else 0
        return memoryview(self.buffer)[self.received:self.received + min(size, left)] if left > 0 else None

    def add(self, piece: Buffer) -> str | None:
        """Append ``piece``; a reason (the request fails, the channel stays up) if it does not fit."""
        end = self.received + len(piece)
        limit = MAX_FRAME_BYTES if self.length is None else self.length
        if end > limit:
            return f"streamed request body over {'its announced' if self.length is not None else 'the'} {limit} bytes"
        if isinstance(piece, memoryview) and piece.obj is self.buffer:
            pass  # received in place (:meth:`room`): the next bytes of the buffer already
        elif self.length is not None:
            self.buffer[self.received:end] = piece
        else:
            self.buffer += piece
        self.received = end
        return None

    def short(self) -> str | None:
        if self.length is not None and self.received != self.length:
            return f"streamed request body of {self.received} bytes, {self.length} announced"
        return None

    def payload(self) -> Any:
        """The received body; a view of a pool buffer goes back to the pool after the handler."""
        if isinstance(self.buffer, bytearray):
            return self.buffer
        return memoryview(self.buffer)[: self.received]


class IpcServer:
    """Worker side of a channel: runs ``handler(meta, body)`` in a greenlet per request.

    A handler exception becomes an ERROR frame for that request only. A CANCEL stops a
    streamed body and drops a reply not yet sent; the handler itself runs to completion so
    the session state it touches stays consistent.

    ``body`` is valid only while the handler runs: a large one lives in a buffer of
    ``receive_pool`` that later requests reuse, so a handler copies what it keeps. The view it
    got is released when it returns; a buffer some view of which is still alive then is never
    reused (see :class:`~webapp.ipc.ReceiveBufferPool`).
    """

    def __init__(
        self,
        sock: _socket.socket,
        handler: Callable[[dict[str, Any], memoryview], ReplyLike],
        name: str = "ipc",
        receive_pool: ReceiveBufferPool | None = None,
        handoff: _socket.socket | None = None,
    ) -> None:
        self._handler = handler
        self._inflight: dict[int, _OutStream] = {}
        self._incoming: dict[int, _InBody] = {}  # streamed request bodies still arriving
        self._stopped = gevent.event.Event()
        self.receive_pool = receive_pool if receive_pool is not None else ReceiveBufferPool()
        self._transport = FrameTransport(sock, self._on_frame, self._on_close, name, self.receive_pool.acquire,
                                         self._body_view)
        # The worker's end of the handoff channel (webapp.body_handoff): requests whose body
        # this process receives from the client's connection.
        self._handoff = handoff
        self._handoff_reader = gevent.spawn(self._receive_handoffs) if handoff is not None else None

    @property
    def closed(self) -> IpcChannelClosed | None:
        return self._transport.closed

    def wait_closed(self, timeout: float | None = None) -> IpcChannelClosed | None:
        self._stopped.wait(timeout)
        return self.closed

    def close(self, reason: str = "closed locally") -> None:
        self._transport.close(reason)

    def _body_view(self, rid: int, size: int) -> memoryview | None:
        """Where the next piece of request ``rid``'s streamed body goes: its buffer (the transport's
        ``body_sink``), so a body is written once, by the kernel."""
        incoming = self._incoming.get(rid)
        return incoming.room(size) if incoming is not None else None

    def _on_frame(self, frame: Frame) -> None:
        rid = frame.request_id
        if frame.type is FrameType.REQUEST:
            if len(self._inflight) >= MAX_INFLIGHT_REQUESTS:
                self.receive_pool.release(frame.payload)
                self._transport.send(
                    encode_error_frame(rid, IpcRemoteError(WORKER_BUSY, f"{len(self._inflight)} requests running"))
                )
                return
            meta, body = decode_envelope(frame.payload)
            self._inflight[rid] = _OutStream()
            if meta.get("body") == "streamed":  # the body follows as BODY frames, then an empty one
                self._incoming[rid] = _InBody(meta, meta.get("length"), self.receive_pool)
                self.receive_pool.release(frame.payload)
                return
            gevent.spawn(self._serve, rid, meta, frame.payload, body)
        elif frame.type is FrameType.BODY:
            incoming = self._incoming.get(rid)
            if incoming is None:  # cancelled: the rest of its body is dropped
                return
            problem = incoming.add(frame.payload) if frame.payload else incoming.short()
            if problem is not None:  # this request fails; the channel and every other one go on
                self._drop_incoming(rid)
                self._transport.send(encode_error_frame(rid, IpcRemoteError("BodyMismatch", problem)))
                return
            if frame.payload:
                return
            del self._incoming[rid]
            payload = incoming.payload()
            gevent.spawn(self._serve, rid, incoming.meta, payload, memoryview(payload))
        elif frame.type is FrameType.CREDIT:
            out = self._inflight.get(rid)
            if out is not None:
                out.inflight -= decode_credit(frame.payload)
                out.changed.set()
        elif frame.type is FrameType.CANCEL:
            self._drop_incoming(rid)
            out = self._inflight.get(rid)
            if out is not None:
                out.cancelled = True
                out.changed.set()
        else:
            raise IpcProtocolError(f"unexpected {frame.type.name} frame from the router")

    def _receive_handoffs(self) -> None:
        assert self._handoff is not None
        try:
            body_handoff.receive_loop(self._handoff, self._on_handoff)
            self.close("the router closed the handoff channel")
        except IpcProtocolError as exc:
            self._transport.close(f"handoff protocol error: {exc}", exc)
        except OSError as exc:
            self._transport.close(f"handoff read failed: {exc!r}", exc)

    def _on_handoff(self, data: bytes, fd: int | None) -> None:
        """One handed-off REQUEST: checked here, its body received in its own greenlet. ``fd``
        None: the kernel could not pass the connection (this process is at its descriptor
        limit), so the request is refused unrun, as a busy worker refuses one (retryable)."""
        try:
            frames = list(iter_frames(FrameDecoder(), [data]))
            if len(frames) != 1 or frames[0].type is not FrameType.REQUEST:
                raise IpcProtocolError(f"a handoff message holds {len(frames)} frames, not one REQUEST")
            rid = frames[0].request_id
            meta, inline = decode_envelope(frames[0].payload)
            length, timeout = meta.get("length"), meta.get("body_timeout")
            if not (isinstance(length, int) and len(inline) <= length <= MAX_FRAME_BYTES
                    and isinstance(timeout, (int, float)) and timeout > 0):
                raise IpcProtocolError(f"handed-off request {rid}: bad length {length!r} or body_timeout {timeout!r}")
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        busy = (f"{len(self._inflight)} requests running" if len(self._inflight) >= MAX_INFLIGHT_REQUESTS
                else "no descriptor left to take the client's connection" if fd is None else None)
        if busy is not None:
            if fd is not None:
                os.close(fd)
            self._transport.send(encode_error_frame(rid, IpcRemoteError(WORKER_BUSY, busy)))
            return
        assert fd is not None  # (busy otherwise)
        self._inflight[rid] = _OutStream()
        gevent.spawn(self._receive_handed_body, rid, meta, bytes(inline), fd, length, float(timeout))

    def _receive_handed_body(self, rid: int, meta: dict[str, Any], ahead: bytes, fd: int, length: int,
                             timeout: float) -> None:
        buffer = self.receive_pool.acquire(length) if length else bytearray()
        payload = memoryview(buffer)[:length]
        payload[:len(ahead)] = ahead
        served = False
        try:
            with gevent.socket.socket(fileno=fd) as conn:  # this process's copy of the client's connection
                read_socket_body(conn, payload[len(ahead):], timeout, len(ahead), length, between=bulk_turn)
            if not self._inflight[rid].cancelled:  # (the router gave up meanwhile)
                served = True
                with bulk_lane():  # a large request's CPU work: one at a time, small requests first
                    self._serve(rid, meta, payload, memoryview(payload))
        except BodyError as exc:  # the router answers it as its own read would have (408, 400)
            self._transport.send(encode_error_frame(rid, IpcRemoteError.from_exception(exc)))
        finally:
            if not served:  # (_serve forgets a request it ran and gives its buffer back itself)
                self._inflight.pop(rid, None)
                self.receive_pool.release(payload)

    def _drop_incoming(self, rid: int) -> None:
        incoming = self._incoming.pop(rid, None)
        if incoming is not None:  # its handler never started: nothing else holds the request
            self._inflight.pop(rid, None)
            self.receive_pool.release(incoming.payload())

    def _serve(self, rid: int, meta: dict[str, Any], payload: Buffer, body: memoryview) -> None:
        out = self._inflight[rid]
        try:
            try:
                reply = self._handler(meta, body)
            except Exception as exc:
                log.exception("%s: handler failed for op %r", self._transport.name, meta.get("op"))
                self._transport.send(encode_error_frame(rid, IpcRemoteError.from_exception(exc)))
                return
            if not out.cancelled:
                self._send_reply(rid, reply, out)
        except IpcChannelClosed:
            pass
        finally:
            self._inflight.pop(rid, None)
            if isinstance(payload, memoryview) and not self.receive_pool.release(payload, body):
                log.debug("%s: receive buffer of op %r not reused", self._transport.name, meta.get("op"))

    def _send_reply(self, rid: int, reply: ReplyLike, out: _OutStream) -> None:
        length = body_length(reply.body)
        meta = {
            "status": reply.status,
            "content_type": reply.content_type,
            "headers": [list(h) for h in reply.headers],
            "length": length,
        }
        layout = getattr(reply, "file_layout", None)
        if layout is not None:
            meta["file_layout"] = layout
        if length <= INLINE_BODY_MAX:
            try:
                frame = encode_envelope_frame(rid, FrameType.REPLY, meta, reply.body)
            except FrameTooLarge as exc:
                self._transport.send(encode_error_frame(rid, IpcRemoteError.from_exception(exc)))
                return
            self._transport.send(frame)
            return
        if length > MAX_FRAME_BYTES:
            self._transport.send(encode_error_frame(rid, IpcRemoteError.from_exception(FrameTooLarge(length))))
            return
        self._transport.send(encode_envelope_frame(rid, FrameType.REPLY, {**meta, "streamed": True}))
        for chunk in split_body(reply.body):
            while out.inflight >= STREAM_WINDOW and not out.cancelled:
                out.changed.clear()
                if not out.changed.wait(STREAM_CREDIT_TIMEOUT):
                    log.warning("%s: stream %d got no credit for %s s", self._transport.name, rid,
                                STREAM_CREDIT_TIMEOUT)
                    self._transport.send(encode_error_frame(
                        rid, IpcRemoteError("StreamStalled", f"no credit for {STREAM_CREDIT_TIMEOUT} s")))
                    return
            if out.cancelled:
                return
            out.inflight += len(chunk)
            self._transport.send(encode_frame(rid, FrameType.BODY, [chunk]), bulk=True)

    def _on_close(self, exc: IpcChannelClosed) -> None:
        if self._handoff is not None:
            if self._handoff_reader is not None and self._handoff_reader is not gevent.getcurrent():
                self._handoff_reader.kill(block=True, timeout=1.0)
            self._handoff.close()
        incoming, self._incoming = self._incoming, {}
        for body in incoming.values():
            self.receive_pool.release(body.payload())
        for out in self._inflight.values():
            out.cancelled = True
            out.changed.set()
        self._stopped.set()
