"""Bounds on what one HTTP client can hold of the session server (both modes share them).

A client that sends headers and then no body (or a body a byte a minute) held a gevent
greenlet and a connection slot forever; 2,100 of them filled gunicorn's connection pool and
blocked every route, ``/health`` included. Three bounds, each a setting read from
``SHINKEN_<FIELD>`` by both the router and the single-process app (``shinken-session-server``
flags ``--body-timeout`` and ``--max-client-connections``):

- headers: gunicorn's keep-alive timeout bounds the read of each request head (gevent worker);
- ``body_timeout``: the whole request body must arrive within this many seconds, else 408;
- ``max_client_connections``: open connections per client address; past it a new connection
  is answered 429 and closed at once by :mod:`webapp.gunicorn_worker`, so one client cannot
  fill the pool.

:func:`iter_body` reads a request body under the deadline and turns the WSGI server's
malformed-body errors (a bad chunk size, a missing chunk terminator, a body cut short) into
:class:`MalformedBody` (400) instead of a 500 with a traceback.

:func:`iter_request_body` is the servers' way in: a body of known length under gunicorn is
received straight from the client socket into each piece's own buffer (``recv_into``), past
gunicorn's reader, whose ``BytesIO`` read-ahead copied every megabyte of a screenshot turn
three to four times; a chunked body, or one under another WSGI server, goes through
:func:`iter_body`. Limits, errors and the keep-alive connection behave the same either way.
"""

from __future__ import annotations

import contextlib
import io
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import gevent
import gevent.socket
import gevent.ssl
from gevent import monkey
from werkzeug.exceptions import ClientDisconnected, HTTPException

from webapp.errors import WebappError
from webapp.settings import Scope, default, values_from_env

try:  # the WSGI server both modes run under; absent in a bare Flask test client
    from gunicorn.http.body import Body as _GunicornBody
    from gunicorn.http.body import LengthReader as _LengthReader
    from gunicorn.http.errors import NoMoreData, ParseException
    from gunicorn.http.unreader import SocketUnreader as _SocketUnreader

    _SERVER_BODY_ERRORS: tuple[type[BaseException], ...] = (ParseException, NoMoreData)
except ImportError:  # pragma: no cover
    _SERVER_BODY_ERRORS = ()
    _GunicornBody = _LengthReader = _SocketUnreader = None

__all__ = ["BodyError", "BodyTimeout", "HttpLimits", "MalformedBody", "SocketBody", "iter_body", "iter_request_body",
           "read_body", "read_socket_body", "take_request_socket"]

DEFAULT_BODY_TIMEOUT: float = default("body_timeout")  # 256 MiB at ~7 Mbit/s; a stalled client goes before
DEFAULT_MAX_CLIENT_CONNECTIONS: int = default("max_client_connections")
READ_CHUNK = 1 << 20


class BodyError(WebappError):
    """The request body could not be read; ``status`` is the HTTP answer (webapp.errors)."""

    status = 400


class MalformedBody(BodyError):
    status = 400


class BodyTimeout(BodyError):
    status = 408


@dataclass(frozen=True)
class HttpLimits:
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS

    def __post_init__(self) -> None:
        if not self.body_timeout > 0 or self.max_client_connections < 1:
            raise ValueError("body_timeout must be > 0 and max_client_connections >= 1, "
                             f"got {self.body_timeout}, {self.max_client_connections}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HttpLimits:
        """The ``http`` settings of :data:`webapp.settings.SETTINGS` the environment sets."""
        return cls(**values_from_env(environ, (Scope.HTTP,)))


def iter_body(stream: IO[bytes], timeout: float, chunk: int = READ_CHUNK,
              length: int | None = None) -> Iterator[bytes]:
    """The body from ``stream`` (a werkzeug request stream: length and size limits applied)
    in pieces of at most ``chunk`` bytes, all within ``timeout`` seconds; with ``length`` (the
    Content-Length), a body that ends short of it is malformed.

    Raises :class:`BodyTimeout` past the deadline, :class:`MalformedBody` for a malformed or
    truncated body; werkzeug's ``RequestEntityTooLarge`` passes through (413).
    """
    deadline = time.monotonic() + timeout
    received = 0
    # Outside a gevent-patched server (a bare Flask test client) a read cannot be interrupted,
    # and a timer would start a hub this thread then leaves idle: only the deadline check applies.
    bounded = monkey.is_module_patched("socket")
    while True:
        try:
            with _read_within(deadline, timeout, bounded):
                piece = stream.read(chunk)
        except ClientDisconnected as exc:
            raise MalformedBody("request body shorter than its Content-Length") from exc
        except _SERVER_BODY_ERRORS as exc:
            # the server's message quotes the offending bytes: bounded, never echoed in full
            raise MalformedBody(f"malformed request body: {str(exc)[:200]}") from exc
        if not piece:
            if length is not None and received != length:
                raise MalformedBody(f"request body of {received} bytes, Content-Length {length}")
            return
        received += len(piece)
        yield piece


def _read_within(deadline: float, timeout: float, bounded: bool) -> contextlib.AbstractContextManager[object]:
    """Where one read of a body runs: :class:`BodyTimeout` at once past ``deadline``, else (a
    gevent-patched process: ``bounded``) interrupted by it when the deadline passes mid-read."""
    remaining = deadline - time.monotonic()
    late = BodyTimeout(f"request body not received within the body_timeout of {timeout:g} s")
    if remaining <= 0:
        raise late
    return gevent.Timeout(remaining, late) if bounded else contextlib.nullcontext()


def iter_request_body(stream: IO[bytes], wsgi_input: Any, timeout: float, length: int | None,
                      chunk: int = READ_CHUNK) -> Iterator[bytes | bytearray]:
    """A request's body as :func:`iter_body` gives it (same pieces, limits and errors):
    ``stream`` is werkzeug's ``request.stream`` (already past its size check: 413), ``wsgi_input``
    the environ's ``wsgi.input`` and ``length`` the Content-Length. Under gunicorn, a body of
    known length that nothing has read yet is received straight from the client socket
    (:func:`_socket_body`); anything else reads ``stream``."""
    reader = getattr(wsgi_input, "reader", None)
    if _direct(wsgi_input, reader, length):
        return _socket_body(wsgi_input, reader, timeout, chunk)
    return _not_reused_on_failure(iter_body(stream, timeout, chunk, length), wsgi_input)


def _not_reused_on_failure(pieces: Iterator[bytes], wsgi_input: Any) -> Iterator[bytes]:
    """``pieces``; if reading them fails under gunicorn, the connection is not read on
    (:func:`_not_reused`). A consumer that stops early is no failure: gunicorn's own reader was
    used, so it drains the rest by the body's length and finds the next request."""
    try:
        yield from pieces
    except Exception:
        if _GunicornBody is not None and isinstance(wsgi_input, _GunicornBody):
            _not_reused(wsgi_input)
        raise


def _direct(wsgi_input: Any, reader: Any, length: int | None) -> bool:
    """gunicorn's body of known length, nothing of it read yet, in a gevent-patched process."""
    return (_GunicornBody is not None and length is not None and isinstance(wsgi_input, _GunicornBody)
            and isinstance(reader, _LengthReader) and reader.length == length and not wsgi_input.buf.tell()
            and isinstance(reader.unreader, _SocketUnreader) and monkey.is_module_patched("socket"))


def _socket_body(body: Any, reader: Any, timeout: float, chunk: int) -> Iterator[bytearray]:
    """gunicorn's body of known length (``reader``: its ``LengthReader``), each piece a new
    buffer of ``min(chunk, rest)`` bytes filled by ``recv_into`` from the client socket: the
    bytes gunicorn read ahead with the request head come first, anything past the body (a
    pipelined next request) is handed back to it. ``reader.length`` counts down as gunicorn's
    own reads would, so a body left unread is drained by gunicorn before the connection's next
    request; a failed read marks the body failed, so the connection is not reused."""
    deadline = time.monotonic() + timeout
    unreader, length = reader.unreader, reader.length
    ahead = unreader.buf.getvalue()
    unreader.buf = io.BytesIO()
    if len(ahead) > reader.length:  # the next request's first bytes: gunicorn's again
        unreader.buf.write(ahead[reader.length:])
        ahead = ahead[:reader.length]
    try:
        while reader.length:
            size = min(chunk, reader.length)
            piece = bytearray(size)
            with memoryview(piece) as view:
                filled = min(len(ahead), size)
                if filled:
                    view[:filled] = ahead[:filled]
                    ahead = ahead[filled:]
                try:
                    _recv_exactly(unreader.sock, view[filled:], deadline, timeout, length - reader.length + filled,
                                  length)
                except BaseException:
                    ahead = b""  # (empty already: the socket is read once the read-ahead ran out)
                    _not_reused(body)  # where the next request starts is unknown now
                    raise
            reader.length -= size
            yield piece
    finally:
        if ahead:  # left unread (the consumer stopped early): gunicorn's to drain, in order
            unreader.unread(ahead)


def _not_reused(body: Any) -> None:
    """gunicorn must not read another request from the connection of ``body`` (its ``Body``):
    where it would start is unknown. ``Body.failed`` says so to gunicorn 27+, which closes the
    connection after the answer. Older ones drain the rest of the body by its length and parse
    what follows (a client's next bytes after a 408 were answered as a request), so their
    reader, which the body's reader shares with the connection's parser, is left at the end of
    its input: nothing buffered, nothing more received (the answer still goes out)."""
    body.failed = True
    reader = body.reader  # LengthReader/EOFReader keep the unreader, ChunkedReader its request
    unreader = getattr(reader, "unreader", None) or getattr(getattr(reader, "req", None), "unreader", None)
    if unreader is not None:
        unreader.buf = io.BytesIO()
        unreader.chunk = _end_of_input  # an instance attribute: this connection's reader only


def _end_of_input(*_size_hint: object) -> bytes:
    return b""


def _recv_exactly(sock: Any, view: memoryview, deadline: float, timeout: float, before: int, length: int) -> None:
    """Fill ``view`` from ``sock`` (a gevent socket) by ``deadline``; ``before``: bytes of the
    body ahead of ``view``, ``length`` its Content-Length (for the error's text)."""
    filled = 0
    while filled < len(view):
        with _read_within(deadline, timeout, True):
            n = sock.recv_into(view[filled:])
        if not n:  # (iter_body's words for it)
            raise MalformedBody(f"request body of {before + filled} bytes, Content-Length {length}")
        filled += n


def read_socket_body(sock: Any, view: memoryview, timeout: float, before: int, length: int,
                     chunk: int = READ_CHUNK, between: Callable[[], None] | None = None) -> None:
    """Receive ``view``, a body's bytes after its first ``before`` (``length``: its
    Content-Length), from ``sock`` (a gevent socket) within ``timeout`` seconds, ``chunk`` bytes
    at a time with ``between()`` before each (a session worker lets small requests run first).

    Raises :class:`BodyTimeout` past the deadline, :class:`MalformedBody` if the body ends short.
    """
    deadline = time.monotonic() + timeout
    for start in range(0, len(view), chunk):
        if between is not None:
            between()
        _recv_exactly(sock, view[start:start + chunk], deadline, timeout, before + start, length)


@dataclass
class SocketBody:
    """A request body of known length still in the client's connection, for another process to
    receive (a router hands a large chat body to its session worker: ``webapp.body_handoff``).

    ``ahead``: the body's first bytes, which the HTTP server read with the request head; the
    other ``length - len(ahead)`` bytes are still the socket's. Whoever takes it calls
    :meth:`consumed` once the other process received the whole body, else :meth:`abandon`.
    """

    sock: Any  # the connection's gevent socket
    ahead: bytes
    length: int
    _body: Any
    _reader: Any
    ended: bool = False

    def fileno(self) -> int:
        fd: int = self.sock.fileno()
        return fd

    def consumed(self) -> None:
        """The whole body was read elsewhere: the connection's next request follows it."""
        self.ended = True
        self._reader.length = 0

    def abandon(self) -> None:
        """The body's fate is unknown (the other process may still be reading it): the connection
        is not reused, and its read side is shut down, so a reader elsewhere stops at once."""
        self.ended = True
        _not_reused(self._body)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RD)

    def close(self) -> None:
        """:meth:`abandon` unless it ended already (the taker failed before handing it on: its
        first bytes are gone from gunicorn's buffer, so gunicorn must not read on)."""
        if not self.ended:
            self.abandon()


def take_request_socket(wsgi_input: Any, length: int | None, max_ahead: int) -> SocketBody | None:
    """The request's body as a :class:`SocketBody`, when :func:`iter_request_body` would read it
    straight from the socket, the connection is a plain (not TLS) socket and the server read at
    most ``max_ahead`` bytes of it ahead; else None (read it with :func:`iter_request_body`)."""
    reader: Any = getattr(wsgi_input, "reader", None)
    if not _direct(wsgi_input, reader, length):
        return None
    unreader = reader.unreader
    sock = unreader.sock
    plain = getattr(sock, "wrapped", sock)  # (webapp.gunicorn_worker.HeadWithBody wraps it)
    if not isinstance(plain, gevent.socket.socket) or isinstance(plain, gevent.ssl.SSLSocket):
        return None
    ahead = unreader.buf.getvalue()
    if len(ahead) > max_ahead or len(ahead) >= reader.length:  # (a pipelined request behind it: read here)
        return None
    unreader.buf = io.BytesIO()
    return SocketBody(sock, ahead, reader.length, wsgi_input, reader)


def read_body(stream: IO[bytes], timeout: float, length: int | None = None) -> bytes:
    """The whole body (see :func:`iter_body`)."""
    return b"".join(iter_body(stream, timeout, length=length))


def discard_body(stream: IO[bytes], timeout: float, length: int | None = None, wsgi_input: Any = None) -> None:
    """Read and drop a refused request's body (in pieces: no memory kept), so the client that
    is still sending it reads the refusal instead of a reset; errors end it quietly (and, with
    gunicorn's ``wsgi_input``, the connection is not read on)."""
    try:
        for _piece in _not_reused_on_failure(iter_body(stream, timeout, length=length), wsgi_input):
            pass
    except (BodyError, OSError, HTTPException):
        pass
