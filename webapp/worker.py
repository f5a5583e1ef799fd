"""Session worker subprocess: one session core, driven over IPC by the router.

Started by :mod:`webapp.supervisor` with the multiprocessing *spawn* context; :func:`run` is
the process target. It monkey-patches with gevent before anything else runs, then serves
every request in its own greenlet, so blocking ``core.chat`` calls (backend I/O through
``requests``) overlap. This module imports nothing of the session core at import time: the
router imports it (to name the spawn target) and must stay free of the core and tokenizers.

Ops (``meta["op"]``): ``ping`` (heartbeat, answered by the hub without touching the core),
``health``, ``create_session``, ``get_session``, ``delete_session``, ``chat`` (body = the
client's request body; optional ``budget``: seconds the turn may take, see
``SessionCore.chat``), ``samples`` (body = the client's ``{"max_seq_len": ...}``) and
``proxy`` (``method``, ``path``, ``query``, ``headers``; body = the client's body). Every op but ``ping``/``health`` names a ``session_id`` that must
hash to this worker's shard.

The worker dies with its parent three ways: ``PR_SET_PDEATHSIG`` (SIGKILL), a parent-pid
watch every second, and EOF on the channel (the router closing it, or dying).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

from shinken_sync.lifetime import die_with_parent

__all__ = ["PROCESS_TITLE", "run"]

PROCESS_TITLE = "shinken-session-worker[{shard}/{shards}]"
_PARENT_CHECK_INTERVAL = 1.0

log = logging.getLogger("webapp.worker")


def run(conn: Any, shard: int, shards: int, core_config: dict[str, Any], parent_pid: int) -> None:
    """Process target: serve the session core for ``shard`` of ``shards`` over ``conn``.

    ``conn`` is this end of a multiprocessing duplex ``Pipe`` (a socketpair on Linux);
    only its file descriptor is used, with :mod:`webapp.ipc` framing. ``core_config`` holds
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
    fd = os.dup(conn.fileno())
    conn.close()
    sys.exit(_serve(fd, shard, shards, core_config, parent_pid))


def _serve(fd: int, shard: int, shards: int, core_config: dict[str, Any], parent_pid: int) -> int:
    from webapp.core import CoreConfig, build_session_core
    from webapp.ipc_channel import IpcServer, open_socket

    core = build_session_core(CoreConfig(**core_config))
    server = IpcServer(open_socket(fd), SessionOps(core, shard, shards), name=f"worker[{shard}/{shards}]")
    log.info("serving shard %d of %d (pid %d)", shard, shards, os.getpid())
    try:
        while server.wait_closed(_PARENT_CHECK_INTERVAL) is None:
            server.receive_pool.trim()  # an idle worker gives its large receive buffers back
            if os.getppid() != parent_pid:
                log.warning("parent %d is gone; exiting", parent_pid)
                return 1
        log.info("channel closed (%s); exiting", server.closed.reason)
        return 0
    finally:
        server.close()
        core.close()


class SessionOps:
    """Maps IPC ops to session-core calls; each returns a ``webapp.core.Reply``."""

    def __init__(self, core: Any, shard: int, shards: int) -> None:
        from webapp import core as core_module
        from webapp.sharding import shard_for

        self._core = core
        self._shard = shard
        self._shards = shards
        self._shard_for = shard_for
        self._json_response = core_module.json_response
        self._error_response = core_module.error_response

    def __call__(self, meta: dict[str, Any], body: memoryview) -> Any:
        op = meta.get("op")
        if op == "ping":
            return self._json_response(200, {"shard": self._shard, "pid": os.getpid()})
        if op == "health":
            return self._core.health()
        session_id = meta.get("session_id")
        if not isinstance(session_id, str):
            return self._error_response(400, f"op {op!r} needs a session_id")
        owner = self._shard_for(session_id, self._shards)
        if owner != self._shard:  # a routing bug must be loud, not a silent 404
            return self._error_response(500, f"session {session_id} belongs to shard {owner}, "
                                             f"not {self._shard}")
        if op == "chat":
            budget = meta.get("budget")
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                       or not budget > 0):
                return self._error_response(400, f"op 'chat' needs a positive number as budget, got {budget!r}")
            return self._core.chat(session_id, bytes(body), budget)
        if op == "create_session":
            return self._core.create_session(session_id)
        if op == "get_session":
            return self._core.get_session(session_id, include_images=meta.get("images") is True)
        if op == "delete_session":
            return self._core.delete_session(session_id)
        if op == "samples":
            return self._core.samples(session_id, bytes(body), include_images=meta.get("images") is True)
        if op == "proxy":
            method, path, query, headers = (meta.get(k) for k in ("method", "path", "query", "headers"))
            if not (isinstance(method, str) and isinstance(path, str) and isinstance(query, str)
                    and isinstance(headers, dict)):
                return self._error_response(400, "op 'proxy' needs method, path, query and headers")
            return self._core.proxy(session_id, method, path, query, bytes(body), headers)
        return self._error_response(400, f"unknown op {op!r}")
