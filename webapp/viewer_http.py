"""The viewer's HTTP side, shared by both server modes: pages, its JSON API, auth, live fleets.

``install_viewer(app, source, api_key=..., instance=...)`` adds everything under ``/ui`` to a
Flask app. ``source`` answers the session reads (a :class:`ViewerSource`): the single-process
app wraps its core's ``webapp.viewer_data.ViewerData``; the router asks the owning worker (ops
``viewer_*``), fanning the session list out to every shard. Imports nothing of the session core.

Auth (when the server has an API key): a request passes with ``Authorization: Bearer <key>``
(scripts, the fleet publisher) or the viewer cookie. A browser cannot put a header on a page
load, so ``/ui/login`` takes the key in a form and sets ``shinken_viewer``: an HMAC of a
per-process random salt under the key (the key itself never sits in the browser; a restart or
a new key logs every viewer out), ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no
other site's page can send it, so no cross-site request forgery), ``Path=/ui``, ``Secure``
behind TLS. Without a key the viewer is as open as the API.

Every page is one static shell (``viewer_static/shell.html``) plus ``viewer.js``, which builds
the DOM with ``textContent`` only; a Content-Security-Policy of ``'self'`` forbids inline script,
so even a string that slipped into markup could not run. Read-only: the only writes are the
login cookie and the fleet frames a registered publisher pushes (bearer auth when keyed).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from flask import Flask, Response, request
from werkzeug.wrappers import Response as WerkzeugResponse  # what a source may answer (a router's relay)

from shinken_sync.fleet_wire import BatchError, decode_batch
from webapp.viewer_fleet import MAX_TILES, FleetError, FleetHub
from webapp.viewer_shape import UI_PREFIX, ViewerQueryError, is_viewer_path, page_of

__all__ = ["COOKIE_NAME", "STATIC_DIR", "ViewerSource", "install_viewer", "is_viewer_path"]

COOKIE_NAME = "shinken_viewer"
STATIC_DIR = Path(__file__).with_name("viewer_static")
STATIC_FILES = {"viewer.js": "text/javascript", "viewer.css": "text/css"}
PAGES = ("sessions", "session", "fleets", "fleet", "notfound", "login")
_SECURITY_HEADERS = (
    ("Content-Security-Policy", ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
                                 "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
)


class ViewerSource(Protocol):
    """The session reads; each returns a Flask response (status, content type, body)."""

    def sessions(self, prefix: str) -> tuple[list[dict[str, Any]], list[str]]:
        """Every session summary whose id starts with ``prefix``, and the shards that failed."""
        ...

    def summary(self, session_id: str) -> WerkzeugResponse: ...

    def timeline(self, session_id: str) -> WerkzeugResponse: ...

    def image(self, session_id: str, sha256: str) -> WerkzeugResponse: ...


def _json(status: int, obj: Any) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status=status, content_type="application/json")


def redirect(location: str, status: int) -> Response:
    return Response(b"", status=status, headers={"Location": location})


def _safe_next(value: str | None) -> str:
    """Where to go after login: a viewer path of this server only (no open redirect)."""
    if value and is_viewer_path(value.split("?", 1)[0]) and not value.startswith("//") and "\\" not in value:
        return value
    return UI_PREFIX + "/"


def install_viewer(app: Flask, source: ViewerSource, *, api_key: str | None, instance: str | None,
                   hub: FleetHub | None = None) -> FleetHub:
    """Add the viewer's routes to ``app``; the fleet hub it serves (a new one by default)."""
    hub = hub if hub is not None else FleetHub()
    shell = (STATIC_DIR / "shell.html").read_text(encoding="utf-8")
    salt = secrets.token_bytes(32)
    cookie_value = hmac.new(api_key.encode(), salt, hashlib.sha256).hexdigest() if api_key else ""
    expected_bearer = f"Bearer {api_key}".encode() if api_key else b""

    def authorized() -> bool:
        if not api_key:
            return True
        given = request.headers.get("Authorization", "").encode()
        if given and hmac.compare_digest(given, expected_bearer):
            return True
        return hmac.compare_digest(request.cookies.get(COOKIE_NAME, "").encode(), cookie_value.encode())

    def page(name: str, status: int = 200) -> Response:
        assert name in PAGES  # the shell names a fixed page: no request data enters the markup
        return Response(shell.replace("{{page}}", name), status=status, content_type="text/html; charset=utf-8")

    def guarded(view: Callable[..., Response], is_page: bool) -> Callable[..., Response]:
        def wrapper(**kw: Any) -> Response:
            if not authorized():
                if is_page:
                    return page("login", 401)
                response = _json(401, {"error": "missing or invalid API key (log in at /ui/login, or send "
                                                "'Authorization: Bearer <key>')"})
                response.headers["WWW-Authenticate"] = "Bearer"
                return response
            try:
                return view(**kw)
            except (FleetError, ViewerQueryError) as exc:
                return _json(exc.status, {"error": str(exc)})

        wrapper.__name__ = f"viewer_{view.__name__}"
        return wrapper

    def route(rule: str, methods: tuple[str, ...] = ("GET",), is_page: bool = False) -> Callable[..., Any]:
        def add(view: Callable[..., Response]) -> Callable[..., Response]:
            app.add_url_rule(UI_PREFIX + rule, view_func=guarded(view, is_page), methods=list(methods))
            return view
        return add

    @app.after_request
    def _headers(response: Response) -> Response:
        if is_viewer_path(request.path):
            for name, value in _SECURITY_HEADERS:
                response.headers.setdefault(name, value)
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    # -- login (unguarded) --------------------------------------------------------------------

    def login_form() -> Response:
        return page("login", 200)

    def login() -> Response:
        key = request.form.get("key", "")
        if not api_key:
            return redirect(_safe_next(request.form.get("next")), 303)
        if not hmac.compare_digest(key.encode(), api_key.encode()):
            return page("login", 401)
        response = redirect(_safe_next(request.form.get("next")), 303)
        response.set_cookie(COOKIE_NAME, cookie_value, httponly=True, samesite="Strict", path=UI_PREFIX,
                            secure=request.is_secure)
        return response

    def logout() -> Response:
        response = redirect(UI_PREFIX + "/login", 303)
        response.delete_cookie(COOKIE_NAME, path=UI_PREFIX, httponly=True, samesite="Strict")
        return response

    def static_file(name: str) -> Response:
        kind = STATIC_FILES.get(name)
        if kind is None:
            return _json(404, {"error": "no such file"})
        response = Response((STATIC_DIR / name).read_bytes(), content_type=f"{kind}; charset=utf-8")
        response.headers["Cache-Control"] = "no-cache"
        return response

    app.add_url_rule(UI_PREFIX + "/login", "viewer_login_form", login_form, methods=["GET"])
    app.add_url_rule(UI_PREFIX + "/login", "viewer_login", login, methods=["POST"])
    app.add_url_rule(UI_PREFIX + "/logout", "viewer_logout", logout, methods=["GET", "POST"])
    app.add_url_rule(UI_PREFIX + "/static/<name>", "viewer_static", static_file, methods=["GET"])

    # -- pages --------------------------------------------------------------------------------

    @route("", is_page=True)
    def root() -> Response:
        return redirect(UI_PREFIX + "/", 308)

    @route("/", is_page=True)
    def sessions_page() -> Response:
        return page("sessions")

    @route("/sessions/<session_id>", is_page=True)
    def session_page(session_id: str) -> Response:
        found = source.summary(session_id)
        if found.status_code == 404:
            return page("notfound", 404)
        return page("session", 200 if found.status_code == 200 else found.status_code)

    @route("/fleet", is_page=True)
    def fleets_page() -> Response:
        return page("fleets")

    @route("/fleet/<fleet_id>", is_page=True)
    def fleet_page(fleet_id: str) -> Response:
        try:
            hub.get(fleet_id)
        except FleetError:
            return page("notfound", 404)
        return page("fleet")

    # -- the JSON API ---------------------------------------------------------------------------

    @route("/api/sessions")
    def api_sessions() -> Response:
        rows, problems = source.sessions(request.args.get("prefix") or "")
        for row in rows:
            row["instance"] = instance
        return _json(200, {**page_of(rows, request.args), "unavailable": problems})

    @route("/api/sessions/<session_id>")
    def api_summary(session_id: str) -> WerkzeugResponse:
        return source.summary(session_id)

    @route("/api/sessions/<session_id>/timeline")
    def api_timeline(session_id: str) -> WerkzeugResponse:
        return source.timeline(session_id)

    @route("/api/sessions/<session_id>/images/<sha256>")
    def api_image(session_id: str, sha256: str) -> WerkzeugResponse:
        response = source.image(session_id, sha256)
        if response.status_code == 200:  # content-addressed: the same URL is the same bytes forever
            response.headers["Cache-Control"] = "private, max-age=31536000, immutable"
        return response

    @route("/api/fleets")
    def api_fleets() -> Response:
        return _json(200, {"fleets": hub.fleets()})

    @route("/api/fleets", methods=("POST",))
    def api_register() -> Response:
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            return _json(400, {"error": "expected a JSON object {name, tiles: [{tile_id, label}]}"})
        return _json(200, hub.register(body.get("name"), body.get("tiles")))

    @route("/api/fleets/<fleet_id>")
    def api_fleet(fleet_id: str) -> Response:
        return _json(200, hub.get(fleet_id).describe(time.monotonic()))

    @route("/api/fleets/<fleet_id>", methods=("DELETE",))
    def api_unregister(fleet_id: str) -> Response:
        hub.unregister(fleet_id)
        return Response(b"", status=204)

    @route("/api/fleets/<fleet_id>/heartbeat", methods=("POST",))
    def api_heartbeat(fleet_id: str) -> Response:
        return _json(200, hub.heartbeat(fleet_id))

    @route("/api/fleets/<fleet_id>/frames", methods=("POST",))
    def api_push(fleet_id: str) -> Response:
        """A batch of frames (``shinken_sync.fleet_wire``); answers each tile's seq and the focus."""
        try:
            frames = decode_batch(request.get_data(cache=False), MAX_TILES)
        except BatchError as exc:
            return _json(400, {"error": f"bad frame batch: {exc}"})
        seqs = hub.push_many(fleet_id, [(f.tile_id, f.data, f.mime, f.width, f.height) for f in frames])
        return _json(200, {"seqs": seqs, **hub.heartbeat(fleet_id)})

    @route("/api/fleets/<fleet_id>/tiles/<tile_id>/frame")
    def api_frame(fleet_id: str, tile_id: str) -> Response:
        tile = hub.frame(fleet_id, tile_id, after=request.args.get("after", -1, type=int),
                         wait=request.args.get("wait", 0.0, type=float), live=request.args.get("live") == "1")
        if not tile.data:
            return Response(b"", status=204, headers={"X-Frame-Seq": "0"})
        return Response(tile.data, content_type=tile.mime,
                        headers={"X-Frame-Seq": str(tile.seq), "X-Frame-Width": str(tile.width),
                                 "X-Frame-Height": str(tile.height)})

    return hub
