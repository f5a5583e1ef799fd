"""The session server's HTTP contract, declared once: the route table (:data:`ROUTES`) and the
parts of the contract around it. Imports nothing of the session core, so the router (the one
HTTP surface of both server modes, :mod:`webapp.router`) builds itself from it.

- :data:`ROUTES`: method(s), path, the op that serves it (:class:`webapp.ipc.Op`), how its body
  is read (:class:`Body`), whether it wants the API key; the router registers exactly these,
  the 404 text lists them, the auth rule exempts the ones marked open.

- The catch-all proxy ``/sessions/<id>/<path>`` (miles' ``session_proxy``): its methods and
  the client headers forwarded to the backend (the API key and hop-by-hop headers stay here).
- The session's generation (:data:`GENERATION_HEADER`): on the replies of the session routes; a
  route's request headers the owning shard reads (:attr:`Route.headers`: ``If-Match`` on
  ``DELETE /sessions/<id>``, a condition on that generation).
- ``GET /sessions/<id>?images=1`` (and ``/samples?images=1``): the session's images as well.
- The error shapes: OpenAI's ``{"error": {"message", "type", "code"}}`` under
  ``/sessions/<id>/v1/`` (the OpenAI routes) and ``/v1/`` (an OpenAI client whose base URL
  lacks the session), Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on
  ``/sessions/<id>/v1/messages`` (:func:`anthropic_error_body`), miles' ``{"error": "<text>"}``
  elsewhere.
- The 404 of a path no route serves (:func:`no_route_message`): it names the routes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from webapp.ipc import Op

__all__ = ["ANTHROPIC_ERROR_TYPES", "GENERATION_HEADER", "IMAGES_QUERY", "MESSAGES_PATH", "OPEN_PATHS", "PROXY_HEADERS", "PROXY_METHODS",
           "ROUTES", "Body", "Route", "anthropic_error_body", "is_anthropic_path", "is_openai_path",
           "no_route_message", "openai_error_body", "wants_images"]

PROXY_METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH")
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API, under the session (webapp.anthropic)
# The turns committed to the session (webapp.core.Session.generation), on every reply of a
# session route that names it: GET, DELETE (204 and 412), samples, chat and messages turns.
GENERATION_HEADER = "X-Miles-Session-Generation"


class Body(enum.Enum):
    """How a route's request body is read."""

    NONE = "none"  # not read (a body sent anyway is discarded by the server)
    SMALL = "small"  # read whole within the body timeout (http_body_timeout), one frame to the shard
    # counted against the server's bytes in flight (max_inflight_bytes: 503 past it) while it is
    # read and served; beyond one frame it is streamed on to the shard as it arrives
    CHAT = "chat"


@dataclass(frozen=True)
class Route:
    """One row of the route table. ``op`` None: the router answers itself (``/health`` asks
    every shard). ``auth``: wants ``Authorization: Bearer <key>`` when the server has a key.
    ``images``: honours ``?images=1``. ``backend``: may wait on the backend, so the chat deadline
    applies (the backend's connect + read timeouts and a margin) instead of the control one.
    ``text``: how the 404 of an unknown path names it (default: its methods and path).
    ``headers``: request headers handed to the owning shard (op meta ``headers``, names in
    lower case); the proxy's are :data:`PROXY_HEADERS`."""

    methods: tuple[str, ...]
    path: str  # a Flask rule
    op: Op | None
    body: Body = Body.NONE
    auth: bool = True
    images: bool = False
    backend: bool = False
    text: str = ""
    headers: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str:
        return self.op.value if self.op is not None else self.path.strip("/").replace("/", "_")


ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/sessions", Op.CREATE_SESSION),
    Route(("GET",), "/sessions/<session_id>", Op.GET_SESSION, images=True),
    # If-Match: delete only the session at that generation (else 412, nothing deleted)
    Route(("DELETE",), "/sessions/<session_id>", Op.DELETE_SESSION, headers=("If-Match",)),
    Route(("POST",), "/sessions/<session_id>/v1/chat/completions", Op.CHAT, Body.CHAT, backend=True),
    # the same turn as chat, asked and answered in Anthropic's Messages API (webapp.anthropic)
    Route(("POST",), "/sessions/<session_id>" + MESSAGES_PATH, Op.MESSAGES, Body.CHAT, backend=True),
    Route(("POST",), "/sessions/<session_id>/samples", Op.SAMPLES, Body.SMALL, images=True),
    # miles' catch-all (``session_proxy``): forwarded to the backend by the owning shard (``v1/models``)
    Route(PROXY_METHODS, "/sessions/<session_id>/<path:path>", Op.PROXY, Body.SMALL, backend=True,
          text="/sessions/<session_id>/<path> (proxied to the backend)"),
    # open: load balancers probe it, so it says nothing a client could learn from (no session count)
    Route(("GET",), "/health", None, auth=False),
)
OPEN_PATHS = frozenset(route.path for route in ROUTES if not route.auth)
PROXY_HEADERS = frozenset({"content-type", "accept"})
IMAGES_QUERY = "images"  # the query parameter asking for the session's images (pixels) too
_TRUE = frozenset({"1", "true", "yes", "on"})


def wants_images(value: str | None) -> bool:
    """The ``images`` query parameter's value (None: absent) -> include the images?"""
    return value is not None and value.strip().lower() in _TRUE


def is_openai_path(path: str) -> bool:
    """``/sessions/<id>/v1/...`` (and ``/v1/...``, an OpenAI client without the session in its
    base URL): the paths whose errors take OpenAI's shape."""
    parts = path.split("/", 4)
    return (len(parts) >= 4 and parts[1] == "sessions" and parts[3] == "v1") or (len(parts) >= 2 and parts[1] == "v1")


def is_anthropic_path(path: str) -> bool:
    """``/sessions/<id>/v1/messages``: the path whose errors take Anthropic's shape."""
    parts = path.split("/")
    return len(parts) == 5 and parts[1] == "sessions" and "/" + "/".join(parts[3:]) == MESSAGES_PATH


def no_route_message(method: str, path: str, base_url: str) -> str:
    """The 404 text of a path no route serves (``base_url``: the server's, ``http://HOST:PORT/``)."""
    base = base_url.rstrip("/")
    if path == "/v1" or path.startswith("/v1/"):
        return (f"{method} {path} is not a route: the OpenAI endpoints are per session. POST /sessions creates "
                f"one (it answers {{\"session_id\": ...}}), then {method} /sessions/<session_id>{path}; an OpenAI "
                f"client takes base_url={base}/sessions/<session_id>/v1 (docs/session-server.md)")
    return f"{method} {path} is not a route; the routes: {_ROUTE_LIST} (docs/session-server.md)"


def _route_list() -> str:
    """The table's routes as the 404 names them: one path's methods together, in table order."""
    by_path: dict[str, list[str]] = {}
    texts: dict[str, str] = {}
    for route in ROUTES:
        by_path.setdefault(route.path, []).extend(route.methods)
        texts[route.path] = route.text
    names = []
    for path, methods in by_path.items():
        shown = path.replace("<path:path>", "<path>")
        names.append(texts[path] or f"{' or '.join(methods)} {shown}")
    return ", ".join(names)


_ROUTE_LIST = _route_list()


def openai_error_body(message: str, type_: str, code: str) -> dict[str, dict[str, str]]:
    """OpenAI's error object, ``{"error": {"message", "type", "code"}}``."""
    return {"error": {"message": message, "type": type_, "code": code}}


# Anthropic's error types by HTTP status (its API reference; 529 is its "overloaded").
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """Anthropic's error object, ``{"type": "error", "error": {"type", "message"}}``: the type
    from the status (another 4xx: ``invalid_request_error``, another 5xx: ``api_error``)."""
    type_ = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": type_, "message": message}}
