"""The gunicorn worker class of ``shinken-session-server``: gevent, plus a per-client cap.

gunicorn's gevent worker accepts up to ``worker_connections`` connections in one pool; a
single client holding them all (slow bodies, idle sockets) blocked everyone else. This worker
counts open connections per client address and answers a connection past
``max_client_connections`` (see :mod:`webapp.http_limits`) with 429 and closes it before
reading anything, so the pool keeps room for other clients.
"""

from __future__ import annotations

import json
import socket
from collections import Counter
from typing import Any

from gunicorn.workers.ggevent import GeventWorker

from webapp.http_limits import HttpLimits

__all__ = ["SessionServerWorker"]

_REFUSAL_GRACE = 1.0


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


class SessionServerWorker(GeventWorker):  # type: ignore[misc]  # gunicorn is untyped (Any)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._limit = HttpLimits.from_env().max_client_connections
        self._open: Counter[Any] = Counter()

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        # TCP: (host, port[, ...]); the port differs per connection, the host is the client
        key = addr[0] if isinstance(addr, tuple) else addr
        if self._open[key] >= self._limit:
            _refuse(client, self._limit)
            return
        self._open[key] += 1
        try:
            super().handle(listener, client, addr)
        finally:
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key]
