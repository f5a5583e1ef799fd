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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO

import gevent
from gevent import monkey
from werkzeug.exceptions import ClientDisconnected, HTTPException

from webapp.errors import WebappError
from webapp.settings import Scope, default, values_from_env

try:  # the WSGI server both modes run under; absent in a bare Flask test client
    from gunicorn.http.errors import NoMoreData, ParseException

    _SERVER_BODY_ERRORS: tuple[type[BaseException], ...] = (ParseException, NoMoreData)
except ImportError:  # pragma: no cover
    _SERVER_BODY_ERRORS = ()

__all__ = ["BodyError", "BodyTimeout", "HttpLimits", "MalformedBody", "iter_body", "read_body"]

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
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BodyTimeout(f"request body not received within the body_timeout of {timeout:g} s")
        try:
            with (gevent.Timeout(remaining, BodyTimeout(
                    f"request body not received within the body_timeout of {timeout:g} s"))
                  if bounded else contextlib.nullcontext()):
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


def read_body(stream: IO[bytes], timeout: float, length: int | None = None) -> bytes:
    """The whole body (see :func:`iter_body`)."""
    return b"".join(iter_body(stream, timeout, length=length))


def discard_body(stream: IO[bytes], timeout: float, length: int | None = None) -> None:
    """Read and drop a refused request's body (in pieces: no memory kept), so the client that
    is still sending it reads the refusal instead of a reset; errors end it quietly."""
    try:
        for _piece in iter_body(stream, timeout, length=length):
            pass
    except (BodyError, OSError, HTTPException):
        pass
