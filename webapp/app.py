"""The single-process session server: a Flask adapter over one ``SessionCore``.

``gunicorn -k gevent --no-control-socket 'webapp.app:create_app()'`` serves it. Settings come
from the arguments or, when ``config`` is None, from the environment: ``SHINKEN_<NAME>`` for
every ``core``, ``http`` and ``launcher`` setting of :data:`webapp.settings.SETTINGS` (the
same variables ``shinken-session-server`` sets, and the router hands its workers). Without
``SHINKEN_BACKEND_URL`` the app starts the reference backend (``webapp.reference_backend``) as
a subprocess of its own, the embedded default, with ``SHINKEN_REFERENCE_R3_LAYERS`` /
``SHINKEN_REFERENCE_R3_TOPK`` (routing replay follows its R3 unless set).

Errors are ``{"error": "<text>"}`` on the session-management routes and OpenAI's
``{"error": {"message", "type", "code"}}`` under ``/sessions/<id>/v1/``.

The app adds neither ``Server`` nor ``Date``: the WSGI server sends exactly one of each. A
chunked ``Reply`` body is handed to the server as an iterable of its chunks with an explicit
``Content-Length``, so it is written chunk by chunk and never joined; a records GET names
ranges of the session's journal, sent with sendfile (``webapp.filebody``: also HEAD, Range).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from webapp.auth import require_api_key
from webapp.backend_liveness import probe_backend
from webapp.core import (
    MAX_CHAT_BODY_BYTES,
    CoreConfig,
    Reply,
    SessionCore,
    build_session_core,
    error_response,
    json_response,
    openai_error_response,
)
from webapp.datadir import default_data_dir, lock_data_dir
from webapp.errors import WebappError
from webapp.filebody import file_response, has_spans
from webapp.http_limits import HttpLimits, discard_body, iter_body
from webapp.inflight import InflightBudget, InflightRefused, refusal_headers
from webapp.reference_backend import ReferenceBackendProcess, start_reference_backend
from webapp.routes import IMAGES_QUERY, PROXY_METHODS, is_openai_path, no_route_message, wants_images
from webapp.settings import BY_NAME, Scope, embedded_replay_layers, scope_values, values_from_env
from webapp.viewer_data import ViewerData
from webapp.viewer_http import install_viewer
from webapp.viewer_shape import is_viewer_path

__all__ = ["CORE_EXTENSION_KEY", "config_from_env", "create_app", "to_flask_response"]

CORE_EXTENSION_KEY = "shinken_session_core"
API_KEY_ENV: str = BY_NAME["api_key"].env_var or ""
# What the open /health shows, as the router's: no session count (it is answered without a key).
PUBLIC_HEALTH_FIELDS = frozenset({"status", "session_server_instance_id", "journal_damage"})


def to_flask_response(reply: Reply) -> Response:
    if has_spans(reply.chunks):  # a records GET: sent from the journal (webapp.filebody)
        try:
            return file_response(reply.chunks, status=reply.status, content_type=reply.content_type,
                                 headers=reply.headers, environ=request.environ)
        except FileNotFoundError:  # deleted since the core answered
            return to_flask_response(error_response(404, "session not found (deleted during the request)"))
    resp = Response(reply.chunks, status=reply.status)
    if reply.content_type:
        resp.headers["Content-Type"] = reply.content_type
    else:
        del resp.headers["Content-Type"]
    if reply.status != 204:
        resp.headers["Content-Length"] = str(reply.content_length)
    for name, value in reply.headers:
        resp.headers.add(name, value)
    return resp


def config_from_env(environ: Mapping[str, str] | None = None, **kw: Any) -> CoreConfig:
    """The ``CoreConfig`` the environment describes (the ``core`` settings of
    :data:`webapp.settings.SETTINGS`), ``kw`` overriding it; ``backend_url`` may be None (the
    embedded backend: routing replay then follows its R3 unless set)."""
    given = {**values_from_env(environ, (Scope.CORE, Scope.LAUNCHER)), **kw}
    if not given.get("backend_url"):
        given["routing_replay_layers"] = embedded_replay_layers(given)
    return CoreConfig(**scope_values(Scope.CORE, given))


def _config_from_env(kw: dict[str, Any]) -> tuple[CoreConfig, ReferenceBackendProcess | None]:
    config, reference = config_from_env(**kw), None
    if not config.backend_url:
        launcher = scope_values(Scope.LAUNCHER, values_from_env(None, (Scope.LAUNCHER,)))
        reference = start_reference_backend(tokenizer=config.tokenizer, r3_layers=launcher["reference_r3_layers"],
                                            r3_topk=launcher["reference_r3_topk"])
        config = dataclasses.replace(config, backend_url=reference.url)
    return config, reference


def create_app(config: CoreConfig | None = None, *, api_key: str | None = None, **kw: Any) -> Flask:
    """The single-process session server app.

    ``config`` wins; keyword arguments override its fields (or, without it, build one with
    the environment as described in the module docstring). ``api_key`` (else
    ``SHINKEN_API_KEY``): enforced on every route but ``/health``, as the router does
    (``webapp.auth``), so running this app under gunicorn directly never serves unauthenticated.
    """
    if config is None:
        config, reference = _config_from_env(dict(kw))
    else:
        config, reference = dataclasses.replace(config, **kw), None
    config = dataclasses.replace(config, data_dir=os.path.abspath(config.data_dir or default_data_dir()))
    lock_data_dir(config.data_dir)  # this process writes it; a second server must not
    core = build_session_core(config)

    def shutdown() -> None:
        core.close()
        if reference is not None:
            reference.close()

    atexit.register(shutdown)

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_CHAT_BODY_BYTES
    app.config["SHINKEN_CORE"] = config
    app.extensions[CORE_EXTENSION_KEY] = core
    key = api_key or os.environ.get(API_KEY_ENV) or None
    require_api_key(app, key, _auth_error, checks_itself=is_viewer_path)
    _add_routes(app, core, HttpLimits.from_env(), config.backend_url, InflightBudget(config.max_inflight_bytes))
    install_viewer(app, _AppViewerSource(ViewerData(core)), api_key=key, instance=None)
    return app


class _AppViewerSource:
    """The viewer's session reads in the single process: the one core, one shard."""

    def __init__(self, data: ViewerData) -> None:
        self._data = data

    def sessions(self, prefix: str) -> tuple[list[dict[str, Any]], list[str]]:
        return list(json.loads(self._data.sessions(prefix).read())["sessions"]), []

    def summary(self, session_id: str) -> Response:
        return to_flask_response(self._data.summary(session_id))

    def timeline(self, session_id: str) -> Response:
        return to_flask_response(self._data.timeline(session_id))

    def image(self, session_id: str, sha256: str) -> Response:
        return to_flask_response(self._data.image(session_id, sha256))


def _auth_error(status: int, message: str) -> Response:
    if is_openai_path(request.path):
        return to_flask_response(openai_error_response(status, message, "invalid_request_error", "unauthorized"))
    return to_flask_response(error_response(status, message))


def _add_routes(app: Flask, core: SessionCore, http_limits: HttpLimits, backend_url: str,
                inflight: InflightBudget) -> None:
    def admitted(handle: Callable[[bytes], Reply], openai: bool = False) -> Response:
        # The body counts against the process's bytes in flight until its reply is built.
        try:
            with inflight.admit(request.content_length) as grant:
                body = b"".join(grant.metered(iter_body(request.stream, http_limits.body_timeout,
                                                        length=request.content_length)))
                return to_flask_response(handle(body))
        except InflightRefused as exc:
            discard_body(request.stream, http_limits.body_timeout, request.content_length)
            reply = (openai_error_response(exc.status, str(exc), "server_error", "overloaded") if openai
                     else error_response(exc.status, str(exc)))
            reply.headers = refusal_headers(exc)
            return to_flask_response(reply)

    @app.errorhandler(WebappError)
    def webapp_error(exc: WebappError) -> Response:  # e.g. a BodyError while reading a body
        return to_flask_response(error_response(exc.status, str(exc)))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        status, message = exc.code or 500, exc.description or exc.name
        if status == 404 and request.url_rule is None:  # no route: say which there are
            message = no_route_message(request.method, request.path, request.host_url)
        if is_openai_path(request.path):
            code = exc.name.lower().replace(" ", "_")
            return to_flask_response(openai_error_response(status, message, "invalid_request_error", code))
        return to_flask_response(error_response(status, message))

    @app.get("/health")
    def health() -> Response:
        reply = core.health()
        problem = probe_backend(backend_url)
        if reply.status != 200 or problem is None:
            # The router's fields, no more: /health is open even with an API key (webapp.auth).
            body = ({k: v for k, v in json.loads(reply.body).items() if k in PUBLIC_HEALTH_FIELDS}
                    | {"backend": "ok"} if reply.status == 200 else None)
            return to_flask_response(reply if body is None else Reply(200, json.dumps(body).encode()))
        return to_flask_response(json_response(503, {"error": problem, "backend": "unreachable"}))

    @app.post("/sessions")
    def create_session() -> Response:
        return to_flask_response(core.create_session())

    @app.get("/sessions/<session_id>")
    def get_session(session_id: str) -> Response:
        return to_flask_response(core.get_session(session_id, wants_images(request.args.get(IMAGES_QUERY))))

    @app.delete("/sessions/<session_id>")
    def delete_session(session_id: str) -> Response:
        return to_flask_response(core.delete_session(session_id))

    @app.post("/sessions/<session_id>/v1/chat/completions")
    def chat(session_id: str) -> Response:
        return admitted(lambda body: core.chat(session_id, body), openai=True)

    @app.post("/sessions/<session_id>/samples")
    def samples(session_id: str) -> Response:
        images = wants_images(request.args.get(IMAGES_QUERY))
        return admitted(lambda body: core.samples(session_id, body, images))

    @app.route("/sessions/<session_id>/<path:path>", methods=list(PROXY_METHODS))
    def proxy(session_id: str, path: str) -> Response:
        return admitted(lambda body: core.proxy(session_id, request.method, path, request.query_string.decode(),
                                                body, dict(request.headers)), openai=is_openai_path(request.path))
