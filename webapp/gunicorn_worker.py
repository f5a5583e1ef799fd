"""The gunicorn worker class of ``shinken-session-server``: gevent, a per-client cap, and a
response's head sent with its body.

gunicorn's gevent worker accepts up to ``worker_connections`` connections in one pool; a
single client holding them all (slow bodies, idle sockets) blocked everyone else. This worker
counts open connections per client address and answers a connection past
``max_client_connections`` (see :mod:`webapp.http_limits`) with 429 and closes it before
reading anything, so the pool keeps room for other clients.

gunicorn writes a response's status line and headers with one ``sendall`` and its body with
another; its sockets have ``TCP_NODELAY``, so a small reply (every chat) left as two segments
and woke its client twice. :class:`HeadWithBody` holds the head back until the body's first
write and sends both in one call (one send and one wake-up fewer per reply), a single ``send``
when the socket takes it whole (:func:`webapp.sockets.send_small`).

gunicorn's ``Config`` answers every setting read through ``__getattr__`` (a dictionary lookup
and the setting's ``get``, ~0.4 us), and its parser, environ and response read ~23 settings
per request. The worker reads its settings through :class:`SettingsReadOnce`, which keeps each
value as a plain attribute after its first read: a worker's settings never change while it
runs (a reload starts new workers with the new settings).
"""

from __future__ import annotations

import json
import socket
import ssl
from collections import Counter
from typing import Any

from gunicorn.workers.ggevent import GeventWorker

from webapp.http_limits import HttpLimits
from webapp.sockets import send_small

__all__ = ["HeadWithBody", "SessionServerWorker", "SettingsReadOnce"]

_REFUSAL_GRACE = 1.0
# A held head joins a body write up to this size (one copy of the body); a larger body goes
# out in its own call right after the head, as gunicorn would have sent it.
JOIN_MAX = 256 << 10
# What a response head written alone by gunicorn looks like: a status line, headers, a blank line.
_HEAD_START = b"HTTP/"
_HEAD_END = b"\r\n\r\n"
_HEAD_MAX = 64 << 10


def _refusal(limit: int) -> bytes:
    body = json.dumps({"error": f"too many open connections from this client address "
                                f"(max_client_connections={limit})"}).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _refuse(client: Any, limit: int) -> None:
    try:
        client.setblocking(1)
        client.settimeout(_REFUSAL_GRACE)  # never wait long on a client that does not read
        client.sendall(_refusal(limit))
        client.shutdown(socket.SHUT_WR)
        # Closing with the request unread would reset the connection and could drop the
        # answer before the client reads it: take (a bounded amount of) what it sent first.
        for _ in range(16):
            if not client.recv(65536):
                break
    except OSError:
        pass
    finally:
        client.close()


class HeadWithBody:
    """The client socket as gunicorn's HTTP/1 writer sees it: a ``sendall`` of a response head
    alone is held and sent with the next ``sendall`` (the body's first bytes).

    Anything else done with the socket first sends what is held, so the bytes keep their order
    and a client is never left waiting: reading the next request (``recv_into``), ``fileno``
    (``sendfile`` and ``writev`` to the raw socket: ``webapp.filebody``), ``close``, and every
    other attribute, reached through ``__getattr__``. A held head of a reply without a body goes
    out when gunicorn reads the connection's next request or closes it. What is held is only
    ever one write: holding is an ordering-safe delay, so a body that happens to look like a
    head costs nothing but the same delay.
    """

    __slots__ = ("_held", "_sock")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._held: bytes | None = None

    def sendall(self, data: Any) -> None:
        held = self._held
        if held is None:
            if len(data) <= _HEAD_MAX and data[:5] == _HEAD_START and data[-4:] == _HEAD_END:
                self._held = bytes(data)
                return
            self._sock.sendall(data)
            return
        self._held = None
        if len(data) <= JOIN_MAX:
            send_small(self._sock, held + bytes(data))
        else:
            self._sock.sendall(held)
            self._sock.sendall(data)

    def flush(self) -> None:
        """Send what is held, if anything."""
        held, self._held = self._held, None
        if held is not None:
            self._sock.sendall(held)

    @property
    def wrapped(self) -> Any:
        """The client socket itself (``webapp.http_limits.take_request_socket`` checks its kind)."""
        return self._sock

    def close(self) -> None:
        try:
            self.flush()
        except OSError:
            pass  # the peer is gone: what was held has nobody to go to
        finally:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:
        # Every other use of the socket: what is held goes first.
        if self._held is not None:
            self.flush()
        return getattr(self._sock, name)


class SettingsReadOnce:
    """gunicorn's ``Config`` as a worker reads it: each attribute read from ``cfg`` once, then
    kept on this object (a plain attribute: later reads never reach ``__getattr__``). Setting
    values is not supported here (gunicorn sets them in the arbiter, before a worker starts)."""

    def __init__(self, cfg: Any) -> None:
        object.__setattr__(self, "_cfg", cfg)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._cfg, name)  # AttributeError for a name cfg has not: nothing kept
        object.__setattr__(self, name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a worker's settings are read-only (set {name!r} before the worker starts)")


class SessionServerWorker(GeventWorker):  # type: ignore[misc]  # gunicorn is untyped (Any)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cfg: Any = SettingsReadOnce(self.cfg)  # the parser, environ and response read it per request
        self._limit = HttpLimits.from_env().max_client_connections
        self._open: Counter[Any] = Counter()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        # TCP: (host, port[, ...]); the port differs per connection, the host is the client
        key = addr[0] if isinstance(addr, tuple) else addr
        if self._open[key] >= self._limit:
            _refuse(client, self._limit)
            return
        self._open[key] += 1
        if not isinstance(client, ssl.SSLSocket):  # TLS and HTTP/2 negotiation need the real socket
            client = HeadWithBody(client)
        try:
            super().handle(listener, client, addr)
        finally:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]
