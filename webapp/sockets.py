"""Socket calls of a turn's two small writes and of the engine connection's reuse check, made
with the fewest syscalls and the least gevent machinery.

- :func:`send_small`: gevent's ``sendall`` asks the kernel for the socket's send buffer size
  (a ``getsockopt``) and walks its chunking loop on every call, for the reply to the client and
  the request to the engine alike, a few KiB each that one ``send`` takes whole. One ``send``
  first; whatever it leaves goes through ``sendall``.
- :func:`send_gathered`: a large body kept as pieces (an image turn's engine request: its
  head and the data URLs, views of the client's body) goes out by ``sendmsg`` from the
  pieces themselves, without a joined copy of the megabytes first.
- :func:`readable_now`: urllib3 checks a kept-alive connection before each reuse with a
  zero-timeout poll; under gevent's monkey patching that poll is the hub's (a watcher started
  and stopped, an ``epoll_ctl`` that fails, for every engine call). One real ``poll(2)`` with a
  zero timeout never blocks, so it needs no hub.
"""

from __future__ import annotations

import select
from collections.abc import Sequence
from typing import Any

from gevent import monkey

from webapp.iovec import IOV_MAX, advance, views

__all__ = ["readable_now", "send_gathered", "send_small"]

_poll = monkey.get_original("select", "poll")  # the OS's, also when gevent patched select
_READ_EVENTS = select.POLLIN


def send_small(sock: Any, data: bytes | bytearray | memoryview) -> None:
    """``sock.sendall(data)``: one ``send`` first (all of a small write, usually), ``sendall``
    for the rest. Timeouts and errors are the socket's own, as ``sendall``'s."""
    sent = sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def send_gathered(sock: Any, pieces: Sequence[bytes | bytearray | memoryview]) -> None:
    """Every byte of ``pieces`` in order, as ``sock.sendall(b"".join(pieces))`` would send
    them, by ``sendmsg`` from the pieces themselves. Cooperative under gevent; timeouts and
    errors are the socket's own."""
    buffers = views(pieces)
    first = 0
    while first < len(buffers):
        first = advance(buffers, first, sock.sendmsg(buffers[first:first + IOV_MAX]))


def readable_now(sock: Any) -> bool:
    """Whether ``sock`` has data, end of file or an error to report now (urllib3's
    ``wait_for_read(sock, timeout=0)``): for an idle kept-alive connection, that it was dropped."""
    poller = _poll()
    poller.register(sock.fileno(), _READ_EVENTS)
    return bool(poller.poll(0))
