"""Response bodies made of in-memory pieces and ranges of files, sent with ``sendfile``.

A records GET is a few small JSON pieces around the records, which stay in their session's
journal (``webapp.journal``): the body is a list of *pieces*, each ``bytes`` or a
:class:`FileSpan`. This module is the one place that

- measures and slices such a body (``Range: bytes=a-b``, answered 206),
- carries it across the router/worker channel without the file bytes (:func:`encode_layout`
  on the worker, :func:`decode_layout` on the router: only the inline pieces and the spans'
  offsets travel; the router reads the same file the worker wrote, same host),
- and writes it to the client: file spans go with ``os.sendfile`` straight from the page cache
  to the client's socket (gunicorn's ``environ["gunicorn.socket"]``), everything else is
  yielded to the WSGI server as usual. Without a raw socket (another WSGI server, TLS) the
  spans are read with ``pread`` in :data:`READ_CHUNK` pieces instead.

Why write around the WSGI server: a body here is many file ranges between JSON glue, and
``wsgi.file_wrapper`` sends one whole file. The WSGI server has sent the status line and
headers by the time the first inline piece (a records GET always starts with one) is written,
so the spans that follow go on the socket in order; gunicorn only counts the bytes for its
access log. Under gevent a span goes out from a thread of a pool (``webapp.offload``)
that makes the socket blocking for it: one ``sendfile`` moves up to a GiB without the GIL,
while the process's other greenlets (chats) run; a loop of non-blocking ``sendfile`` calls in
the hub moved one socket buffer per turn of the hub and fell to a third of the floor under 64
chatting clients (docs/benchmarks.md section 15). The pieces written from memory go the same
way in batches (:func:`_send_batch`): a batch's reads, base64 (a record's packed R3) and
``writev`` run in a thread of the pool, not in the hub that runs the chats (section 39). A
client that stops reading gives its thread back within :data:`_SEND_SLICE` and waits in the
hub (:func:`_sendfile_gevent`, :func:`_send_batch`), so stalled clients never hold the pool.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import pybase64
from werkzeug.http import parse_range_header, unquote_etag
from werkzeug.wrappers import Response

from webapp import iovec
from webapp.offload import gevent_active, run_blocking
from webapp.send_pace import Paced, Pacer, paced

__all__ = [
    "READ_CHUNK",
    "B64Span",
    "FileSpan",
    "Piece",
    "body_length",
    "decode_layout",
    "encode_layout",
    "file_response",
    "has_spans",
    "read_pieces",
    "slice_pieces",
    "span_bytes",
]

READ_CHUNK = 1 << 20  # pread size of the fallback path (no raw socket)
_B64_CHUNK = 3 << 20  # packed bytes read per piece of a B64Span (a multiple of 3: the texts join)
_BATCH = 2 << 20  # small pieces are gathered into writes of about this size
# Parts handed to a send thread at once (their reads and base64 made there, _BATCH at a time):
# each hand-off waits for a turn of the hub, which under chats cost the GET half its speed.
_HANDOFF = 32 << 20
_WHOLE_MAX = 8 << 20  # a journal up to this size may be read whole for a GET (see _FileBody)
_SENDFILE_MIN = 256 << 10  # a file span this long goes by sendfile; shorter ones join the batch
_STALL_TIMEOUT = 120.0  # a client that takes no byte of a body for this long is dropped
_TIMEVAL = struct.Struct("@ll")
_SENDFILE_MAX = 1 << 30  # bytes asked of one sendfile call; it sends what the socket takes
# A send thread waits this long on a full socket, then hands the wait to the hub: short enough
# that stalled clients free the lane's threads at once, long enough that a reading client's
# momentary pause (a loaded host) costs no trip through the hub.
_SEND_SLICE = 0.2
_SLICE_TIMEVAL = _TIMEVAL.pack(0, int(_SEND_SLICE * 1e6))


@dataclass(frozen=True)
class FileSpan:
    """``length`` bytes of the file at ``path`` from ``offset``; immutable once written (the
    journal only appends, so a span stays valid until the file is deleted)."""

    path: str
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length

    def read(self, start: int = 0, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the span (end: its length)."""
        return _read_span(self, start, end)


@dataclass(frozen=True)
class B64Span:
    """The base64 text (standard alphabet, padded) of ``length`` bytes of the file at ``path``
    from ``offset``: a replay payload the journal keeps packed and serves as the engine sent it.
    Texts of consecutive pieces concatenate only when each but the last is a multiple of 3
    bytes long (``webapp.records.Rows`` keeps them so)."""

    path: str
    offset: int
    length: int  # packed bytes

    def __len__(self) -> int:
        return 4 * ((self.length + 2) // 3)

    def read(self, start: int = 0, end: int | None = None) -> bytes:
        """Characters ``[start, end)`` of the span's text (end: its length)."""
        return _read_span(self, start, end)


Piece = bytes | memoryview | FileSpan | B64Span  # a memoryview: a slice of bytes shared by several pieces
_SPANS = (FileSpan, B64Span)


def has_spans(pieces: Iterable[Any]) -> bool:
    return any(isinstance(p, _SPANS) for p in pieces)


def body_length(pieces: Iterable[Piece]) -> int:
    return sum(len(p) for p in pieces)


def slice_pieces(pieces: Sequence[Piece], start: int, stop: int) -> list[Piece]:
    """Bytes ``[start, stop)`` of the body, as pieces (spans narrowed, bytes sliced)."""
    out: list[Piece] = []
    pos = 0
    for piece in pieces:
        size = len(piece)
        lo, hi = max(start - pos, 0), min(stop - pos, size)
        if lo < hi:
            if isinstance(piece, FileSpan):
                out.append(FileSpan(piece.path, piece.offset + lo, hi - lo))
            elif isinstance(piece, B64Span):
                if lo == 0 and hi == size:
                    out.append(piece)
                else:  # a range inside the text: its quanta encoded now (a Range request only)
                    out.append(piece.read(lo, hi))
            else:
                out.append(piece[lo:hi])
        pos += size
        if pos >= stop:
            break
    return out


def read_pieces(pieces: Iterable[Piece], open_fds: Mapping[str, int] | None = None) -> bytes:
    """The whole body in memory (small bodies, a commit's base fields, tests).

    Each file is opened once for all its spans: a field of a session's record is one span per
    turn that changed it, so opening per span cost a turn two syscalls per earlier turn.
    ``open_fds``: files the caller has open (readable), by path: read through those, not opened.
    """
    fds: dict[str, int] = {}
    out: list[bytes | memoryview] = []
    try:
        for piece in pieces:
            if isinstance(piece, _SPANS):
                fd = open_fds.get(piece.path) if open_fds is not None else None
                if fd is None:
                    fd = fds.get(piece.path)
                if fd is None:
                    fd = fds[piece.path] = _open_span_file(piece.path)
                out.append(span_bytes(fd, piece))
            else:
                out.append(piece)
    finally:
        for fd in fds.values():
            os.close(fd)
    return b"".join(out)


def span_bytes(fd: int, span: FileSpan | B64Span, start: int = 0, end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` of ``span`` (end: its length) read from ``fd``, its file opened
    by the caller: a :class:`FileSpan`'s bytes, a :class:`B64Span`'s base64 text (only the
    quanta the range falls in are read and encoded). The one reader of spans."""
    end = len(span) if end is None else end
    if isinstance(span, B64Span):
        return _b64_slice(fd, span, start, end)
    return _pread_all(fd, end - start, span.offset + start)


def _open_span_file(path: str) -> int:
    # A journal is a regular file of ours: a link in its place is not followed.
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)


def _read_span(span: FileSpan | B64Span, start: int, end: int | None) -> bytes:
    fd = _open_span_file(span.path)
    try:
        return span_bytes(fd, span, start, end)
    finally:
        os.close(fd)


# -- across the router/worker channel ------------------------------------------------------------

def encode_layout(pieces: Sequence[Piece]) -> tuple[bytes, dict[str, Any]]:
    """``pieces`` -> (the inline bytes joined, the layout): ``{"path": str, "pieces": [n |
    [offset, length] | [offset, length, 1]]}``, where ``n`` is the next ``n`` inline bytes, a
    pair a span of ``path`` and a triple a :class:`B64Span` of it. One file per body (a
    session's journal)."""
    paths = {p.path for p in pieces if isinstance(p, _SPANS)}
    if len(paths) != 1:
        raise ValueError(f"a file body names exactly one file, got {sorted(paths)}")
    layout: list[Any] = []
    inline: list[bytes | memoryview] = []
    for piece in pieces:
        if isinstance(piece, FileSpan):
            layout.append([piece.offset, piece.length])
        elif isinstance(piece, B64Span):
            layout.append([piece.offset, piece.length, 1])
        else:
            layout.append(len(piece))
            inline.append(piece)
    return b"".join(inline), {"path": paths.pop(), "pieces": layout}


def decode_layout(inline: bytes, layout: Mapping[str, Any]) -> list[Piece]:
    """The inverse of :func:`encode_layout`; raises ``TypeError``/``ValueError`` on a malformed layout."""
    path = layout.get("path")
    entries = layout.get("pieces")
    if not isinstance(path, str) or not isinstance(entries, list):
        raise TypeError(f"malformed file layout {layout!r}")
    pieces: list[Piece] = []
    view = memoryview(inline)  # inline pieces are slices of it, not copies (a GET's ids text is most of it)
    pos = 0
    for entry in entries:  # a records GET's layout is tens of thousands of entries: checks inline
        kind = type(entry)
        if kind is int:
            if entry >= 0:
                pieces.append(view[pos:pos + entry])
                pos += entry
                continue
        elif kind is list:
            n = len(entry)
            if n == 2:
                offset, length = entry
                if type(offset) is int and type(length) is int and offset >= 0 and length >= 0:
                    pieces.append(FileSpan(path, offset, length))
                    continue
            elif n == 3:
                offset, length, flag = entry
                if (type(offset) is int and type(length) is int and type(flag) is int and flag == 1
                        and offset >= 0 and length >= 0):
                    pieces.append(B64Span(path, offset, length))
                    continue
        raise ValueError(f"malformed file layout entry {entry!r}")
    if pos != len(inline):
        raise ValueError(f"file layout names {pos} inline bytes, the body has {len(inline)}")
    return pieces


# -- to the client -------------------------------------------------------------------------------

def file_response(pieces: Sequence[Piece], *, status: int, content_type: str,
                  headers: Iterable[tuple[str, str]], environ: Mapping[str, Any]) -> Response:
    """A response for a body of pieces: ``Range`` (one range; ``If-Range`` against the ETag)
    answered 206/416, HEAD without a body, spans sent by ``sendfile`` where the server allows.

    Raises ``FileNotFoundError`` if the file is gone (its session deleted meanwhile), before
    anything is sent."""
    headers = list(headers)
    length = body_length(pieces)
    etag = next((v for k, v in headers if k.lower() == "etag"), None)
    response = Response(status=status, headers=headers, content_type=content_type or None)
    response.headers["Accept-Ranges"] = "bytes"
    wanted = _wanted_range(environ, etag) if status == 200 else None
    if wanted is not None:  # one byte range; other units and multi-range requests get 200 (RFC 9110 14.2)
        span = wanted.range_for_length(length)
        if span is None:
            response.status_code = 416
            response.headers["Content-Range"] = f"bytes */{length}"
            response.headers["Content-Length"] = "0"
            return response
        start, stop = span
        pieces = slice_pieces(pieces, start, stop)
        response.status_code = 206
        response.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{length}"
        length = stop - start
    body = _FileBody(pieces, _raw_socket(environ), paced(environ))
    response.response = body
    response.direct_passthrough = True
    response.headers["Content-Length"] = str(length)
    response.call_on_close(body.close)
    return response


def _wanted_range(environ: Mapping[str, Any], etag: str | None) -> Any:
    header = environ.get("HTTP_RANGE")
    if not header:
        return None
    if_range = environ.get("HTTP_IF_RANGE")
    if if_range and (etag is None or unquote_etag(if_range)[0] != unquote_etag(etag)[0]):
        return None  # the body changed since the client's copy: the whole body, 200
    wanted = parse_range_header(header)
    if wanted is None or wanted.units != "bytes" or len(wanted.ranges) != 1:
        return None  # unparsable, another unit, or several ranges: ignored, the whole body
    return wanted


def _raw_socket(environ: Mapping[str, Any]) -> Any:
    sock = environ.get("gunicorn.socket")
    if sock is None or isinstance(sock, ssl.SSLSocket) or environ.get("wsgi.url_scheme") == "https":
        return None
    return sock


class _FileBody:
    """The WSGI iterable: opens the file at construction (a missing file fails before any
    header is sent), yields inline pieces, sends spans with ``sendfile`` (or yields them)."""

    def __init__(self, pieces: Sequence[Piece], sock: Any, request: Paced) -> None:
        self._pieces = pieces
        self._sock = sock
        self._request = request  # its process's pace (webapp.send_pace), while it serves others
        self._fds: dict[str, int] = {}
        try:
            for piece in pieces:
                if isinstance(piece, _SPANS) and piece.path not in self._fds:
                    self._fds[piece.path] = _open_span_file(piece.path)
        except OSError:
            self.close()
            raise
        # A small file whose spans add up to more than its size (a long text session's journal:
        # a few MiB for hundreds of turns, while its records GET is hundreds of MiB of spans) is
        # read once and its spans sliced from memory: a pread per span (one per record per
        # earlier turn) cost more than the bytes. Never more bytes read than the preads would.
        # Only the bytes this body reads count: a file span that goes by sendfile is never read.
        spanned: dict[str, int] = {}
        for piece in pieces:
            if isinstance(piece, B64Span) or (isinstance(piece, FileSpan) and not self._by_sendfile(piece)):
                spanned[piece.path] = spanned.get(piece.path, 0) + piece.length
        self._whole: dict[str, bytes] = {}
        for path, fd in self._fds.items():
            size = os.fstat(fd).st_size
            if size <= _WHOLE_MAX and spanned.get(path, 0) >= size:
                self._whole[path] = os.pread(fd, size, 0)
        self.read_whole = frozenset(self._whole)  # the files this body read whole (kept after close)
        # sendfile only after something went through the server: its headers are on the wire.
        self._headers_out = False
        self._scratch = _Scratch()

    def _by_sendfile(self, span: FileSpan) -> bool:
        """Whether ``span`` goes to the client by ``sendfile`` (long enough, a raw socket)."""
        return span.length >= _SENDFILE_MIN and self._sock is not None

    def _part(self, path: str, offset: int, length: int) -> memoryview | _Read:
        """Bytes ``[offset, offset + length)`` of ``path``: a slice of the file read whole, or
        the read to make (by whoever writes the batch: a send thread under gevent)."""
        whole = self._whole.get(path)
        if whole is not None and offset + length <= len(whole):
            return memoryview(whole)[offset:offset + length]
        return _Read(self._fds[path], offset, length)

    def __iter__(self) -> Iterator[bytes]:
        # Small pieces (inline bytes, spans under _SENDFILE_MIN, base64 spans) are gathered and
        # written in _BATCH-sized batches: a records GET is many short spans (each turn's share
        # of a record), and a send per span cost more than the bytes. Consecutive base64 spans
        # are encoded together (each but the last a whole number of quanta: the texts join).
        # A batch's reads, base64 and writes happen where _send_batch puts them: off the hub, in
        # batches of up to _HANDOFF bytes once the headers are out (made _BATCH at a time there).
        batch: list[_Part] = []
        packed: list[memoryview | _Read] = []
        size = packed_size = 0
        sock = self._sock
        self._request.body_started()
        pacer = self._request.pacer

        def limit() -> int:  # a batch for a send thread is made there, _BATCH at a time
            return _HANDOFF if sock is not None and self._headers_out else _BATCH

        def encoded() -> None:
            nonlocal packed_size
            if packed:
                batch.append(_B64Run(tuple(packed)))
                packed.clear()
            packed_size = 0

        def flush() -> Iterator[bytes]:
            nonlocal size
            encoded()
            if batch:
                if sock is not None and self._headers_out:  # straight to the socket: no joined copy
                    _send_batch(sock.fileno(), tuple(batch), self._scratch, pacer)
                else:
                    self._headers_out = True
                    yield b"".join(_materialize(batch, self._scratch))
                batch.clear()
            size = 0

        for piece in self._pieces:
            if isinstance(piece, B64Span):
                for pos in range(0, piece.length, _B64_CHUNK):
                    packed.append(self._part(piece.path, piece.offset + pos, min(_B64_CHUNK, piece.length - pos)))
                    size += min(_B64_CHUNK, piece.length - pos)
                    packed_size += min(_B64_CHUNK, piece.length - pos)
                    if packed_size >= _BATCH and (piece.length - pos <= _B64_CHUNK or (pos + _B64_CHUNK) % 3 == 0):
                        encoded()  # a whole number of quanta: its text ends here
                        if size >= limit():
                            yield from flush()
                continue
            encoded()
            if not isinstance(piece, FileSpan):
                batch.append(piece)
                size += len(piece)
            elif not (piece.length >= _SENDFILE_MIN and sock is not None):
                for pos in range(0, piece.length, READ_CHUNK):  # most spans of a long session: one part
                    batch.append(self._part(piece.path, piece.offset + pos, min(READ_CHUNK, piece.length - pos)))
                    size += min(READ_CHUNK, piece.length - pos)
                    if size >= limit():
                        yield from flush()
                continue
            else:
                yield from flush()
                if self._headers_out:
                    _sendfile(self._sock.fileno(), self._fds[piece.path], piece.offset, piece.length, pacer)
                else:  # nothing went through the server yet: its headers are not on the wire
                    self._headers_out = True
                    yield _pread_all(self._fds[piece.path], piece.length, piece.offset)
                continue
            if size >= limit():
                yield from flush()
        yield from flush()

    def close(self) -> None:
        self._whole = {}
        self._scratch = _Scratch()  # its buffer goes now, not with the response object
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


class _Read(NamedTuple):
    """``length`` bytes of the open file ``fd`` at ``offset``, to be read."""

    fd: int
    offset: int
    length: int


class _B64Run(NamedTuple):
    """Packed bytes whose base64 text is sent: parts that join (each but the last a whole
    number of quanta)."""

    parts: tuple[memoryview | _Read, ...]


_Part = bytes | memoryview | _Read | _B64Run  # one buffer of a batch, as gathered in the hub


class _Scratch:
    """The one buffer a body reads its base64 runs' packed bytes into, reused run after run.

    A fresh ``bytes`` per read (and a joined copy per run) made the send thread's malloc arena
    grow and shrink by ~11 MiB per hand-off: glibc gave the pages back (``madvise``) and the
    next hand-off faulted them in again, ~0.4 million page faults and a third of the worker's
    CPU for a 4 GiB GET (docs/benchmarks.md section 44). A body is made by one thread at a time
    (its greenlet waits for each hand-off), so one buffer per body serves every thread."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def view(self, size: int) -> memoryview:
        if len(self._buf) < size:
            self._buf = bytearray(-(-size // READ_CHUNK) * READ_CHUNK)  # whole MiBs: few regrowths
        return memoryview(self._buf)[:size]


def _make(part: _Part, scratch: _Scratch) -> bytes | memoryview:
    """A part's buffer: its read made, a base64 run read (into ``scratch``) and encoded."""
    if isinstance(part, _Read):
        return _pread_all(part.fd, part.length, part.offset)
    if isinstance(part, _B64Run):
        if len(part.parts) == 1 and isinstance(part.parts[0], memoryview):
            return pybase64.b64encode(part.parts[0])  # a slice of the file read whole: no copy
        sizes = [p.length if isinstance(p, _Read) else len(p) for p in part.parts]
        packed = scratch.view(sum(sizes))
        pos = 0
        for p, size in zip(part.parts, sizes):
            if isinstance(p, _Read):
                _preadv_all(p.fd, packed[pos:pos + size], p.offset)
            else:
                packed[pos:pos + size] = p
            pos += size
        return pybase64.b64encode(packed)
    return part


def _materialize(batch: Sequence[_Part], scratch: _Scratch) -> list[bytes | memoryview]:
    return [_make(part, scratch) for part in batch]


def _gather(parts: Sequence[_Part], i: int, have: int, scratch: _Scratch) -> tuple[list[bytes | memoryview], int]:
    """Buffers made from ``parts[i:]`` until ``have`` plus theirs reach :data:`_BATCH` bytes;
    and the index of the first part not made."""
    out: list[bytes | memoryview] = []
    while i < len(parts) and have < _BATCH:
        buf = _make(parts[i], scratch)
        out.append(buf)
        have += len(buf)
        i += 1
    return out, i


def _send_batch(sock_fd: int, batch: Sequence[_Part], scratch: _Scratch, pacer: Pacer) -> None:
    """Every byte of the batch to the client, in order, made :data:`_BATCH` bytes at a time.
    Under gevent the reads, the base64 and the ``writev`` run in a thread of the ``send`` lane
    (all three release the GIL), so the hub runs the process's chats meanwhile and the copy runs
    at the lane's CPU priority; a socket that stays full for :data:`_SEND_SLICE` is waited for
    in the hub, holding no thread. While the process serves other requests, the thread keeps
    to ``pacer``'s rate, sleeping between writes (webapp.send_pace)."""
    if not gevent_active():
        i = 0
        while i < len(batch):
            buffers, i = _gather(batch, i, 0, scratch)
            _writev_all(sock_fd, buffers)
        return
    from gevent.socket import wait_write

    left = run_blocking("send", _write_parts, sock_fd, [], batch, 0, scratch, pacer)
    while left is not None:
        wait_write(sock_fd, timeout=_STALL_TIMEOUT,
                   timeout_exc=TimeoutError(f"the client took no byte for {_STALL_TIMEOUT:.0f} s"))
        left = run_blocking("send", _write_parts, sock_fd, *left, scratch, pacer)


_Left = tuple[list[memoryview], Sequence[_Part], int]  # a send slice's unsent buffers, parts, next part


def _write_parts(sock_fd: int, views: list[memoryview], parts: Sequence[_Part], i: int,
                 scratch: _Scratch, pacer: Pacer) -> _Left | None:
    """In a thread of the ``send`` lane: ``views``, then ``parts[i:]`` made about
    :data:`_BATCH` bytes at a time, written with ``writev`` (a blocking socket) until all are
    sent (None) or the socket stays full for :data:`_SEND_SLICE` (what is left). While the
    process serves other requests the writes keep to ``pacer``'s rate, and a paced call also
    ends after about :data:`_SEND_SLICE` (what is left; the hub calls again at once).

    The buffers made here are freed here (``views`` is never added to in place: the caller's
    list would keep them for the hub to free, and a free from another thread trims this
    thread's malloc arena, whose pages the next hand-off then faults in again)."""
    until = pacer.now() + _SEND_SLICE  # paced: the thread's call ends about here (webapp.send_pace)
    with _blocking_slice(sock_fd):
        while True:
            pending = sum(len(v) for v in views)
            if pending < _BATCH and i < len(parts):
                more, i = _gather(parts, i, pending, scratch)
                views = views + [memoryview(b) for b in more if len(b)]
            if not views:
                return None
            if not pacer.pace(0, 0.0, until):  # ahead of the pace: the rest in another call
                return views, parts, i
            want = sum(len(v) for v in views[:iovec.IOV_MAX])
            started = pacer.now()
            try:
                sent = os.writev(sock_fd, views[:iovec.IOV_MAX])
            except BlockingIOError:  # full for the whole slice: the hub waits instead
                return views, parts, i
            full = sent < want  # the timeout ended the call part-way: the socket is full
            pacer.pace(sent, started, until)
            views = views[iovec.advance(views, 0, sent):]
            if full:
                return views, parts, i


def _b64_slice(fd: int, span: B64Span, start: int, end: int) -> bytes:
    """Characters ``[start, end)`` of the span's base64 text: only the quanta they fall in."""
    first, last = start // 4, (end + 3) // 4  # quanta: 3 bytes -> 4 characters
    lo, hi = first * 3, min(span.length, last * 3)
    text = pybase64.b64encode(_pread_all(fd, hi - lo, span.offset + lo))
    return text[start - first * 4:end - first * 4]


def _preadv_all(fd: int, into: memoryview, offset: int) -> None:
    """``len(into)`` bytes of ``fd`` at ``offset`` into ``into`` (short: the file shrank)."""
    got = os.preadv(fd, [into], offset)
    if got != len(into):
        raise OSError(f"short read: {got} of {len(into)} bytes at {offset}")


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:  # a journal span is committed bytes: short means the file shrank
        raise OSError(f"short read: {len(data)} of {size} bytes at {offset}")
    return data


def _writev_all(sock_fd: int, buffers: list[bytes | memoryview]) -> None:
    """Every byte of ``buffers``, in order, with ``writev`` (gathered: never joined into one
    copy first); a full socket waits in the hub under gevent (its socket is non-blocking),
    else in ``select``, at most :data:`_STALL_TIMEOUT` per wait."""
    views = iovec.views(buffers)
    first = 0  # views before this one are sent
    while first < len(views):
        try:
            sent = os.writev(sock_fd, views[first:first + iovec.IOV_MAX])
        except BlockingIOError:
            _wait_writable(sock_fd)
            continue
        first = iovec.advance(views, first, sent)


def _wait_writable(sock_fd: int) -> None:
    if gevent_active():
        from gevent.socket import wait_write

        wait_write(sock_fd, timeout=_STALL_TIMEOUT,
                   timeout_exc=TimeoutError(f"the client took no byte for {_STALL_TIMEOUT:.0f} s"))
    elif not select.select([], [sock_fd], [], _STALL_TIMEOUT)[1]:
        raise TimeoutError(f"the client took no byte for {_STALL_TIMEOUT:.0f} s")


def _sendfile(sock_fd: int, fd: int, offset: int, count: int, pacer: Pacer) -> None:
    if gevent_active():  # the socket is non-blocking, the hub must go on
        _sendfile_gevent(sock_fd, fd, offset, count, pacer)
    else:  # gunicorn's sync or threads worker: a blocking socket, or wait in select
        _sendfile_all(sock_fd, fd, offset, count, lambda: select.select([], [sock_fd], []))


def _sendfile_gevent(sock_fd: int, fd: int, offset: int, count: int, pacer: Pacer) -> None:
    """The span in slices: each in a thread of the ``send`` lane while the client takes bytes,
    and, whenever its socket stays full for :data:`_SEND_SLICE`, a wait in the hub for it to
    drain, holding no thread. So clients that never read cannot take the lane's threads from
    everyone else's GETs (they used to hold one each for :data:`_STALL_TIMEOUT`), while a
    reading client's bytes still move in GiB-sized ``sendfile`` calls without the GIL."""
    from gevent.socket import wait_write

    while count:
        sent = run_blocking("send", _sendfile_slice, sock_fd, fd, offset, count, pacer)
        offset += sent
        count -= sent
        if count:
            wait_write(sock_fd, timeout=_STALL_TIMEOUT,
                       timeout_exc=TimeoutError(f"the client took no byte for {_STALL_TIMEOUT:.0f} s"))


def _sendfile_all(sock_fd: int, fd: int, offset: int, count: int, on_full: Callable[[], object]) -> None:
    while count:
        try:
            sent = os.sendfile(sock_fd, fd, offset, min(count, _SENDFILE_MAX))
        except BlockingIOError:
            on_full()
            continue
        if sent == 0:
            raise OSError(f"sendfile sent nothing with {count} bytes left (file shrank?)")
        offset += sent
        count -= sent


def _sendfile_slice(sock_fd: int, fd: int, offset: int, count: int, pacer: Pacer) -> int:
    """In a thread of the ``send`` lane: as many bytes of the span as the client takes before
    its socket stays full for :data:`_SEND_SLICE`; how many. Each ``sendfile`` moves up to a
    GiB in the kernel (:func:`_blocking_slice`), or a pace slice when ``pacer`` has a rate."""
    done = 0
    until = pacer.now() + _SEND_SLICE  # paced: the thread's call ends about here (webapp.send_pace)
    with _blocking_slice(sock_fd):
        while done < count:
            if not pacer.pace(0, 0.0, until):  # ahead of the pace: the rest in another call
                break
            want = pacer.slice_size(min(count - done, _SENDFILE_MAX))
            started = pacer.now()
            try:
                sent = os.sendfile(sock_fd, fd, offset + done, want)
            except BlockingIOError:  # full for the whole slice: the hub waits instead
                break
            pacer.pace(sent, started, until)
            if sent == 0:
                raise OSError(f"sendfile sent nothing with {count - done} bytes left (file shrank?)")
            done += sent
            if sent < want:  # the timeout ended the call part-way: the socket is full
                break
    return done


@contextmanager
def _blocking_slice(sock_fd: int) -> Iterator[None]:
    """The client's socket made blocking, with a send timeout of :data:`_SEND_SLICE`, for the
    calls of one slice in a send thread (the greenlet that owns the connection waits for it,
    nothing else touches it); a send that times out returns part-way or raises
    ``BlockingIOError``."""
    from gevent import monkey

    raw_socket = monkey.get_original("socket", "socket")
    sock = raw_socket(fileno=os.dup(sock_fd))  # socket options belong to the socket: set via a dup
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _SLICE_TIMEVAL)
        os.set_blocking(sock_fd, True)
        try:
            yield
        finally:
            os.set_blocking(sock_fd, False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _TIMEVAL.pack(0, 0))
    finally:
        sock.close()  # the dup only: the connection lives on in sock_fd
