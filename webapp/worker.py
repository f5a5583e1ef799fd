"""Session worker subprocess: one session core, driven over IPC by the router.

Started by :mod:`webapp.supervisor` with the multiprocessing *spawn* context; :func:`run` is
the process target. It monkey-patches with gevent before anything else runs, then serves
every request in its own greenlet, so blocking ``core.chat`` calls (backend I/O through
urllib3) overlap. This module imports nothing of the session core at import time: the
router imports it (to name the spawn target) and must stay free of the core and tokenizers.

Ops: :class:`webapp.ipc.Op` (docs/ipc.md). Every op but ``ping``/``health`` names a
``session_id`` that must hash to this worker's shard.

A worker that cannot build its session core (a bad tokenizer path...) answers every request,
the supervisor's startup ping first, with a ``WorkerBootError`` carrying the reason, and exits
with :data:`EXIT_BOOT_ERROR` once the supervisor closes the channel.

The worker dies with its parent three ways: ``PR_SET_PDEATHSIG`` (SIGKILL), a parent-pid
watch every second, and EOF on the channel (the router closing it, or dying).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.reduction
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from shinken_sync.lifetime import die_with_parent
from webapp.errors import WebappError
from webapp.filebody import encode_layout, has_spans
from webapp.inflight import InflightBudget, InflightRefused, refusal_headers
from webapp.ipc import WORKER_BOOT_ERROR, Op

__all__ = ["EXIT_BOOT_ERROR", "PROCESS_TITLE", "WorkerBootError", "run"]

PROCESS_TITLE = "shinken-session-worker[{shard}/{shards}]"
# Exit code of a worker that could not build its session core (gunicorn's WORKER_BOOT_ERROR):
# a respawn would fail the same way, so the supervisor marks the shard failed after
# ``boot_attempts`` of them in a row instead of looping (docs/session-server-ops.md).
EXIT_BOOT_ERROR = 3
_PARENT_CHECK_INTERVAL = 1.0
_BOOT_ERROR_LINGER = 60.0  # a boot-failed worker waits this long at most for the supervisor's ping

log = logging.getLogger("webapp.worker")


def run(conn: Any, shard: int, shards: int, core_config: dict[str, Any], parent_pid: int) -> None:
    """Process target: serve the session core for ``shard`` of ``shards`` over ``conn``.

    ``conn`` is this end of a multiprocessing duplex ``Pipe`` (a socketpair on Linux): its
    first message is the handoff channel's end (``webapp.body_handoff``), then only its file
    descriptor is used, with :mod:`webapp.ipc` framing. ``core_config`` holds
    the keyword arguments of :class:`webapp.core.CoreConfig`.
    """
    from gevent import monkey

    monkey.patch_all()
    die_with_parent(parent_pid, signal.SIGKILL)
    # Ctrl-C reaches the whole process group; the router decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import setproctitle

    title = PROCESS_TITLE.format(shard=shard, shards=shards)
    setproctitle.setproctitle(title)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s [{title}] %(levelname)s %(name)s: %(message)s")
    # The supervisor sends the handoff channel's end (webapp.body_handoff) before any frame.
    handoff = multiprocessing.reduction.recv_handle(conn)
    fd = os.dup(conn.fileno())
    conn.close()
    sys.exit(_serve(fd, shard, shards, core_config, parent_pid, handoff))


class WorkerBootError(WebappError):
    """The worker could not build its session core; answered to every request, then exit."""


assert WorkerBootError.__name__ == WORKER_BOOT_ERROR  # the remote_type the supervisor branches on


def _serve(fd: int, shard: int, shards: int, core_config: dict[str, Any], parent_pid: int,
           handoff_fd: int | None = None) -> int:
    from webapp.ipc_channel import IpcServer, open_socket

    sock = open_socket(fd)
    handoff = open_socket(handoff_fd) if handoff_fd is not None else None
    try:
        from webapp.core import CoreConfig, build_session_core

        config = CoreConfig(**core_config)
        core = build_session_core(config, shard=None)  # the shard's sessions: loaded below, serving
    except Exception as exc:  # a bad setting (tokenizer path...): report it, do not loop
        log.exception("cannot boot the session core for shard %d", shard)
        reason = f"{type(exc).__name__}: {exc}"
        return _refuse_until_closed(IpcServer(sock, _BootFailed(reason), name=f"worker[{shard}/{shards}]",
                                              handoff=handoff), parent_pid)
    ops = SessionOps(core, shard, shards, config, restoring=True)
    server = IpcServer(sock, ops, name=f"worker[{shard}/{shards}]", handoff=handoff)
    from webapp.boot import boot_done

    boot_done(f"worker[{shard}/{shards}]")  # before the sessions load: they are not frozen
    log.info("serving shard %d of %d (pid %d)", shard, shards, os.getpid())
    # Its sessions load while the worker answers heartbeats (the read yields after every
    # chunk), so GiBs of journals never look like a hang; session ops wait for the load.
    import gevent

    gevent.spawn(ops.restore)
    try:
        while server.wait_closed(_PARENT_CHECK_INTERVAL) is None:
            server.receive_pool.trim()  # an idle worker gives its large receive buffers back
            if os.getppid() != parent_pid:
                log.warning("parent %d is gone; exiting", parent_pid)
                return 1
        assert server.closed is not None  # wait_closed returned it
        log.info("channel closed (%s); exiting", server.closed.reason)
        return 0
    finally:
        server.close()
        core.close()


class _BootFailed:
    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self, meta: dict[str, Any], body: memoryview) -> Any:
        raise WorkerBootError(self.reason)


def _refuse_until_closed(server: Any, parent_pid: int) -> int:
    """Answer the supervisor's startup ping with the boot error (so the reason reaches /health),
    then exit with :data:`EXIT_BOOT_ERROR` once it closes the channel (or after a while)."""
    try:
        for _ in range(int(_BOOT_ERROR_LINGER / _PARENT_CHECK_INTERVAL)):
            if server.wait_closed(_PARENT_CHECK_INTERVAL) is not None or os.getppid() != parent_pid:
                break
        return EXIT_BOOT_ERROR
    finally:
        server.close()


@dataclasses.dataclass
class _FileReply:
    """A reply whose body names file ranges: only the inline bytes and the layout cross the
    channel; the router sends the ranges from the file itself (``webapp.filebody``)."""

    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...]
    file_layout: dict[str, Any]


def _header(meta: dict[str, Any], name: str) -> str | None:
    """A request header the route table hands the shard (op meta ``headers``, lower-case names)."""
    headers = meta.get("headers")
    value = headers.get(name) if isinstance(headers, dict) else None
    return value if isinstance(value, str) else None


def _wire_reply(reply: Any) -> Any:
    if not isinstance(reply.body, list) or not has_spans(reply.body):
        return reply
    inline, layout = encode_layout(reply.body)
    return _FileReply(reply.status, inline, reply.content_type, reply.headers, layout)


class SessionOps:
    """Maps IPC ops (:class:`webapp.ipc.Op`) to session-core calls; each returns a ``webapp.core.Reply``."""

    def __init__(self, core: Any, shard: int, shards: int, config: Any = None, restoring: bool = False,
                 admitted: bool = False) -> None:
        """``restoring``: session ops wait until :meth:`restore` has loaded the shard.
        ``admitted``: every body was admitted already, against the same budget, by the router in
        this process (``--workers 0``), so a turn holds no second reservation of it here."""
        from webapp import core as core_module
        from webapp.sharding import shard_for

        self._core = core
        self._restored = threading.Event()  # gevent's in the worker (patched before this runs)
        if not restoring:
            self._restored.set()
        # The effective config, echoed by the startup ping: what the router sees it running with.
        self._config = dataclasses.asdict(config) if config is not None else None
        self._shard = shard
        self._shards = shards
        self._shard_for = shard_for
        self._json_response = core_module.json_response
        self._openai_error_response = core_module.openai_error_response
        self._anthropic_error_response = core_module.anthropic_error_response
        self._inflight = None if admitted else InflightBudget(
            config.max_inflight_bytes if config is not None else core_module.CoreConfig("").max_inflight_bytes)
        self._error_response = core_module.error_response
        # The ops that name a session, each a method taking (session_id, meta, body).
        self._session_ops: dict[Op, Callable[[str, dict[str, Any], memoryview], Any]] = {
            Op.CHAT: self._chat,
            Op.MESSAGES: self._chat,
            Op.CREATE_SESSION: lambda sid, meta, body: core.create_session(sid),
            Op.GET_SESSION: lambda sid, meta, body: core.get_session(sid, include_images=meta.get("images") is True),
            Op.DELETE_SESSION: lambda sid, meta, body: core.delete_session(sid, if_match=_header(meta, "if-match")),
            Op.SAMPLES: lambda sid, meta, body: core.samples(sid, bytes(body),
                                                             include_images=meta.get("images") is True),
            Op.PROXY: self._proxy,
            Op.VIEWER_SUMMARY: lambda sid, meta, body: self._viewer().summary(sid),
            Op.VIEWER_TIMELINE: lambda sid, meta, body: self._viewer().timeline(sid),
            Op.VIEWER_IMAGE: lambda sid, meta, body: self._viewer().image(sid, str(meta.get("sha256", ""))),
        }
        self._viewer_data: Any = None

    def __call__(self, meta: dict[str, Any], body: memoryview) -> Any:
        raw = meta.get("op")
        try:
            op = Op(raw)
        except ValueError:
            return self._error_response(400, f"unknown op {raw!r}")
        if op is Op.PING:
            echo = {"config": self._config} if meta.get("config") else {}
            return self._json_response(200, {"shard": self._shard, "pid": os.getpid(), **echo})
        if op is Op.HEALTH:
            return self._core.health()
        self._restored.wait()  # a session op before the shard's journals are loaded: after
        if op is Op.VIEWER_SESSIONS:  # every session of this shard: no session_id
            return self._viewer().sessions(str(meta.get("prefix") or ""))
        session_id = meta.get("session_id")
        if not isinstance(session_id, str):
            return self._error_response(400, f"op {op.value!r} needs a session_id")
        owner = self._shard_for(session_id, self._shards)
        if owner != self._shard:  # a routing bug must be loud, not a silent 404
            return self._error_response(500, f"session {session_id} belongs to shard {owner}, "
                                             f"not {self._shard}")
        return _wire_reply(self._session_ops[op](session_id, meta, body))

    def _viewer(self) -> Any:
        if self._viewer_data is None:  # imported on first use: the router imports this module
            from webapp.viewer_data import ViewerData

            self._viewer_data = ViewerData(self._core)
        return self._viewer_data

    def restore(self) -> None:
        """Load the shard's sessions from the journals, then let session ops through."""
        import gevent

        try:
            self._core.restore_shard(self._shard, self._shards, pause=gevent.sleep)
        except Exception:  # a bug here must not leave every session op waiting forever
            log.exception("restoring the sessions of shard %d failed", self._shard)
        finally:
            self._restored.set()

    def _chat(self, session_id: str, meta: dict[str, Any], body: memoryview) -> Any:
        """A turn: ``chat``, or ``messages`` (the same turn in Anthropic's API)."""
        op = Op(meta["op"])
        budget = meta.get("budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not budget > 0):
            return self._error_response(400, f"op {op.value!r} needs a positive number as budget, got {budget!r}")
        # The receive buffer's view itself: the core only parses it (no copy of the body) and
        # keeps nothing of it past this call, when the buffer goes back to the pool.
        turn = self._core.messages if op is Op.MESSAGES else self._core.chat
        if self._inflight is None:
            return turn(session_id, body, budget)
        try:
            with self._inflight.hold(len(body)):  # this worker's bodies in flight (webapp.inflight)
                return turn(session_id, body, budget)
        except InflightRefused as exc:
            if op is Op.MESSAGES:
                reply = self._anthropic_error_response(exc.status, str(exc))
            else:
                reply = self._openai_error_response(exc.status, str(exc), "server_error", "overloaded")
            reply.headers = refusal_headers(exc)
            return reply

    def _proxy(self, session_id: str, meta: dict[str, Any], body: memoryview) -> Any:
        method, path, query, headers = (meta.get(k) for k in ("method", "path", "query", "headers"))
        if not (isinstance(method, str) and isinstance(path, str) and isinstance(query, str)
                and isinstance(headers, dict)):
            return self._error_response(400, "op 'proxy' needs method, path, query and headers")
        return self._core.proxy(session_id, method, path, query, bytes(body), headers)
