# ruff: noqa: N999  (gunicorn looks for this file name)
"""gunicorn settings for ``shinken-session-server`` (router and single-process modes).

One gunicorn worker with the gevent worker class: in router mode that worker owns the
session worker subprocesses, so a second one would hold a second, disjoint set of sessions.
The hooks start the session workers after gevent's patching (``post_worker_init`` runs in
the worker, after patching; never in the master) and stop them when the worker exits.
"""

worker_class = "gevent"
workers = 1
worker_connections = 2000
control_socket_disable = True
graceful_timeout = 20
keepalive = 5


def post_worker_init(worker):
    from webapp.router import start_supervisor

    start_supervisor(worker.wsgi)


def worker_exit(server, worker):
    from webapp.router import stop_supervisor

    stop_supervisor(worker.wsgi)


def post_fork(server, worker):
    # The router worker dies with the gunicorn master however the master dies (SIGTERM: the
    # worker's graceful stop runs worker_exit, which stops the session workers).
    import signal

    from shinken_sync.lifetime import die_with_parent

    die_with_parent(server.pid, signal.SIGTERM)
