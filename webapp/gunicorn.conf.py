# ruff: noqa: N999  (gunicorn looks for this file name)
"""gunicorn settings for ``shinken-session-server`` (router and single-process modes).

One gunicorn worker with the gevent worker class (``webapp.gunicorn_worker``): in router mode that worker owns the
session worker subprocesses, so a second one would hold a second, disjoint set of sessions.
The hooks start the session workers after gevent's patching (``post_worker_init`` runs in
the worker, after patching; never in the master) and stop them when the worker exits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the master must not import the worker class (gevent)
    from gunicorn.arbiter import Arbiter

    from webapp.gunicorn_worker import SessionServerWorker

# gevent, plus a cap on connections per client address (webapp.gunicorn_worker)
worker_class = "webapp.gunicorn_worker.SessionServerWorker"
workers = 1
worker_connections = 4096
control_socket_disable = True
graceful_timeout = 20
# Also bounds the read of each request head (the gevent worker's timeout), so a client
# trickling headers is dropped after this many seconds; bodies: webapp.http_limits.
keepalive = 5


def post_worker_init(worker: SessionServerWorker) -> None:
    from webapp.boot import boot_done
    from webapp.router import start_supervisor

    start_supervisor(worker.wsgi)
    boot_done("http worker", serves_http=True)


def worker_exit(server: Arbiter, worker: SessionServerWorker) -> None:
    from webapp.router import stop_supervisor

    stop_supervisor(worker.wsgi)


def post_fork(server: Arbiter, worker: SessionServerWorker) -> None:
    # The router worker dies with the gunicorn master however the master dies (SIGTERM: the
    # worker's graceful stop runs worker_exit, which stops the session workers).
    import signal

    from shinken_sync.lifetime import die_with_parent

    die_with_parent(server.pid, signal.SIGTERM)
