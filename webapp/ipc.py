"""Sans-I/O codec for the router <-> worker IPC: frames, envelopes, errors.

Nothing here touches a socket; :mod:`webapp.ipc_channel` drives it over a socketpair with
gevent. ``docs/ipc.md`` is the normative description of the wire format.

Frame (one per message)::

    "SK" magic | u8 version | u64 BE total_length | u64 BE request_id | u8 type | payload

``total_length`` counts the whole frame, header included (so it is always >= 20). Every frame
carries :data:`MAGIC` and :data:`IPC_VERSION`, checked before anything else: a peer speaking
another version (a router and workers from different installs) is :class:`IpcVersionMismatch`,
anything else is :class:`IpcProtocolError`; neither is ever read as a length.

Envelope (payload of REQUEST and REPLY)::

    u64 BE meta_len | compact JSON meta (meta_len bytes) | raw body

A reply body larger than :data:`INLINE_BODY_MAX` does not travel in its REPLY frame: the
REPLY carries ``"streamed": true`` and ``"length"``, and the body follows as BODY frames of
at most :data:`MAX_BODY_CHUNK` bytes, paced by the receiver's CREDIT frames. That keeps a
multi-GiB records reply from holding the channel: small frames interleave between chunks.

Exception tree (a branch of :class:`webapp.errors.WebappError`; ``status`` in brackets)::

    IpcError                    base of everything raised by the IPC layer
    ├── IpcChannelClosed        the channel is down (EOF, I/O error, corrupt frame, closed
    │                           locally); every pending and every later request fails with it
    ├── IpcProtocolError        the peer sent a malformed frame or envelope (tears the channel
    │   │                       down; wrapped as the ``__cause__`` of IpcChannelClosed)
    │   └── IpcVersionMismatch  the peer's frames carry another IPC_VERSION
    ├── FrameTooLarge           a message over MAX_FRAME_BYTES, refused at send time: fails that
    │                           request only, the channel stays up
    ├── IpcTimeout              a deadline passed (also a TimeoutError); the channel stays up
    └── IpcRemoteError          the peer answered with an ERROR frame (its handler failed);
                                ``remote_type`` names the peer's exception class

A large REQUEST payload is received into a buffer lent by a :class:`ReceiveBufferPool`:
memory that is already mapped and faulted in receives ~2-3x faster than fresh memory, whose
page faults bound one-way throughput near 1 GiB/s here.
"""

from __future__ import annotations

import enum
import json
import mmap
import struct
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from webapp.errors import WebappError

__all__ = [
    "CREDIT",
    "FRAME_HEADER",
    "INLINE_BODY_MAX",
    "IPC_VERSION",
    "MAGIC",
    "MAX_BODY_CHUNK",
    "MAX_FRAME_BYTES",
    "RECEIVE_POOL_IDLE_SECONDS",
    "RECEIVE_POOL_MAX_BYTES",
    "WORKER_BOOT_ERROR",
    "WORKER_BUSY",
    "Buffer",
    "Frame",
    "FrameDecoder",
    "FrameTooLarge",
    "FrameType",
    "IpcChannelClosed",
    "IpcError",
    "IpcProtocolError",
    "IpcRemoteError",
    "IpcTimeout",
    "IpcVersionMismatch",
    "Op",
    "ReceiveBufferPool",
    "body_length",
    "decode_credit",
    "decode_envelope",
    "decode_error",
    "encode_credit",
    "encode_envelope_frame",
    "encode_error_frame",
    "encode_frame",
    "iter_frames",
    "pack_header",
    "split_body",
]

Buffer = bytes | bytearray | memoryview

MAGIC = b"SK"
# Bump on any change to the frame layout, the envelope or the ops' meta (docs/ipc.md).
IPC_VERSION = 1
FRAME_HEADER = struct.Struct(">2sBQQB")  # magic, version, total_length, request_id, type
_U64 = struct.Struct(">Q")
CREDIT = _U64

# A sanity cap, not a tuning knob: one session's records reply was measured at ~3.15 GiB
# upstream, so a u32 length is too small; anything near 64 GiB is a bug or a corrupt length.
MAX_FRAME_BYTES = 64 * 1024**3
# Streamed reply bodies are cut into chunks this big. Small enough that a chat reply waits for
# at most one chunk on the wire (~0.5 ms at 2 GiB/s), big enough that per-frame overhead is noise.
MAX_BODY_CHUNK = 1024 * 1024
# Reply bodies up to this size travel inside their REPLY frame.
INLINE_BODY_MAX = MAX_BODY_CHUNK
# Headers and small frames pass through the receiver's reusable staging buffer (many per
# read). A BODY payload is received as ``bytes`` pieces straight from the socket (what the HTTP
# side writes, with no copy); other large payloads into a buffer of exactly their size.
_STAGE_BYTES = 256 * 1024
# Idle receive buffers a pool keeps warm for the next large payloads. Chat bodies are at most
# 256 MiB (the router's limit), so this holds several of them at once; a payload too big for
# it gets a buffer of its own, freed when its request ends.
RECEIVE_POOL_MAX_BYTES = 2 * 1024**3
# An idle pooled buffer is unmapped after this long, so a burst of large bodies does not pin
# memory in an idle worker.
RECEIVE_POOL_IDLE_SECONDS = 30.0
# Pooled buffers come in size classes (multiples of this, or of 1/8 of the size's power of
# two, whichever is larger) so a body a little bigger than the last one still fits its
# buffer. Mapped lazily: the rounding costs address space, not memory.
_POOL_GRAIN = 1024 * 1024


class FrameType(enum.IntEnum):
    REQUEST = 1  # router -> worker: envelope(meta with "op", body)
    REPLY = 2  # worker -> router: envelope(meta with status/content_type/headers/length, body)
    ERROR = 3  # worker -> router: JSON {"type", "message"}; the request failed in the worker
    BODY = 4  # worker -> router: one chunk of a streamed reply body
    CREDIT = 5  # router -> worker: u64 bytes of a streamed body consumed (flow control)
    CANCEL = 6  # router -> worker: the caller gave up; stop streaming, drop the reply


class Op(str, enum.Enum):
    """The ops of a REQUEST (``meta["op"]``); the worker's answers: docs/ipc.md.

    A ``str`` mixin rather than ``enum.StrEnum`` (3.11+): Python 3.10 is supported.
    """

    def __str__(self) -> str:  # the wire name, as StrEnum's str() would give
        return str(self.value)

    PING = "ping"  # heartbeat, answered without touching the core; ``config: true``: echo it
    HEALTH = "health"
    CREATE_SESSION = "create_session"
    GET_SESSION = "get_session"
    DELETE_SESSION = "delete_session"
    CHAT = "chat"  # body: the client's request; ``budget``: seconds the turn may take
    MESSAGES = "messages"  # as chat, the request and reply in Anthropic's Messages API
    SAMPLES = "samples"  # body: the client's ``{"max_seq_len": ...}``
    PROXY = "proxy"  # ``method``, ``path``, ``query``, ``headers``; body: the client's
    # The viewer's reads (webapp.viewer_data): every shard's summaries (``prefix``: of the id;
    # no session_id, the router asks every worker), one session's summary, its timeline, an image.
    VIEWER_SESSIONS = "viewer_sessions"
    VIEWER_SUMMARY = "viewer_summary"
    VIEWER_TIMELINE = "viewer_timeline"
    VIEWER_IMAGE = "viewer_image"  # ``sha256``


# ``remote_type`` of the ERROR a worker answers at once when it runs too many requests.
WORKER_BUSY = "WorkerBusy"
# ``remote_type`` of the ERROR a worker that could not boot answers every request with; it
# then exits with webapp.worker.EXIT_BOOT_ERROR.
WORKER_BOOT_ERROR = "WorkerBootError"

# The largest payload each frame type may announce; checked before allocating.
_MAX_PAYLOAD = {
    FrameType.REQUEST: MAX_FRAME_BYTES - FRAME_HEADER.size,
    FrameType.REPLY: MAX_FRAME_BYTES - FRAME_HEADER.size,
    FrameType.ERROR: 1024 * 1024,
    FrameType.BODY: MAX_BODY_CHUNK,
    FrameType.CREDIT: CREDIT.size,
    FrameType.CANCEL: 0,
}


class IpcError(WebappError):
    """Base class of IPC errors."""

    status = 502


class IpcChannelClosed(IpcError):
    """The channel is down; ``reason`` says why (the original error is ``__cause__``)."""

    status = 503

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class IpcProtocolError(IpcError):
    """The peer broke the framing rules (bad magic, corrupt length, unknown type, bad envelope)."""


class IpcVersionMismatch(IpcProtocolError):
    """The peer's frames carry IPC version ``peer`` where this side speaks ``ours``."""

    def __init__(self, peer: int, ours: int = IPC_VERSION) -> None:
        super().__init__(f"IPC version mismatch: the peer speaks version {peer}, this side {ours} "
                         "(router and workers from different installs?)")
        self.peer = peer
        self.ours = ours


class FrameTooLarge(IpcError):
    """A message of ``size`` bytes exceeds ``limit``; refused before anything was sent."""

    status = 413

    def __init__(self, size: int, limit: int = MAX_FRAME_BYTES) -> None:
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit")
        self.size = size
        self.limit = limit


class IpcTimeout(IpcError, TimeoutError):
    """A request or body chunk did not arrive before its deadline."""

    status = 504


class IpcRemoteError(IpcError):
    """The peer failed the request; ``remote_type`` is the class name it reported."""

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.message = message

    @property
    def worker_busy(self) -> bool:
        """The worker refused the request unrun (over its in-flight limit): safe to retry."""
        return self.remote_type == WORKER_BUSY

    @property
    def status(self) -> int:  # type: ignore[override]
        return 503 if self.worker_busy else 500

    def to_payload(self) -> bytes:
        return json.dumps({"type": self.remote_type, "message": self.message}).encode()

    @classmethod
    def from_exception(cls, exc: BaseException) -> IpcRemoteError:
        return cls(type(exc).__name__, str(exc))


@dataclass(frozen=True)
class Frame:
    request_id: int
    type: FrameType
    payload: Buffer


def body_length(body: Buffer | Sequence[Buffer]) -> int:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return memoryview(body).nbytes
    return sum(memoryview(chunk).nbytes for chunk in body)


def _as_chunks(body: Buffer | Sequence[Buffer]) -> list[Buffer]:
    if isinstance(body, (bytes, bytearray, memoryview)):
        return [body] if len(body) else []
    return [chunk for chunk in body if len(chunk)]


def encode_frame(request_id: int, ftype: FrameType, payload: Sequence[Buffer] = ()) -> list[Buffer]:
    """The buffers of one frame, ready for a scatter send (the payload is not copied).

    Raises:
        FrameTooLarge: the frame would exceed MAX_FRAME_BYTES.
    """
    total = FRAME_HEADER.size + body_length(payload)
    if total > MAX_FRAME_BYTES:
        raise FrameTooLarge(total)
    return [pack_header(total, request_id, ftype), *payload]


def pack_header(total: int, request_id: int, ftype: int, version: int = IPC_VERSION, magic: bytes = MAGIC) -> bytes:
    """The header of a frame of ``total`` bytes (tests pass another ``version`` or ``magic``)."""
    return FRAME_HEADER.pack(magic, version, total, request_id, ftype)


def encode_envelope_frame(
    request_id: int, ftype: FrameType, meta: dict[str, Any], body: Buffer | Sequence[Buffer] = b""
) -> list[Buffer]:
    """A REQUEST or REPLY frame: ``u64 meta_len | compact JSON meta | body``."""
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    return encode_frame(request_id, ftype, [_U64.pack(len(meta_bytes)) + meta_bytes, *_as_chunks(body)])


def decode_envelope(payload: Buffer) -> tuple[dict[str, Any], memoryview]:
    """Split an envelope into its meta dict and a zero-copy view of its body.

    Raises:
        IpcProtocolError: the envelope is truncated or its meta is not a JSON object.
    """
    view = memoryview(payload)
    if len(view) < _U64.size:
        raise IpcProtocolError(f"envelope of {len(view)} bytes is shorter than its meta length")
    (meta_len,) = _U64.unpack_from(view)
    end = _U64.size + meta_len
    if end > len(view):
        raise IpcProtocolError(f"meta length {meta_len} overruns the {len(view)}-byte envelope")
    try:
        meta = json.loads(bytes(view[_U64.size : end]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise IpcProtocolError(f"envelope meta is not JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise IpcProtocolError("envelope meta is not a JSON object")
    return meta, view[end:]


def encode_error_frame(request_id: int, error: IpcRemoteError) -> list[Buffer]:
    return encode_frame(request_id, FrameType.ERROR, [error.to_payload()])


def decode_error(payload: Buffer) -> IpcRemoteError:
    try:
        data = json.loads(bytes(payload))
        return IpcRemoteError(str(data["type"]), str(data["message"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise IpcProtocolError(f"malformed ERROR payload: {exc}") from exc


def encode_credit(request_id: int, nbytes: int) -> list[Buffer]:
    return encode_frame(request_id, FrameType.CREDIT, [CREDIT.pack(nbytes)])


def decode_credit(payload: Buffer) -> int:
    nbytes: int = CREDIT.unpack(bytes(payload))[0]  # struct gives Any; CREDIT packs one integer
    return nbytes


def split_body(body: Buffer | Sequence[Buffer], max_chunk: int = MAX_BODY_CHUNK) -> Iterator[memoryview]:
    """Views of at most ``max_chunk`` bytes over ``body``, in order, without copying."""
    for chunk in _as_chunks(body):
        view = memoryview(chunk).cast("B")
        for start in range(0, len(view), max_chunk):
            yield view[start : start + max_chunk]


class FrameDecoder:
    """Incremental frame decoder shaped for ``recv_into``.

    Call :meth:`buffer` for the region to receive into, then :meth:`advance` with the
    number of bytes received; it returns the frames completed so far. Headers and small
    frames go through one staging buffer (many per ``recv_into``); a large payload is
    received straight into a buffer from ``allocate(size)`` (at least ``size`` bytes: a
    :meth:`ReceiveBufferPool.acquire` fits), asked for only after its length passed the
    per-type limit, and handed out as a ``memoryview`` of exactly the payload.

    BODY payloads are opaque runs of bytes, so the decoder may deliver one BODY frame as
    several consecutive ``Frame`` pieces (same request id, in order): while
    :meth:`piece_wanted` is non-zero, receive up to that many bytes as a ``bytes`` object
    (``sock.recv``) and pass it to :meth:`piece_received` — the kernel writes straight into the
    object that is later written to the HTTP client — or receive it into a view of where its
    consumer keeps it (``recv_into``) and pass that view.

    Raises:
        IpcProtocolError: from :meth:`advance`, on a corrupt length or an unknown type. The
            decoder is unusable afterwards; the channel must be torn down.
    """

    def __init__(self, stage_bytes: int = _STAGE_BYTES, allocate: Callable[[int], Any] = bytearray) -> None:
        self._allocate = allocate  # tests pass a lazily-mapped buffer to walk the > 4 GiB path
        self._stage = bytearray(stage_bytes)
        self._stage_view = memoryview(self._stage)
        self._start = 0  # unconsumed staged bytes are _stage[_start:_end]
        self._end = 0
        self._pending: tuple[int, FrameType] | None = None  # header of the large payload in flight
        self._payload: Any = None  # what `allocate` returned, at least _payload_len bytes
        self._payload_len = 0
        self._filled = 0
        self._piece_id = 0  # request id of the BODY payload being received as pieces
        self._piece_left = 0

    def piece_wanted(self) -> int:
        """Bytes of the current BODY payload still to receive with :meth:`piece_received`."""
        return self._piece_left

    @property
    def piece_request_id(self) -> int:
        """Request id of the BODY payload :meth:`piece_wanted` asks for."""
        return self._piece_id

    def piece_received(self, piece: Buffer) -> list[Frame]:
        if not 0 < len(piece) <= self._piece_left:
            raise ValueError(f"piece of {len(piece)} bytes, {self._piece_left} wanted")
        self._piece_left -= len(piece)
        return [Frame(self._piece_id, FrameType.BODY, piece)]

    def buffer(self) -> memoryview:
        if self._payload is not None:
            return memoryview(self._payload)[self._filled : self._payload_len]
        if self._end == len(self._stage):
            self._compact()
        return self._stage_view[self._end :]

    def advance(self, nbytes: int) -> list[Frame]:
        if self._payload is not None:
            self._filled += nbytes
            if self._filled < self._payload_len:
                return []
            assert self._pending is not None
            frame = Frame(self._pending[0], self._pending[1], memoryview(self._payload)[: self._payload_len])
            self._payload = self._pending = None
            return [frame]
        self._end += nbytes
        return self._parse_staged()

    def _compact(self) -> None:
        live = self._end - self._start
        self._stage_view[:live] = self._stage_view[self._start : self._end]
        self._start, self._end = 0, live

    def _parse_staged(self) -> list[Frame]:
        frames = []
        while self._end - self._start >= FRAME_HEADER.size:
            magic, version, total, request_id, raw_type = FRAME_HEADER.unpack_from(self._stage, self._start)
            ftype = _check_header(magic, version, total, raw_type)
            payload_len = total - FRAME_HEADER.size
            body_start = self._start + FRAME_HEADER.size
            available = self._end - body_start
            if available >= payload_len:
                payload = bytes(self._stage_view[body_start : body_start + payload_len])
                frames.append(Frame(request_id, ftype, payload))
                self._start = body_start + payload_len
            elif ftype is FrameType.BODY:
                if available:
                    frames.append(Frame(request_id, ftype, bytes(self._stage_view[body_start : self._end])))
                self._piece_id, self._piece_left = request_id, payload_len - available
                self._start = self._end = 0
                return frames
            elif total <= len(self._stage):
                break  # fits the stage: wait for the rest
            else:
                self._payload = self._allocate(payload_len)
                self._payload_len = payload_len
                self._payload[:available] = self._stage_view[body_start : self._end]
                self._filled = available
                self._pending = (request_id, ftype)
                self._start = self._end = 0
                return frames
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and self._end - self._start < FRAME_HEADER.size:
            self._compact()
        return frames


class ReceiveBufferPool:
    """Reusable receive buffers for large payloads, lent to one request at a time.

    :meth:`acquire` lends the smallest idle buffer that fits (or grows the largest idle one, or
    maps a new one);
    :meth:`release` takes it back once the request is over. A buffer is reused only when no
    view of it is left alive: :meth:`release` first releases the views it is given, then keeps
    the buffer only if nothing else still exports it (a handler that kept a slice of its body
    makes the pool drop that buffer, never overwrite it). Idle buffers are bounded by
    ``max_bytes`` (smallest evicted first) and unmapped after ``idle_seconds``. Buffers that
    are lent out are not counted: they are bounded by the requests in flight.

    Not thread-safe; within one gevent hub nothing here yields.
    """

    def __init__(
        self,
        max_bytes: int = RECEIVE_POOL_MAX_BYTES,
        idle_seconds: float = RECEIVE_POOL_IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self._clock = clock
        self._idle: list[tuple[mmap.mmap, float]] = []  # (buffer, released at), sorted by size
        self._lent: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()

    @property
    def idle_bytes(self) -> int:
        return sum(len(buffer) for buffer, _ in self._idle)

    @property
    def lent(self) -> int:
        return len(self._lent)

    def acquire(self, size: int) -> mmap.mmap:
        """A buffer of at least ``size`` bytes, for this caller alone until :meth:`release`."""
        self.trim()
        rounded = _size_class(size)
        length = rounded if rounded <= self.max_bytes else size
        for i, (buffer, _) in enumerate(self._idle):
            if len(buffer) >= size:
                del self._idle[i]
                break
        else:
            # Private: a shared anonymous mapping cannot grow (its pages past the first size fault).
            buffer = (self._grown(length) if length <= self.max_bytes else None) or mmap.mmap(
                -1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._lent.add(buffer)
        return buffer

    def _grown(self, length: int) -> mmap.mmap | None:
        """The largest idle buffer (all are smaller than needed) grown to ``length`` bytes, or
        None. An agent's body grows a little every turn (its history resent): growing keeps
        the pages the last bodies already touched (``mremap``), so only the new tail is
        mapped and faulted in, not the whole body again."""
        if not self._idle:
            return None
        buffer = self._idle.pop()[0]
        try:
            buffer.resize(length)
        except (OSError, SystemError, ValueError):  # no mremap here (not Linux): a new one
            buffer.close()
            return None
        return buffer

    def release(self, payload: Buffer, *views: memoryview) -> bool:
        """Take back the buffer behind ``payload`` (a view from the decoder), releasing
        ``payload`` and ``views`` first. Returns True if the buffer will be reused.

        A payload that is not a view of a buffer lent by this pool is left alone.
        """
        buffer = payload.obj if isinstance(payload, memoryview) else payload
        if buffer not in self._lent:
            return False
        assert isinstance(buffer, mmap.mmap)  # only mmaps are lent
        self._lent.discard(buffer)
        try:
            for view in (payload, *views):
                if isinstance(view, memoryview):
                    view.release()
            buffer.resize(len(buffer))  # BufferError while any view of it is still alive
        except BufferError:
            return False  # someone can still see it: let it die with its last view
        if len(buffer) > self.max_bytes:
            buffer.close()
            return False
        self._idle.append((buffer, self._clock()))
        self._idle.sort(key=lambda item: len(item[0]))
        while self.idle_bytes > self.max_bytes:
            self._idle.pop(0)[0].close()
        self.trim()
        return not buffer.closed

    def trim(self) -> None:
        """Unmap the buffers idle for longer than ``idle_seconds``."""
        deadline = self._clock() - self.idle_seconds
        for buffer, released_at in self._idle:
            if released_at < deadline:
                buffer.close()
        self._idle = [item for item in self._idle if not item[0].closed]


def _size_class(size: int) -> int:
    step = max(_POOL_GRAIN, 1 << max(size.bit_length() - 4, 0))
    return -(-size // step) * step


def _check_header(magic: bytes, version: int, total: int, raw_type: int) -> FrameType:
    if magic != MAGIC:
        raise IpcProtocolError(f"not a Shinken IPC frame (magic {magic!r}, expected {MAGIC!r})")
    if version != IPC_VERSION:
        raise IpcVersionMismatch(version)
    try:
        ftype = FrameType(raw_type)
    except ValueError:
        raise IpcProtocolError(f"unknown frame type {raw_type}") from None
    if total < FRAME_HEADER.size:
        raise IpcProtocolError(f"corrupt frame length {total} (below the {FRAME_HEADER.size}-byte header)")
    if total - FRAME_HEADER.size > _MAX_PAYLOAD[ftype]:
        raise IpcProtocolError(
            f"corrupt frame length {total} for {ftype.name} (limit {_MAX_PAYLOAD[ftype] + FRAME_HEADER.size})"
        )
    return ftype


def iter_frames(decoder: FrameDecoder, data: Iterable[bytes]) -> Iterator[Frame]:
    """Feed byte strings through ``decoder`` (tests and tools; the channel uses recv_into)."""
    for block in data:
        view = memoryview(block)
        while view:
            wanted = decoder.piece_wanted()
            if wanted:
                yield from decoder.piece_received(bytes(view[:wanted]))
                view = view[wanted:]
                continue
            target = decoder.buffer()
            n = min(len(target), len(view))
            target[:n] = view[:n]
            view = view[n:]
            yield from decoder.advance(n)
