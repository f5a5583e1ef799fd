"""The thin multi-process router: a Flask app that hash-routes sessions to worker processes.

``webapp.router:create_app()`` is the gunicorn app (gevent worker class, one gunicorn
worker: the session workers belong to it). It imports neither the session core nor any
tokenizer; it mints session ids, picks the owning shard with
:func:`webapp.sharding.shard_for`, and relays the worker's status, content type, headers and
body without parsing them — a streamed records body goes out chunk by chunk as it arrives.

Configuration: a :class:`RouterConfig`, or the ``SHINKEN_*`` environment variables read by
:meth:`RouterConfig.from_env` (that is how ``shinken-session-server`` passes it through
gunicorn). See ``docs/session-server-ops.md``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import gevent
from flask import Flask, Response, has_request_context, request
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES

from webapp.ipc import FrameTooLarge, IpcError, IpcRemoteError, IpcTimeout
from webapp.ipc_channel import IpcReply, bulk_turn
from webapp.routes import PROXY_HEADERS, PROXY_METHODS, is_openai_path, openai_error_body
from webapp.scaleout import INSTANCE_ENV, check_instance_tag
from webapp.settings import float_settings_from_env, replay_settings_from_env
from webapp.sharding import mint_session_id, shard_for
from webapp.supervisor import ShardUnavailable, Supervisor, SupervisorConfig

__all__ = ["API_KEY_ENV", "RouterConfig", "create_app", "start_supervisor", "stop_supervisor"]

log = logging.getLogger(__name__)

API_KEY_ENV = "SHINKEN_API_KEY"
_EXTENSION = "shinken_supervisor"
# Mirrors the session core's chat body limit, so the router refuses (413) before reading more.
MAX_REQUEST_BODY_BYTES = 256 << 20
# Headers the router's own server owns; a worker's copy would duplicate them.
_OWN_HEADERS = frozenset({"server", "date", "content-length", "content-type", "transfer-encoding",
                          "connection", "keep-alive"})


@dataclass
class RouterConfig:
    workers: int
    backend_url: str
    tokenizer: str | None = None
    api_key: str | None = None  # None: no auth; else required as a bearer on all but /health
    connect_timeout: float = 5.0  # backend connect, per turn (the worker's core)
    read_timeout: float = 600.0  # backend read, per turn
    control_timeout: float = 30.0  # deadline of create/get head/delete
    chat_margin: float = 60.0  # a chat's deadline is connect + read timeouts + this
    health_timeout: float = 2.0  # /health asks every worker with this deadline
    chunk_timeout: float = 60.0  # a streamed body chunk must arrive within this
    startup_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    routing_replay_layers: int = 0  # the workers' replay settings (webapp.settings.REPLAY_SETTINGS)
    indexer_replay: bool = False
    instance: str | None = None  # tag minted into session ids behind nginx (webapp.scaleout)

    @property
    def chat_timeout(self) -> float:
        return self.connect_timeout + self.read_timeout + self.chat_margin

    @property
    def chat_budget(self) -> float:
        """What the worker's turn may take (lock wait + backend call): half the margin less
        than :attr:`chat_timeout`, the other half left for the body and reply on the channel,
        so the worker's own 503/502 arrives before the router answers 504."""
        return self.connect_timeout + self.read_timeout + self.chat_margin / 2

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RouterConfig:
        """``SHINKEN_WORKERS``, ``SHINKEN_BACKEND_URL``, ``SHINKEN_TOKENIZER``, ``SHINKEN_API_KEY``,
        ``SHINKEN_INSTANCE``,
        and ``SHINKEN_<FIELD>`` (upper case) for every float field."""
        env = os.environ if environ is None else environ
        try:
            backend_url = env["SHINKEN_BACKEND_URL"]
        except KeyError:
            raise ValueError("SHINKEN_BACKEND_URL is not set") from None
        return cls(workers=int(env.get("SHINKEN_WORKERS", "1")), backend_url=backend_url,
                   tokenizer=env.get("SHINKEN_TOKENIZER") or None, api_key=env.get(API_KEY_ENV) or None,
                   instance=check_instance_tag(env[INSTANCE_ENV]) if env.get(INSTANCE_ENV) else None,
                   **float_settings_from_env(cls, env), **replay_settings_from_env(env))

    def supervisor_config(self) -> SupervisorConfig:
        return SupervisorConfig(
            workers=self.workers,
            core={"backend_url": self.backend_url, "tokenizer": self.tokenizer,
                  "connect_timeout": self.connect_timeout, "read_timeout": self.read_timeout,
                  "routing_replay_layers": self.routing_replay_layers, "indexer_replay": self.indexer_replay},
            startup_timeout=self.startup_timeout, heartbeat_interval=self.heartbeat_interval,
            heartbeat_timeout=self.heartbeat_timeout)


def _error(status: int, message: str, **extra: object) -> Response:
    """The router's own error, in the shape of the route: OpenAI's under ``/sessions/<id>/v1/``
    (``code`` from the status, ``extra`` beside the error object), else miles'."""
    if has_request_context() and is_openai_path(request.path):
        code = HTTP_STATUS_CODES.get(status, "error").lower().replace(" ", "_")
        obj: dict[str, object] = {**openai_error_body(message, "server_error" if status >= 500
                                                      else "invalid_request_error", code), **extra}
    else:
        obj = {"error": message, **extra}
    return Response(json.dumps(obj, separators=(",", ":")), status=status, content_type="application/json")


def _relay(reply: IpcReply) -> Response:
    headers = [(k, v) for k, v in reply.headers if k.lower() not in _OWN_HEADERS]
    if reply.stream is None:
        response = Response(reply.body, status=reply.status, headers=headers)
    else:
        response = Response(_stream_body(reply), status=reply.status, headers=headers, direct_passthrough=True)
        response.headers["Content-Length"] = str(reply.length)
        # A HEAD reply never starts the generator (closing it then skips its ``finally``), so
        # the stream must be closed by the response too, or the worker streams on to its window.
        response.call_on_close(reply.stream.close)
    if reply.content_type:
        response.headers["Content-Type"] = reply.content_type
    else:
        del response.headers["Content-Type"]
    return response


def _stream_body(reply: IpcReply) -> Iterator[bytes]:
    stream = reply.stream
    assert stream is not None
    try:
        for piece in stream:
            bulk_turn()  # chats in this process go first; see docs/ipc.md
            yield piece
    except IpcError as exc:
        # Headers are gone: the short body (Content-Length) tells the client it failed.
        log.error("streamed body of %d bytes cut after %d: %s", reply.length, stream.consumed, exc)
        raise
    finally:
        stream.close()


def start_supervisor(app: Flask) -> None:
    """Start the app's session workers (gunicorn's ``post_worker_init``; else on first use).

    A no-op for an app without any (the single-process ``webapp.app``).
    """
    supervisor = getattr(app, "extensions", {}).get(_EXTENSION)
    if supervisor is not None:
        supervisor.start()


def stop_supervisor(app: Flask) -> None:
    """Stop the app's session workers, leaving no process behind; a no-op without any."""
    supervisor = getattr(app, "extensions", {}).get(_EXTENSION)
    if supervisor is not None:
        supervisor.stop()


def create_app(config: RouterConfig | None = None) -> Flask:
    """The router app; with no ``config``, :meth:`RouterConfig.from_env`."""
    config = config if config is not None else RouterConfig.from_env()
    supervisor = Supervisor(config.supervisor_config())
    app = Flask("webapp.router")
    app.extensions[_EXTENSION] = supervisor
    app.config["SHINKEN_ROUTER"] = config
    app.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BODY_BYTES
    expected_auth = f"Bearer {config.api_key}".encode() if config.api_key else None
    # miles' session_server_instance_id: this router process (its workers' sessions live and
    # die with it), so a client can tell after a restart that its sessions are gone.
    instance_id = uuid.uuid4().hex

    def call(session_id: str, op: str, body: bytes = b"", timeout: float | None = None,
             **meta: object) -> Response:
        shard = shard_for(session_id, supervisor.workers)
        try:
            reply = supervisor.request(shard, {"op": op, "session_id": session_id, **meta}, body,
                                       timeout=timeout or config.control_timeout,
                                       chunk_timeout=config.chunk_timeout)
        except ShardUnavailable as exc:
            return _error(503, str(exc), shard=shard)
        except IpcTimeout as exc:
            return _error(504, f"session worker for shard {shard} did not answer in time: {exc}", shard=shard)
        except FrameTooLarge as exc:
            return _error(413, str(exc))
        except IpcRemoteError as exc:
            status = 503 if exc.worker_busy else 500
            return _error(status, f"session worker for shard {shard} failed: {exc}", shard=shard)
        return _relay(reply)

    @app.before_request
    def _check_api_key() -> Response | None:
        if expected_auth is None or request.path == "/health":
            return None
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, expected_auth):
            return None
        response = _error(401, "missing or invalid API key (expected 'Authorization: Bearer <key>')")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        response = _error(exc.code or 500, exc.description or exc.name)
        if exc.code == 405 and exc.valid_methods:
            response.headers["Allow"] = ", ".join(exc.valid_methods)
        return response

    @app.get("/health")
    def health() -> Response:
        def ask(shard: int) -> str | None:
            try:
                reply = supervisor.request(shard, {"op": "health"}, timeout=config.health_timeout)
            except (ShardUnavailable, IpcError) as exc:
                return str(exc)
            return None if reply.status == 200 else f"health status {reply.status}"

        jobs = [gevent.spawn(ask, shard) for shard in range(supervisor.workers)]
        gevent.joinall(jobs, timeout=config.health_timeout + 1.0)
        # A probe that crashed (any exception ``ask`` does not expect) is a problem too.
        problems = {shard: ("health check timed out" if not job.ready()
                            else f"health check failed: {job.exception!r}" if job.exception is not None
                            else job.value)
                    for shard, job in enumerate(jobs)}
        bad = {shard: why for shard, why in problems.items() if why is not None}
        if bad:
            detail = "; ".join(f"shard {shard}: {why}" for shard, why in sorted(bad.items()))
            return _error(503, f"unhealthy shards: {detail}", unhealthy_shards=sorted(bad))
        return Response(json.dumps({"status": "ok", "session_server_instance_id": instance_id,
                                   "instance": config.instance}),
                        status=200, content_type="application/json")

    @app.post("/sessions")
    def create_session() -> Response:
        return call(mint_session_id(config.instance), "create_session")

    @app.get("/sessions/<session_id>")
    def get_session(session_id: str) -> Response:
        return call(session_id, "get_session")

    @app.delete("/sessions/<session_id>")
    def delete_session(session_id: str) -> Response:
        return call(session_id, "delete_session")

    @app.post("/sessions/<session_id>/v1/chat/completions")
    def chat(session_id: str) -> Response:
        return call(session_id, "chat", request.get_data(cache=False), timeout=config.chat_timeout,
                    budget=config.chat_budget)

    @app.post("/sessions/<session_id>/samples")
    def samples(session_id: str) -> Response:
        return call(session_id, "samples", request.get_data(cache=False))

    # miles' catch-all: forwarded to the backend by the owning worker (e.g. ``v1/models``).
    @app.route("/sessions/<session_id>/<path:path>", methods=list(PROXY_METHODS))
    def proxy(session_id: str, path: str) -> Response:
        return call(session_id, "proxy", request.get_data(cache=False), timeout=config.chat_timeout,
                    method=request.method, path=path, query=request.query_string.decode(),
                    headers={k: v for k, v in request.headers.items() if k.lower() in PROXY_HEADERS})

    return app
