"""The single-process session server: a Flask adapter over one ``SessionCore``.

``gunicorn -k gevent --no-control-socket 'webapp.app:create_app()'`` serves it. Settings come
from the arguments or, when ``config`` is None, from the environment:

- ``SHINKEN_BACKEND_URL``: the inference backend. Unset: the app starts the reference backend
  (``webapp.reference_backend``) as a subprocess of its own, the embedded default.
- ``SHINKEN_TOKENIZER``: a directory with ``tokenizer.json`` + chat template (unset: bytes).
- ``SHINKEN_REFERENCE_R3_LAYERS`` / ``SHINKEN_REFERENCE_R3_TOPK``: R3 shape of an embedded
  reference backend (default: no R3); routing replay follows it unless set.
- ``SHINKEN_<FIELD>`` for every number of :class:`webapp.core.CoreConfig`, e.g.
  ``SHINKEN_READ_TIMEOUT`` (what ``shinken-session-server --read-timeout`` sets).
- ``SHINKEN_ROUTING_REPLAY_LAYERS`` / ``SHINKEN_INDEXER_REPLAY``: the replay settings
  (``webapp.settings.replay_settings_from_env``).

Errors are ``{"error": "<text>"}`` on the session-management routes and OpenAI's
``{"error": {"message", "type", "code"}}`` under ``/sessions/<id>/v1/``.
- ``SHINKEN_BODY_TIMEOUT``: see :class:`webapp.http_limits.HttpLimits`; ``SHINKEN_MAX_SESSIONS``
  and the other integer limits of :class:`webapp.core.CoreConfig` likewise.

The app adds neither ``Server`` nor ``Date``: the WSGI server sends exactly one of each. A
chunked ``Reply`` body (a records GET) is handed to the server as an iterable of its chunks
with an explicit ``Content-Length``, so it is written chunk by chunk and never joined.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

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
from webapp.http_limits import BodyError, HttpLimits, read_body
from webapp.reference_backend import ReferenceBackendProcess, start_reference_backend
from webapp.routes import IMAGES_QUERY, PROXY_METHODS, is_openai_path, wants_images
from webapp.settings import number_settings_from_env, replay_settings_from_env

__all__ = ["CORE_EXTENSION_KEY", "create_app", "to_flask_response"]

CORE_EXTENSION_KEY = "shinken_session_core"


def to_flask_response(reply: Reply) -> Response:
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


def _config_from_env(kw: dict[str, Any]) -> tuple[CoreConfig, ReferenceBackendProcess | None]:
    tokenizer = kw.pop("tokenizer", None) or os.environ.get("SHINKEN_TOKENIZER") or None
    backend_url = kw.pop("backend_url", None) or os.environ.get("SHINKEN_BACKEND_URL") or None
    reference = None
    # The same SHINKEN_<FIELD> settings the router passes its workers (``--read-timeout``,
    # ``--max-prompt-tokens``, the replay settings...).
    settings = {**number_settings_from_env(CoreConfig), **replay_settings_from_env(), **kw}
    if backend_url is None:
        r3_layers = int(os.environ.get("SHINKEN_REFERENCE_R3_LAYERS", "0"))
        reference = start_reference_backend(
            tokenizer=tokenizer, r3_layers=r3_layers, r3_topk=int(os.environ.get("SHINKEN_REFERENCE_R3_TOPK", "8")))
        backend_url = reference.url
        # The embedded backend's R3 is asked for unless routing replay is set explicitly.
        settings.setdefault("routing_replay_layers", r3_layers)
    return CoreConfig(backend_url=backend_url, tokenizer=tokenizer, **settings), reference


def create_app(config: CoreConfig | None = None, **kw: Any) -> Flask:
    """The single-process session server app.

    ``config`` wins; keyword arguments override its fields (or, without it, build one with
    the environment as described in the module docstring).
    """
    if config is None:
        config, reference = _config_from_env(dict(kw))
    else:
        config, reference = dataclasses.replace(config, **kw), None
    core = build_session_core(config)

    def shutdown() -> None:
        core.close()
        if reference is not None:
            reference.close()

    atexit.register(shutdown)

    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = MAX_CHAT_BODY_BYTES
    app.extensions[CORE_EXTENSION_KEY] = core
    _add_routes(app, core, HttpLimits.from_env(), config.backend_url)
    return app


def _add_routes(app: Flask, core: SessionCore, http_limits: HttpLimits, backend_url: str) -> None:
    @app.errorhandler(BodyError)
    def body_error(exc: BodyError) -> Response:
        return to_flask_response(error_response(exc.status, str(exc)))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        status, message = exc.code or 500, exc.description or exc.name
        if is_openai_path(request.path):
            code = exc.name.lower().replace(" ", "_")
            return to_flask_response(openai_error_response(status, message, "invalid_request_error", code))
        return to_flask_response(error_response(status, message))

    @app.get("/health")
    def health() -> Response:
        reply = core.health()
        problem = probe_backend(backend_url)
        if reply.status != 200 or problem is None:
            body = {**json.loads(reply.body), "backend": "ok"} if reply.status == 200 else None
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
        body = read_body(request.stream, http_limits.body_timeout, request.content_length)
        return to_flask_response(core.chat(session_id, body))

    @app.post("/sessions/<session_id>/samples")
    def samples(session_id: str) -> Response:
        body = read_body(request.stream, http_limits.body_timeout, request.content_length)
        return to_flask_response(core.samples(session_id, body, wants_images(request.args.get(IMAGES_QUERY))))

    @app.route("/sessions/<session_id>/<path:path>", methods=list(PROXY_METHODS))
    def proxy(session_id: str, path: str) -> Response:
        body = read_body(request.stream, http_limits.body_timeout, request.content_length)
        return to_flask_response(core.proxy(session_id, request.method, path, request.query_string.decode(),
                                            body, dict(request.headers)))
