"""The thin multi-process router: a Flask app that hash-routes sessions to worker processes.

``webapp.router:create_app()`` is the gunicorn app (gevent worker class, one gunicorn
worker: the session workers belong to it). It imports neither the session core nor any
tokenizer; it mints session ids, picks the owning shard with
:func:`webapp.sharding.shard_for`, streams a chat's request body on to the worker as it
arrives (bounded memory, see :meth:`webapp.ipc_channel.IpcClient.request`), and relays the worker's status, content type, headers and
body without parsing them — a streamed records body goes out chunk by chunk as it arrives.

Configuration: a :class:`RouterConfig`, or the ``SHINKEN_*`` environment variables read by
:meth:`RouterConfig.from_env` (that is how ``shinken-session-server`` passes it through
gunicorn). See ``docs/session-server-ops.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import gevent
from flask import Flask, Response, has_request_context, request
from werkzeug.exceptions import HTTPException, MethodNotAllowed
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.wrappers import Response as WerkzeugResponse  # a file reply's (webapp.filebody)

from webapp.auth import require_api_key
from webapp.backend_liveness import probe_backend
from webapp.body_handoff import MAX_AHEAD_BYTES, HandedBody, handed_body_error
from webapp.bulk import bulk_turn
from webapp.datadir import default_data_dir, lock_data_dir
from webapp.datadir import instance_id as data_dir_instance_id
from webapp.errors import WebappError
from webapp.filebody import decode_layout, file_response
from webapp.http_limits import READ_CHUNK, HttpLimits, discard_body, iter_request_body, take_request_socket
from webapp.inflight import InflightBudget, InflightRefused, refusal_headers
from webapp.ipc import INLINE_BODY_MAX, Buffer, FrameTooLarge, IpcError, Op
from webapp.ipc_channel import IpcReply
from webapp.routes import (
    IMAGES_QUERY,
    PROXY_HEADERS,
    ROUTES,
    Body,
    Route,
    anthropic_error_body,
    is_anthropic_path,
    is_openai_path,
    no_route_message,
    openai_error_body,
    wants_images,
)
from webapp.scaleout import check_instance_tag
from webapp.send_pace import Pacer
from webapp.settings import BY_NAME, MAX_BODY_BYTES, Scope, default, scope_values, values_from_env
from webapp.sharding import mint_session_id, shard_for
from webapp.supervisor import ShardUnavailable, SlotState, Supervisor, SupervisorConfig
from webapp.viewer_http import install_viewer
from webapp.viewer_shape import is_viewer_path

__all__ = ["API_KEY_ENV", "RouterConfig", "Shards", "create_app", "start_supervisor", "stop_supervisor"]

log = logging.getLogger(__name__)

API_KEY_ENV: str = BY_NAME["api_key"].env_var or ""
_EXTENSION = "shinken_supervisor"
# Headers the router's own server owns; a worker's copy would duplicate them.
_OWN_HEADERS = frozenset({"server", "date", "content-length", "content-type", "transfer-encoding",
                          "connection", "keep-alive"})


@dataclass
class RouterConfig:
    """The ``router`` settings of :data:`webapp.settings.SETTINGS` (defaults and docs there),
    plus ``core``: the ``core`` settings every worker's ``CoreConfig`` is built from (given
    ones; :meth:`supervisor_config` fills in the rest from the table, so the whole config
    reaches the workers)."""

    workers: int = default("workers")
    core: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = default("api_key")  # None: no auth; else a bearer on all but /health
    control_timeout: float = default("control_timeout")
    chat_margin: float = default("chat_margin")
    health_timeout: float = default("health_timeout")
    chunk_timeout: float = default("chunk_timeout")
    startup_timeout: float = default("startup_timeout")
    heartbeat_interval: float = default("heartbeat_interval")
    heartbeat_timeout: float = default("heartbeat_timeout")
    busy_timeout: float = default("busy_timeout")
    boot_attempts: int = default("boot_attempts")
    instance: str | None = default("instance")  # tag minted into session ids behind nginx (webapp.scaleout)
    records_get_pace: float = default("records_get_pace")  # MiB/s while other requests are in flight; 0: off

    def __post_init__(self) -> None:
        if self.instance is not None:
            check_instance_tag(self.instance)
        self.core = scope_values(Scope.CORE, self.core)
        if not self.core["backend_url"]:
            raise ValueError(f"the router needs a backend URL ({BY_NAME['backend_url'].env_var})")

    @property
    def backend_url(self) -> str:
        return str(self.core["backend_url"])

    @property
    def chat_timeout(self) -> float:
        timeout: float = self.core["connect_timeout"] + self.core["read_timeout"] + self.chat_margin  # floats
        return timeout

    @property
    def chat_budget(self) -> float:
        """What the worker's turn may take (lock wait + backend call): half the margin less
        than :attr:`chat_timeout`, the other half left for the body and reply on the channel,
        so the worker's own 503/502 arrives before the router answers 504."""
        budget: float = self.core["connect_timeout"] + self.core["read_timeout"] + self.chat_margin / 2
        return budget

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RouterConfig:
        """Every ``router`` and ``core`` setting from ``SHINKEN_<NAME>``.

        Raises ``ValueError`` without a backend URL or for a variable that does not parse.
        """
        values = values_from_env(environ, (Scope.ROUTER, Scope.CORE))
        core = {name: values.pop(name) for name in list(values) if BY_NAME[name].scope is Scope.CORE}
        return cls(core=core, **values)

    def supervisor_config(self) -> SupervisorConfig:
        return SupervisorConfig(
            workers=self.workers, core=dict(self.core), startup_timeout=self.startup_timeout,
            heartbeat_interval=self.heartbeat_interval, heartbeat_timeout=self.heartbeat_timeout,
            busy_timeout=self.busy_timeout, boot_attempts=self.boot_attempts)


def _error(status: int, message: str, **extra: object) -> Response:
    """The router's own error, in the shape of the route: OpenAI's under ``/sessions/<id>/v1/``
    (``code`` from the status, ``extra`` beside the error object), Anthropic's on its Messages
    route, else miles'."""
    if has_request_context() and is_anthropic_path(request.path):
        obj: dict[str, object] = {**anthropic_error_body(status, message), **extra}
    elif has_request_context() and is_openai_path(request.path):
        code = HTTP_STATUS_CODES.get(status, "error").lower().replace(" ", "_")
        obj = {**openai_error_body(message, "server_error" if status >= 500 else "invalid_request_error", code),
               **extra}
    else:
        obj = {"error": message, **extra}
    return Response(json.dumps(obj, separators=(",", ":")), status=status, content_type="application/json")


def _relay(reply: IpcReply) -> WerkzeugResponse:
    headers = [(k, v) for k, v in reply.headers if k.lower() not in _OWN_HEADERS]
    if reply.file_layout is not None:
        return _relay_file(reply, headers)
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


def _relay_file(reply: IpcReply, headers: list[tuple[str, str]]) -> WerkzeugResponse:
    """A records GET: the worker named where the records are; this process sends them from the
    journal with sendfile (webapp.filebody), so no record byte crosses the worker channel."""
    inline = reply.body if reply.stream is None else b"".join(_stream_body(reply))
    assert reply.file_layout is not None
    try:
        pieces = decode_layout(inline, reply.file_layout)
        return file_response(pieces, status=reply.status, content_type=reply.content_type, headers=headers,
                             environ=request.environ)
    except FileNotFoundError:  # deleted between the worker's answer and now: gone (410), as the next request says
        sid = (request.view_args or {}).get("session_id", "")  # (webapp.session_errors.SessionGone's prefix)
        return _error(410, f"session reclaimed: session_id={sid} (deleted during the request)")
    except (TypeError, ValueError) as exc:
        log.error("malformed file layout from a worker: %s", exc)
        return _error(502, f"malformed reply from the session worker: {exc}")


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


def _worker_processes(config: RouterConfig) -> Shards:
    return Supervisor(config.supervisor_config())


def start_supervisor(app: Flask) -> None:
    """Start the app's session workers (gunicorn's ``post_worker_init``; else on first use).

    A no-op for the single-process app's in-process shard.
    """
    supervisor = getattr(app, "extensions", {}).get(_EXTENSION)
    if supervisor is not None:
        supervisor.start()


def stop_supervisor(app: Flask) -> None:
    """Stop the app's session workers, leaving no process behind; a no-op without any."""
    supervisor = getattr(app, "extensions", {}).get(_EXTENSION)
    if supervisor is not None:
        supervisor.stop()


def _gathered(pieces: Iterable[Buffer]) -> Buffer:
    """A body as one buffer: its one piece itself, else its pieces joined."""
    gathered = list(pieces)
    return gathered[0] if len(gathered) == 1 else b"".join(gathered)


class Shards(Protocol):
    """What the router asks of the processes that own the sessions: a
    :class:`~webapp.supervisor.Supervisor` of worker subprocesses (``--workers N``), or
    ``webapp.local_shard.LocalShard``, one shard in this process (``--workers 0``)."""

    @property
    def workers(self) -> int: ...

    @property
    def takes_body_sockets(self) -> bool:
        """True: a large body goes to its worker as the client's connection (``body_socket``).
        False: the shard is in this process and parses every body whole, so the router hands
        it a body of known length as one buffer."""

    def request(self, shard: int, meta: dict[str, Any], body: Buffer | Sequence[Buffer] = b"", *,
                timeout: float, chunk_timeout: float = 60.0, body_stream: Iterable[Buffer] | None = None,
                body_length: int | None = None, body_socket: HandedBody | None = None,
                body_timeout: float = 60.0) -> IpcReply: ...

    def status(self) -> list[dict[str, Any]]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def create_app(config: RouterConfig | None = None, http_limits: HttpLimits | None = None, *,
               shards: Callable[[RouterConfig], Shards] | None = None) -> Flask:
    """The router app; with no ``config``, :meth:`RouterConfig.from_env` (and
    :meth:`HttpLimits.from_env` without ``http_limits``).

    ``shards`` builds what owns the sessions from the final config, once the data directory is
    locked (default: a :class:`~webapp.supervisor.Supervisor` of ``config.workers`` worker
    subprocesses; ``webapp.app`` passes one in-process shard). Every route, limit and error is
    this function's in either case.
    """
    config = config if config is not None else RouterConfig.from_env()
    http_limits = http_limits if http_limits is not None else HttpLimits.from_env()
    # The data directory is this router's alone (its workers write it, one shard each); they
    # all get its resolved path, so an unset data_dir means one place for every process.
    data_dir = os.path.abspath(config.core.get("data_dir") or default_data_dir())
    config = dataclasses.replace(config, core={**config.core, "data_dir": data_dir})
    lock_data_dir(data_dir)
    supervisor: Shards = (shards or _worker_processes)(config)
    app = Flask("webapp.router")
    app.extensions[_EXTENSION] = supervisor
    app.config["SHINKEN_ROUTER"] = config
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES  # refused (413) before reading more
    # miles' session_server_instance_id: the data directory's (webapp.datadir), so it changes
    # exactly when the sessions a client holds are gone, not when the server restarts.
    instance_id = data_dir_instance_id(data_dir)
    inflight = InflightBudget(config.core["max_inflight_bytes"])

    def call(session_id: str, op: Op, body: Buffer = b"", body_stream: Iterator[Buffer] | None = None,
             body_length: int | None = None, timeout: float | None = None, body_socket: HandedBody | None = None,
             **meta: object) -> WerkzeugResponse:
        shard = shard_for(session_id, supervisor.workers)
        try:
            reply = supervisor.request(shard, {"op": op, "session_id": session_id, **meta}, body,
                                       timeout=timeout or config.control_timeout,
                                       chunk_timeout=config.chunk_timeout, body_stream=body_stream,
                                       body_length=body_length, body_socket=body_socket,
                                       body_timeout=http_limits.body_timeout)
        except FrameTooLarge as exc:  # the request itself was refused: no shard to blame
            return _error(exc.status, str(exc))
        except WebappError as exc:  # one rule for every layer's error: its own status (webapp.errors)
            body_error = handed_body_error(exc) if body_socket is not None else None
            if body_error is not None:  # the worker's read of a handed-off body: answered as ours
                return _error(body_error.status, str(body_error))
            text = str(exc) if isinstance(exc, ShardUnavailable) else f"session worker for shard {shard}: {exc}"
            return _error(exc.status, text, shard=shard)
        return _relay(reply)

    require_api_key(app, config.api_key, _error, checks_itself=is_viewer_path)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        if exc.code == 404 and request.url_rule is None:  # no route: say which there are
            return _error(404, no_route_message(request.method, request.path, request.host_url))
        response = _error(exc.code or 500, exc.description or exc.name)
        if exc.code == 405 and isinstance(exc, MethodNotAllowed) and exc.valid_methods:  # werkzeug's 405
            response.headers["Allow"] = ", ".join(sorted(exc.valid_methods))  # werkzeug gives a set
        return response

    @app.errorhandler(WebappError)
    def _webapp_error(exc: WebappError) -> Response:  # e.g. a BodyError while reading a body
        return _error(exc.status, str(exc))

    def health() -> Response:
        damage: dict[int, int] = {}  # journal sidecars per shard (webapp.journal): ops must see them

        def ask(shard: int) -> str | None:
            try:
                reply = supervisor.request(shard, {"op": Op.HEALTH}, timeout=config.health_timeout)
            except WebappError as exc:
                return str(exc)
            if reply.status != 200:
                return f"health status {reply.status}"
            try:
                damage[shard] = int(json.loads(reply.body).get("journal_damage") or 0)
            except (TypeError, ValueError, AttributeError):
                pass
            return None

        jobs = [gevent.spawn(ask, shard) for shard in range(supervisor.workers)]
        backend_job = gevent.spawn(probe_backend, config.backend_url, config.health_timeout)
        gevent.joinall([*jobs, backend_job], timeout=config.health_timeout + 1.0)
        backend_problem = (backend_job.value if backend_job.successful()
                           else f"backend probe failed: {backend_job.exception!r}" if backend_job.ready()
                           else "backend probe timed out")
        # A probe that crashed (any exception ``ask`` does not expect) is a problem too.
        problems = {shard: ("health check timed out" if not job.ready()
                            else f"health check failed: {job.exception!r}" if job.exception is not None
                            else job.value)
                    for shard, job in enumerate(jobs)}
        # failed_shards: never restarted (their workers could not boot); the launcher gives up on
        # them. A slot may turn FAILED after its probe answered "unavailable": the slot's own
        # reason (why it could not boot) is the final word for it, read once, after the probes.
        failed_why = {slot["shard"]: slot["reason"] for slot in supervisor.status()
                      if slot["state"] == SlotState.FAILED.value}
        problems.update(failed_why)
        bad = {shard: why for shard, why in problems.items() if why is not None}
        if bad:
            detail = "; ".join(f"shard {shard}: {why}" for shard, why in sorted(bad.items()))
            if backend_problem is not None:
                detail += f"; {backend_problem}"
            failed = sorted(failed_why)
            return _error(503, f"unhealthy shards: {detail}", unhealthy_shards=sorted(bad), failed_shards=failed,
                          backend="ok" if backend_problem is None else "unreachable")
        if backend_problem is not None:
            return _error(503, backend_problem, unhealthy_shards=[], backend="unreachable")
        return Response(json.dumps({"status": "ok", "backend": "ok", "session_server_instance_id": instance_id,
                                    "instance": config.instance, "journal_damage": sum(damage.values())}),
                        status=200, content_type="application/json")

    def chat_body_call(session_id: str, op: Op, timeout: float, **meta: Any) -> WerkzeugResponse:
        length = request.content_length
        try:  # the server's bodies in flight, across its shards (webapp.inflight)
            with inflight.admit(length) as grant:
                stream = request.stream  # werkzeug's size check first: over MAX_CONTENT_LENGTH is 413 unread
                if length is not None and length > INLINE_BODY_MAX and supervisor.takes_body_sockets:
                    # The worker receives it from the connection itself (webapp.body_handoff).
                    handed = take_request_socket(request.environ.get("wsgi.input"), length, MAX_AHEAD_BYTES)
                    if handed is not None:
                        with contextlib.closing(handed):  # ended by the channel, else abandoned here
                            return call(session_id, op, body_socket=handed, timeout=timeout, **meta)
                # A body of known length sent whole (one frame to a worker: the common chat; or
                # any size to a shard in this process, which parses it whole) is received into
                # one buffer of that length, passed on as it is: no pieces joined in a copy.
                whole = length is not None and (length <= INLINE_BODY_MAX or not supervisor.takes_body_sockets)
                pieces = grant.metered(iter_request_body(stream, request.environ.get("wsgi.input"),
                                                         http_limits.body_timeout, length,
                                                         chunk=max(length or 0, 1) if whole else READ_CHUNK))
                if whole:
                    return call(session_id, op, _gathered(pieces), timeout=timeout, **meta)
                # Streamed on to the shard as it arrives: the router never holds a whole large body.
                return call(session_id, op, body_stream=pieces, body_length=length, timeout=timeout, **meta)
        except InflightRefused as exc:
            discard_body(request.stream, http_limits.body_timeout, length, request.environ.get("wsgi.input"))
            response = _error(exc.status, str(exc))
            response.headers.extend(refusal_headers(exc))
            return response

    def op_meta(route: Route, path: str | None) -> dict[str, Any]:
        """What the shard needs besides the session and the body (docs/ipc.md, per op)."""
        meta: dict[str, Any] = {}
        if route.images:
            meta["images"] = wants_images(request.args.get(IMAGES_QUERY))
        if route.body is Body.CHAT:  # a turn: the worker's own 503/502 arrives before this router's 504
            meta["budget"] = config.chat_budget
        if route.op is Op.PROXY:
            meta.update(method=request.method, path=path, query=request.query_string.decode(),
                        headers={k: v for k, v in request.headers.items() if k.lower() in PROXY_HEADERS})
        elif route.headers:  # the route table's request headers (webapp.routes.Route.headers)
            meta["headers"] = {name.lower(): request.headers[name] for name in route.headers if name in request.headers}
        return meta

    def view(route: Route) -> Callable[..., WerkzeugResponse]:
        op = route.op
        assert op is not None
        timeout = config.chat_timeout if route.backend else config.control_timeout

        def serve(session_id: str | None = None, path: str | None = None) -> WerkzeugResponse:
            if op is Op.CREATE_SESSION:  # the router mints it, so it names the shard that owns it
                session_id = mint_session_id(config.instance)
            assert session_id is not None
            meta = op_meta(route, path)
            if route.body is Body.CHAT:
                return chat_body_call(session_id, op, timeout, **meta)
            # A body relayed in one frame, read within the body timeout like a chat's.
            body = (b"".join(iter_request_body(request.stream, request.environ.get("wsgi.input"),
                                               http_limits.body_timeout, request.content_length))
                    if route.body is Body.SMALL else b"")
            return call(session_id, op, body, timeout=timeout, **meta)

        return serve

    for route in ROUTES:  # the route table (webapp.routes): every route of both server modes
        app.add_url_rule(route.path, route.endpoint, health if route.op is None else view(route),
                         methods=list(route.methods))

    # This process sends every records GET (both modes): paced while it serves other requests.
    app.wsgi_app = Pacer(config.records_get_pace).counting(app.wsgi_app)  # type: ignore[method-assign,assignment]
    install_viewer(app, _RouterViewerSource(supervisor, config, call), api_key=config.api_key,
                   instance=config.instance)
    return app


class _RouterViewerSource:
    """The viewer's session reads in router mode: the owning worker answers (ops ``viewer_*``);
    the list asks every shard at once and merges (``webapp.viewer_http``)."""

    def __init__(self, supervisor: Shards, config: RouterConfig, call: Callable[..., WerkzeugResponse]) -> None:
        self._supervisor, self._config, self._call = supervisor, config, call

    def sessions(self, prefix: str) -> tuple[list[dict[str, Any]], list[str]]:
        def ask(shard: int) -> list[dict[str, Any]]:
            reply = self._supervisor.request(shard, {"op": Op.VIEWER_SESSIONS, "prefix": prefix},
                                             timeout=self._config.control_timeout)
            body = reply.body if reply.stream is None else b"".join(reply.stream)
            if reply.status != 200:
                raise ShardUnavailable(shard, f"status {reply.status}")
            return list(json.loads(body)["sessions"])

        jobs = [gevent.spawn(ask, shard) for shard in range(self._supervisor.workers)]
        gevent.joinall(jobs, timeout=self._config.control_timeout + 1.0)
        rows: list[dict[str, Any]] = []
        problems = []
        for shard, job in enumerate(jobs):
            if job.successful():
                rows += job.value
            else:  # one shard down costs its rows only, named on the page
                problems.append(f"shard {shard}: {job.exception if job.ready() else 'timed out'}")
                job.kill(block=False)
        return rows, problems

    def summary(self, session_id: str) -> WerkzeugResponse:
        return self._call(session_id, Op.VIEWER_SUMMARY)

    def timeline(self, session_id: str) -> WerkzeugResponse:
        return self._call(session_id, Op.VIEWER_TIMELINE)

    def image(self, session_id: str, sha256: str) -> WerkzeugResponse:
        return self._call(session_id, Op.VIEWER_IMAGE, sha256=sha256)
