"""``--workers 0``: the router's one shard, served in the router's own process.

There is one HTTP surface, :mod:`webapp.router`. Its single-process mode hands it a
:class:`LocalShard` where the multi-process mode hands it a :class:`webapp.supervisor.Supervisor`
of worker subprocesses, so routes, auth, instance tags, body limits, bodies in flight, error
shapes, ``/health`` and the viewer are the router's in both modes by construction, not kept
equal by hand.

A :class:`LocalShard` speaks the part of the supervisor's interface the router uses
(``workers``, ``request``, ``status``, ``start``, ``stop``) and answers each request as a worker
would: the same op dispatch (:class:`webapp.worker.SessionOps`) over a session core in this
process, the reply in the router's :class:`webapp.ipc_channel.IpcReply` shape. What differs is
only what a channel adds: no frames and no copies (the request body reaches the core as it is,
a chunked reply body is handed on chunk by chunk, a records GET names its journal ranges for
the router to sendfile), and no per-request deadline of the channel's own (the core's backend
timeouts bound a turn, as they bound a worker's). A handler exception reaches the router as
the same :class:`webapp.ipc.IpcRemoteError` a worker's ERROR frame becomes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from webapp.body_handoff import HandedBody
from webapp.core import CoreConfig, SessionCore, build_session_core
from webapp.ipc import Buffer, IpcRemoteError
from webapp.ipc_channel import IpcReply
from webapp.supervisor import SlotState
from webapp.worker import SessionOps

__all__ = ["LocalShard"]

log = logging.getLogger(__name__)


class LocalShard:
    """Shard 0 of 1: a session core in this process, behind the router's shard interface."""

    workers = 1

    def __init__(self, config: CoreConfig) -> None:
        # Every session of the data directory is this shard's: loaded before the first request.
        self.core: SessionCore = build_session_core(config, shard=0, shards=1)
        # The router in this process admits every body against the same in-flight budget.
        self._ops = SessionOps(self.core, 0, 1, config, admitted=True)
        self._closed = False

    def start(self) -> None:
        """Nothing to start: the core serves from construction (the supervisor's counterpart
        starts its worker processes here)."""

    def stop(self) -> None:
        """Close the core (its backend connections; a private data directory); idempotent."""
        if not self._closed:
            self._closed = True
            self.core.close()

    def status(self) -> list[dict[str, Any]]:
        state = SlotState.STOPPED if self._closed else SlotState.READY
        return [{"shard": 0, "state": state.value, "reason": None, "restarts": 0, "pid": os.getpid(),
                 "config": None}]

    @property
    def takes_body_sockets(self) -> bool:
        """No: this process reads every body itself (``webapp.body_handoff`` is for workers)."""
        return False

    def request(self, shard: int, meta: dict[str, Any], body: Buffer | Sequence[Buffer] = b"", *,
                timeout: float, chunk_timeout: float = 60.0, body_stream: Iterable[Buffer] | None = None,
                body_length: int | None = None, body_socket: HandedBody | None = None,
                body_timeout: float = 60.0) -> IpcReply:
        """The op in ``meta`` on this shard's core (``timeout``, ``chunk_timeout``: the channel's,
        unused here). Raises :class:`IpcRemoteError` when the handler raises, as a worker's would."""
        if shard != 0:
            raise ValueError(f"a local shard is shard 0 of 1, not {shard}")
        if body_socket is not None:
            raise ValueError("a local shard takes no body_socket (takes_body_sockets is False)")
        data: Buffer
        if body_stream is not None:  # the core parses a whole body: gather the pieces once
            data = b"".join(body_stream)
        elif isinstance(body, (bytes, bytearray, memoryview)):
            data = body
        else:
            data = b"".join(body)
        try:
            reply = self._ops(meta, memoryview(data))
        except Exception as exc:  # the worker's rule (webapp.ipc_channel.IpcServer): one request fails
            log.exception("op %r failed", meta.get("op"))
            raise IpcRemoteError.from_exception(exc) from exc
        return _as_ipc_reply(reply)


def _as_ipc_reply(reply: Any) -> IpcReply:
    """A handler's reply (a core ``Reply``, or a worker's file reply naming journal ranges) as
    the router receives one from a worker."""
    headers = list(reply.headers)
    layout = getattr(reply, "file_layout", None)
    if isinstance(reply.body, list):
        length = sum(len(chunk) for chunk in reply.body)
        return IpcReply(reply.status, reply.content_type, headers, length, stream=_Chunks(reply.body, length),
                        file_layout=layout)
    return IpcReply(reply.status, reply.content_type, headers, len(reply.body), body=bytes(reply.body),
                    file_layout=layout)


class _Chunks:
    """A chunked body as the router iterates a worker's stream: once, then closed."""

    def __init__(self, chunks: list[bytes], length: int) -> None:
        self._chunks = chunks
        self.length = length
        self.consumed = 0

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._chunks:
            self.consumed += len(chunk)
            yield chunk

    def close(self) -> None:
        self._chunks = []

