"""A large request body received by the session worker straight from the client's connection.

A screenshot turn's body (MBs of base64 images, the history resent every turn) used to cross
the router: received from the client, written into the worker channel, received again by the
worker. That was ~2.4 ms of the router's CPU per 20-screenshot turn and most of the bytes on
the channel ahead of small requests' frames (docs/benchmarks.md section 42). Instead, for a
body over :data:`webapp.ipc.INLINE_BODY_MAX` of known length on a plain (not TLS) connection,
the router sends its worker the connection's file descriptor, and the worker receives the body
into its own buffer; no body byte passes through the router.

The descriptor travels on a second channel per worker, a ``SOCK_SEQPACKET`` socketpair made
for this alone: one message per request, the request's whole REQUEST frame (``webapp.ipc``;
meta ``"body": "socket"``, its inline body the bytes the router's HTTP server had already read
ahead with the head) with the descriptor attached (``SCM_RIGHTS``). Everything else about the
request -- its reply, an ERROR, a CANCEL -- is on the main channel as for any request.

Who owns the connection meanwhile: the router's connection handler waits for the request's
reply (or error, or its timeout) before it touches the connection again, so only the worker
reads it. The worker reads exactly the body's remaining bytes (a pipelined next request stays
in the kernel for the router), under the body deadline the meta carries, then closes its copy
of the descriptor. A reply means the whole body was read; any other ending (the worker's read
failed, the request timed out or was refused, the worker died) ends the client's connection:
the router shuts its read side down, so a worker still reading stops at once, and answers the
error with ``Connection: close`` semantics (the connection is not reused).

Sans-policy plumbing only: :class:`webapp.ipc_channel.IpcClient` and ``IpcServer`` decide when.
"""

from __future__ import annotations

import _socket
import array
import os
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from gevent.socket import wait_read, wait_write

from webapp.http_limits import BodyError, BodyTimeout, MalformedBody
from webapp.ipc import Buffer, IpcProtocolError, IpcRemoteError, IpcTimeout

__all__ = ["MAX_AHEAD_BYTES", "MAX_MESSAGE_BYTES", "HandedBody", "handed_body_error", "open_pair", "receive_loop", "send"]

# A handoff message is a REQUEST frame whose inline body is at most what an HTTP server reads
# ahead with a request head (the router hands off nothing with more ahead than this).
MAX_AHEAD_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = MAX_AHEAD_BYTES + 64 * 1024  # + header and meta
_FD_SIZE = array.array("i").itemsize
# The errors of the worker's read of a handed-off body, by the name its ERROR frame carries.
_BODY_ERRORS: dict[str, type[BodyError]] = {cls.__name__: cls for cls in (BodyTimeout, MalformedBody)}


class HandedBody(Protocol):
    """What the router hands over (``webapp.http_limits.SocketBody`` fits): the body's bytes
    already read (``ahead``), its whole ``length``, the connection's descriptor, and the two
    endings."""

    ahead: bytes
    length: int

    def fileno(self) -> int: ...

    def consumed(self) -> None: ...

    def abandon(self) -> None: ...


def open_pair() -> tuple[socket.socket, socket.socket]:
    """The (router end, worker end) of a new handoff channel."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: _socket.socket, message: Sequence[Buffer], fd: int, timeout: float) -> None:
    """One message with ``fd`` attached, on the router's end (non-blocking, waited on cooperatively).

    Raises :class:`IpcTimeout` if the worker's end took nothing for ``timeout`` seconds, OSError
    if the channel is gone.
    """
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    while True:
        try:
            sock.sendmsg(message, ancillary)
            return
        except BlockingIOError:
            wait_write(sock.fileno(), timeout=timeout, timeout_exc=IpcTimeout(
                f"the worker took no handed-off request for {timeout} s"))


def receive_loop(sock: _socket.socket, on_message: Callable[[bytes, int | None], None]) -> None:
    """Receive messages on the worker's end until it closes; ``on_message(data, fd)`` owns
    ``fd`` from then on. ``fd`` is None when the kernel could not pass the descriptor (this
    process is at its descriptor limit): that request fails, the channel goes on. Any other
    malformed message (truncated, no descriptor, several) has its descriptors closed and
    raises :class:`IpcProtocolError`: the router sends nothing else."""
    fileno = sock.fileno()
    while True:
        try:
            data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE_BYTES, socket.CMSG_SPACE(4 * _FD_SIZE))
        except BlockingIOError:
            wait_read(fileno)
            continue
        fds = _descriptors(ancillary)
        if not data and not fds:
            return  # the router closed its end
        if flags & socket.MSG_CTRUNC and not fds and not flags & socket.MSG_TRUNC:
            on_message(data, None)
            continue
        if len(fds) != 1 or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            for fd in fds:
                os.close(fd)
            raise IpcProtocolError(f"malformed handoff message: {len(data)} bytes, {len(fds)} descriptors, "
                                   f"flags {flags:#x}")
        on_message(data, fds[0])


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _FD_SIZE])
    return list(fds)


def handed_body_error(exc: BaseException) -> BodyError | None:
    """The worker's failed read of a handed-off body (its ERROR names a body error) as the
    router's own read would have raised it (408, 400; same text); None for any other error."""
    if isinstance(exc, IpcRemoteError):
        cls = _BODY_ERRORS.get(exc.remote_type)
        if cls is not None:
            return cls(exc.message)
    return None
